//! Growth: a new segment for a request the cache does not hold (`grow`: a classic segment, or a
//! stitched range, `stitch.rs`), and the one growth policy every backing's new memory comes
//! through (`obtain`: a classic segment's `cuMemAlloc`, a stitched range's `cuMemCreate`):
//! within the cap, returning idle cache to stay under it; idle cache back first where the
//! driver's free memory is short; on out-of-memory, everything reusable back and one more try;
//! and the error the caller sees when that fails too. The driver calls themselves may be made
//! without the device's lock (`growing.rs`).

use super::*;

impl DevicePool {
    /// Steps 3 to 5: a new segment of `segment` bytes, as one free block of `stream`.
    pub(super) fn grow(
        &mut self,
        cx: &Context<'_>,
        segment: u64,
        class: Class,
        stream: StreamHandle,
        requested: u64,
        mode: Grow,
    ) -> Result<BlockId> {
        // Memory made for this growth without the lock was asked for with the driver's figures
        // of the pass that deferred it: decided on them again, the pass decides the same.
        let (free, total) = match &self.prepared {
            Some(p) => p.driver_info(),
            None => self.driver_info(cx)?,
        };
        self.driver_total = total;
        if segment > total {
            self.stats.ooms += 1;
            return Err(Error::out_of_memory(format!(
                "device {}: requested {} is more than the device's total memory of {}; \
                 no amount of cache returned can serve it: split the allocation or use a larger device",
                self.device,
                human(requested),
                human(total)
            )));
        }
        if self.stitching(cx) {
            let (base, runs, lead) = self.stitch_growth(cx, (segment, requested), mode, free)?;
            let size = runs.iter().map(|r| r.pages.size).sum::<u64>() - lead;
            let id = self.install_segment(cx, (base + lead, size, lead), class, stream, runs);
            self.book_granted(cx, self.blocks[id].segment);
            return Ok(id);
        }
        let backing = Backing::Segment(class, stream);
        let Fresh::Segment(ptr) = self.obtain(cx, segment, requested, mode, free, backing)? else {
            unreachable!("a classic segment asked for")
        };
        self.add_reserved(segment, 1);
        Ok(self.install_segment(cx, (ptr, segment, 0), class, stream, Vec::new()))
    }

    /// The growth policy, for every backing: `bytes` of new memory of `backing`, within the cap
    /// (returning idle cache to stay under it, if `mode` allows); if the driver's free memory
    /// (`driver_free`) is short, idle cache goes back first; on out-of-memory, everything
    /// reusable goes back and the driver is asked once more. In a deferring pass that needs
    /// none of this, the call is deferred, to be made without the lock (`growing.rs`); in the
    /// next pass, the memory it made is taken.
    pub(super) fn obtain(
        &mut self,
        cx: &Context<'_>,
        bytes: u64,
        requested: u64,
        mode: Grow,
        driver_free: u64,
        backing: Backing,
    ) -> Result<Fresh> {
        let prepared = self.take_prepared(cx, backing, bytes);
        if prepared.is_none() && self.defer_growth(cx, backing, bytes, driver_free)? {
            // Unwinds the pass through its failure path; the caller sees the plan, not this.
            return Err(Error::internal(
                "growth deferred until the device's lock is free",
            ));
        }
        if let Err(err) = self.make_room(cx, bytes, requested, mode) {
            self.prepared = prepared;
            return Err(err);
        }
        // `bytes` are claimed, counted against a cap by every shard, until the caller books
        // what is made (under this same lock) or the attempt fails.
        let made =
            self.create_claimed(cx, (bytes, requested), mode, driver_free, backing, prepared);
        self.unclaim(bytes);
        made
    }

    /// [`DevicePool::obtain`]'s `bytes` (for a request of `requested`), their room claimed: made
    /// without the lock (`prepared`), or now, after idle cache went back where the driver's
    /// free memory is short; on out-of-memory, everything reusable back and one more try.
    fn create_claimed(
        &mut self,
        cx: &Context<'_>,
        (bytes, requested): (u64, u64),
        mode: Grow,
        driver_free: u64,
        backing: Backing,
        prepared: Option<Prepared>,
    ) -> Result<Fresh> {
        let device = self.device;
        let alloc = |driver: &dyn crate::driver::Driver| backing.create(driver, device, bytes);
        // The first try: made without the lock (its answer prepared), or now.
        let first = match prepared {
            Some(p) => p.made,
            None => {
                if mode == Grow::MayRelease
                    && driver_free < bytes
                    && self.config.release_before_grow
                {
                    // Classic segments: all idle ones, as PyTorch returns every cached segment
                    // when the driver refuses. Stitched: only the shortfall, since the cache's
                    // pages can be mapped into the new range instead.
                    let needed = match self.vmm {
                        VmmMode::On(_) => bytes - driver_free,
                        _ => u64::MAX,
                    };
                    let released = self.release_idle(cx, needed)?;
                    self.log(format_args!(
                        "driver has {} free, {} needed: returned {} of idle cache first",
                        human(driver_free),
                        human(bytes),
                        human(released)
                    ));
                }
                alloc(cx.driver)
            }
        };
        match first {
            Ok(got) => Ok(got),
            Err(err) if err.is_out_of_memory() && mode == Grow::MayRelease => {
                self.stats.oom_retries += 1;
                self.collect_pending(cx, true)?;
                let released = self.release_idle(cx, u64::MAX)?;
                self.log(format_args!(
                    "driver out of memory for {}: returned all {} reusable, retrying once",
                    human(bytes),
                    human(released)
                ));
                alloc(cx.driver).map_err(|err| self.alloc_failure(cx, err, requested, bytes))
            }
            Err(err) => Err(self.alloc_failure(cx, err, requested, bytes)),
        }
    }

