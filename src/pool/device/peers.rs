//! Peers: other devices given access to this device's mapped memory.
//!
//! Memory from `cuMemAlloc` is usable by a peer device once the program enables peer access
//! (`cudaDeviceEnablePeerAccess`), but memory mapped with the virtual-memory API only by the
//! devices each mapping names (`cuMemSetAccess`); a kernel on another device, or a copy between
//! devices, that uses a stitched range without access faults. So each device keeps a set of
//! peers (`WholeDevice::peers`, `pool/peers.rs` says which devices join it) and every stitched
//! range gives them access as it is mapped, in the same `cuMemSetAccess` call as the device's
//! own. A range mapped before a peer joined is given access by [`DevicePool::grant_peers`],
//! under the lock of its shard; each segment books the peers it was given (`Segment::granted`),
//! so that a range mapped without the lock while a peer joined (`growing.rs`), booked after
//! the shard's ranges were walked, is given the rest as it is booked.

use super::*;
use crate::driver::{Driver, DriverResult};

/// The devices of `peers`, a bit each, in order.
fn peer_list(peers: u64) -> Vec<i32> {
    (0..64).filter(|d| peers >> d & 1 == 1).collect()
}

/// Give `device` and its `peers` (bits) access to `[ptr, ptr + size)`, a new range: where the
/// driver refuses the peers, `device` alone, so that a peer the driver will not map for costs
/// the range nothing (the peers are asked again as the range is booked). Returns the peers
/// given access.
pub(super) fn set_access(
    driver: &dyn Driver,
    device: i32,
    (ptr, size): (DevicePtr, u64),
    peers: u64,
) -> DriverResult<u64> {
    if peers != 0
        && driver
            .vmm_set_access(device, ptr, size, &peer_list(peers))
            .is_ok()
    {
        return Ok(peers);
    }
    driver.vmm_set_access(device, ptr, size, &[]).map(|()| 0)
}

impl DevicePool {
    /// Book what the stitched segment `seg`, just installed, was mapped with
    /// (`DevicePool::mapped_for`), and give it the peers that joined since.
    pub(super) fn book_granted(&mut self, cx: &Context<'_>, seg: SegId) {
        self.segments[seg].granted = self.mapped_for;
        self.grant(cx, seg);
    }

    /// Give every stitched segment of this shard the device's peers it lacks. Returns the
    /// ranges that failed (each logged; their peers are asked again at the next walk).
    pub(crate) fn grant_peers(&mut self, cx: &Context<'_>) -> usize {
        let segs: Vec<SegId> = self
            .segments
            .ids()
            .filter(|&seg| {
                let s = &self.segments[seg];
                s.in_use && s.stitched
            })
            .collect();
        segs.into_iter().filter(|&seg| !self.grant(cx, seg)).count()
    }

    /// Give `seg` the device's peers it lacks: whether it has them all now. A failure is logged
    /// and leaves the segment as it was.
    fn grant(&mut self, cx: &Context<'_>, seg: SegId) -> bool {
        let lacking = self.whole_device.peers() & !self.segments[seg].granted;
        if lacking == 0 {
            return true;
        }
        let (ptr, size) = self.segments[seg].mapped();
        match cx
            .driver
            .vmm_set_access(self.device, ptr, size, &peer_list(lacking))
        {
            Ok(()) => {
                self.segments[seg].granted |= lacking;
                true
            }
            Err(e) => {
                self.log(format_args!(
                    "could not give devices {:?} access to the range at {ptr:#x}: {e}",
                    peer_list(lacking)
                ));
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::peer_list;

    #[test]
    fn a_set_of_peers_lists_its_devices_in_order() {
        assert_eq!(peer_list(0), Vec::<i32>::new());
        assert_eq!(peer_list(0b1010), vec![1, 3]);
        assert_eq!(peer_list(1 << 63), vec![63]);
    }
}