    /// Room for `bytes` more, claimed ([`DevicePool::claim`]): under a memory limit, idle
    /// cache goes back first where the cap leaves too little (if `mode` allows), or the request
    /// fails with an out-of-memory error naming the limit.
    fn make_room(
        &mut self,
        cx: &Context<'_>,
        bytes: u64,
        requested: u64,
        mode: Grow,
    ) -> Result<()> {
        let allowed = self.room_under_cap(cx);
        if bytes > allowed && mode == Grow::MayRelease {
            // Under a cap, returning idle cache is the only way to grow.
            self.release_idle(cx, bytes - allowed)?;
        }
        if self.claim(cx, bytes) {
            return Ok(());
        }
        self.stats.ooms += 1;
        Err(Error::out_of_memory(format!(
            "device {}: requested {} (needing {} more from the driver) would take this pool past \
             its memory limit of {}: it reserves {}, of which {} is reusable. Raise the limit \
             (rm_set_memory_limit, or torch.cuda.set_per_process_memory_fraction), or release \
             blocks you no longer need",
            self.device,
            human(requested),
            human(bytes),
            human(self.limit().unwrap_or_default()),
            human(self.device_reserved(cx)),
            human(self.device_reusable(cx))
        )))
    }

    /// Claim room for `bytes` of new memory: counted as committed (see
    /// [`DevicePool::committed`]) until it is booked as reserved or the attempt ends
    /// ([`DevicePool::unclaim`]). Under a cap, false where the cap leaves too little. The check
    /// and the claim are made under the device's claim lock, and the claim published to the
    /// device's other shards before it is let go, so that two shards growing at once cannot
    /// both take the same room (each read the other's figure as of its last hold, and a shard
    /// making a segment under its lock grew past the cap beside another). Without a cap too:
    /// a cap set while this claim was unpublished would not count it. The lock is taken only
    /// where memory is about to be created, never on a cache hit.
    pub(super) fn claim(&mut self, cx: &Context<'_>, bytes: u64) -> bool {
        let _claiming = self.whole_device.claiming();
        if bytes > self.room_under_cap(cx) {
            return false;
        }
        self.growing += bytes;
        cx.publish_committed(self.committed());
        true
    }

    /// Give up a claim of `bytes` ([`DevicePool::claim`]): the memory is booked as reserved, or
    /// was not made.
    pub(super) fn unclaim(&mut self, bytes: u64) {
        self.growing -= bytes;
    }

    /// What the cap leaves to grow by (all there is without one): memory claimed for creation
    /// counts as reserved, and so does the device's other shards' (as they last published it).
    pub(super) fn room_under_cap(&self, cx: &Context<'_>) -> u64 {
        self.limit().map_or(u64::MAX, |limit| {
            limit.saturating_sub(self.device_committed(cx))
        })
    }

    /// Turn a failed driver allocation into the error the caller sees.
    fn alloc_failure(
        &mut self,
        cx: &Context<'_>,
        err: crate::driver::DriverError,
        requested: u64,
        segment: u64,
    ) -> Error {
        if !err.is_out_of_memory() {
            return Error::driver(
                &format!(
                    "device {}: allocating a {} segment",
                    self.device,
                    human(segment)
                ),
                &err,
            );
        }
        self.stats.ooms += 1;
        let driver_free = match cx.driver.mem_get_info(self.device) {
            Ok((free, _)) => human(free),
            Err(_) => "an unknown amount".to_string(),
        };
        Error::out_of_memory(format!(
            "device {}: out of memory: requested {} (a new segment of {}); this pool reserves {} \
             of which {} is reusable, and the driver reports {} free.{} Release blocks you no \
             longer need, or lower the batch or model size",
            self.device,
            human(requested),
            human(segment),
            human(self.device_reserved(cx)),
            human(self.device_reusable(cx)),
            driver_free,
            self.why_reusable_did_not_serve()
        ))
    }

    /// Why this pool's reusable memory could not serve a request that failed (empty where it
    /// holds none): the message's answer to "reusable and free add up to more than I asked".
    fn why_reusable_did_not_serve(&self) -> String {
        let reusable = self.stats.reusable();
        if reusable == 0 {
            return String::new();
        }
        let VmmMode::On(granularity) = self.vmm else {
            return format!(
                " The largest reusable block here is {}: without the driver's virtual-memory \
                 API free blocks cannot be joined, and a request larger than each needs a new \
                 segment.",
                human(self.stats().largest_reusable_block)
            );
        };
        // Pages gathered for the range that failed are out of the books until they go back.
        let layout = self.layout();
        let gathered: u64 = self.mapping.iter().map(|p| p.size).sum();
        let whole = layout.free_pages + layout.idle + gathered;
        let rests = reusable.saturating_sub(whole + layout.beside_live);
        let page = match granularity % (1 << 20) {
            0 => format!("{} MiB", granularity >> 20),
            _ => human(granularity),
        };
        let mut why = format!(
            " Of the reusable memory here, {} lies in whole free pages, which a new range maps \
             but which are too few with the driver's free memory, and {} in the unused parts of \
             {page} pages that live blocks also hold, which only requests that fit beside those \
             blocks can use",
            human(whole),
            human(layout.beside_live),
        );
        if rests > 0 {
            why += &format!(
                "; {} are rests of at most 1 MiB handed out with large blocks, which no large \
                 request could use (PyTorch's split rule)",
                human(rests)
            );
        }
        why + "."
    }
}
