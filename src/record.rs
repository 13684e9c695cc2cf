//! `RESMEM_CONF=record:PATH`: every allocator call of the process (C API, PyTorch entry points,
//! `LD_PRELOAD` hooks) written to PATH as a trace in `resmem replay`'s JSON-lines format
//! (`traces/README.md`), so that the policies can be compared on exactly this workload.
//!
//! - On the calling thread a recorded call takes the next number of the process's order of
//!   calls (one atomic add) and goes, binary, into its thread's ring (`ring.rs`): no lock, no
//!   formatting (`BENCHMARKS.md` has what it costs). A writer thread (`writer.rs`) empties the rings when one is half full, every
//!   quarter second, and when asked to flush; it puts the calls back in order, formats them
//!   (`line.rs`) and writes each round with one `write(2)` to the file, opened with `O_APPEND`:
//!   lines of several threads or processes never interleave. `%p` in PATH becomes the process
//!   id: one file per process.
//! - The order is what a replay needs: a call that happens before another (through the pool,
//!   or through the program handing a block from thread to thread) has a smaller number,
//!   because numbers come from one counter, whose additions follow happens-before. A release
//!   and a `record_stream` take their number *before* running, an allocation *after*: so a
//!   block's `free` line precedes the `alloc` line of whoever gets its address next, and its
//!   `alloc` line precedes everything done with it. (A number is taken even when the call then
//!   fails; it is written as nothing.) Block ids are the addresses, which CUDA keeps distinct
//!   across devices.
//! - A thread's ring outlives the thread: the writer empties it after the thread exits. At
//!   normal exit every call made so far is written before the process ends.
//! - Failing to open or write the file stops the recording with one line on stderr; the program
//!   and its allocations go on.
//! - PATH comes from `RESMEM_CONF`, which a setuid or setgid program ignores
//!   ([`crate::runtime::var`]).

mod line;
mod ring;
mod writer;

use std::cell::RefCell;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Result;
use crate::runtime;
use line::{push_u64, Call, Entry};
use ring::{Producer, Ring};
use writer::{lock, Shared};

/// The longest a flush waits for the writer thread (which gives up a missing call sooner).
const FLUSH_WAIT: Duration = Duration::from_secs(5);

/// Tells recorders apart in the threads' slots (a test opens several in one process).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's ring, for the recorder it was registered with.
    static RING: RefCell<Option<Local>> = const { RefCell::new(None) };
}

struct Local {
    recorder: u64,
    producer: Producer,
}

/// A trace being written to one file: callers number their calls and put them in their own
/// thread's ring; a writer thread puts them in order, formats them and writes them.
pub struct Recorder {
    shared: Arc<Shared>,
    id: u64,
    /// The process that opened the file: a forked child (which has no writer thread) stops
    /// recording instead of waiting for a writer that is not there.
    pid: u32,
    /// The writer thread, woken by `unpark`.
    writer: Thread,
    /// Joined when the recorder is dropped.
    joined: Option<JoinHandle<()>>,
}

/// A call that has its number and is recorded, as what it turned out to be, when dropped.
struct Placed<'a> {
    recorder: &'a Recorder,
    entry: Entry,
}

impl Drop for Placed<'_> {
    fn drop(&mut self) {
        self.recorder.put(self.entry);
    }
}

impl Recorder {
    /// Open `path` (`%p` replaced by the process id) for appending, start the trace with a
    /// `meta` line when the file is new (`device_memory`: device 0's total), and start the
    /// writer thread. On failure, the message to print.
    pub fn open(path: &str, device_memory: Option<u64>) -> std::result::Result<Recorder, String> {
        let pid = std::process::id();
        let path = path.replace("%p", &pid.to_string());
        let cannot =
            |e: std::io::Error| format!("resmem: cannot record to {path}: {e}; not recording");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(cannot)?;
        let mut meta = Vec::new();
        if file.metadata().map(|m| m.len() == 0).unwrap_or(false) {
            meta.extend_from_slice(br#"{"op":"meta","name":"recorded""#);
            if let Some(bytes) = device_memory {
                meta.extend_from_slice(br#","device_memory":"#);
                push_u64(&mut meta, bytes);
            }
            meta.extend_from_slice(br#","description":"recorded by resmem from process "#);
            push_u64(&mut meta, pid.into());
            meta.extend_from_slice(b"\"}\n");
        }
        let shared = Arc::new(Shared::new(path.clone()));
        let for_writer = Arc::clone(&shared);
        crate::unload::pin();
        let writer = std::thread::Builder::new()
            .name("resmem-record".into())
            .spawn(move || writer::run(file, &for_writer, meta))
            .map_err(cannot)?;
        Ok(Recorder {
            shared,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            pid,
            writer: writer.thread().clone(),
            joined: Some(writer),
        })
    }

    /// The file being written.
    pub fn path(&self) -> &str {
        &self.shared.path
    }

    /// Whether calls are still being recorded.
    pub fn is_recording(&self) -> bool {
        self.shared.on.load(Ordering::Relaxed)
    }

    /// The next number of the order. Relaxed is enough: the additions to one counter follow
    /// happens-before (write-write coherence), and the entry itself reaches the writer through
    /// its ring's release store.
    #[inline]
    fn take_place(&self) -> u64 {
        self.shared.order.0.fetch_add(1, Ordering::Relaxed)
    }

    /// Record a call with its new number.
    #[inline]
    fn record(&self, call: Call) {
        let seq = self.take_place();
        self.put(Entry { seq, call });
    }

    /// Put a numbered call in this thread's ring.
    #[inline]
    fn put(&self, entry: Entry) {
        let pushed = RING.try_with(|slot| match slot.try_borrow_mut() {
            Ok(mut local) => match &mut *local {
                Some(local) if local.recorder == self.id => {
                    self.push(&mut local.producer, entry);
                    true
                }
                _ => false,
            },
            Err(_) => false,
        });
        if pushed != Ok(true) {
            self.put_first(entry);
        }
    }

    /// This thread's first call for this recorder: register a ring. A thread whose
    /// thread-locals are already destroyed hands its calls over one by one, under a lock.
    #[cold]
    fn put_first(&self, entry: Entry) {
        if self.forked() {
            return;
        }
        let registered = RING.try_with(|slot| {
            let Ok(mut local) = slot.try_borrow_mut() else {
                return false;
            };
            let ring = Arc::new(Ring::new());
            lock(&self.shared.rings).push(Arc::clone(&ring));
            let mut producer = Producer::new(ring);
            self.push(&mut producer, entry);
            // The ring of another recorder, if any, is closed by its producer's drop.
            *local = Some(Local {
                recorder: self.id,
                producer,
            });
            true
        });
        if registered != Ok(true) {
            lock(&self.shared.stray).push(entry);
        }
    }

    #[inline]
    fn push(&self, producer: &mut Producer, entry: Entry) {
        match producer.push(entry) {
            Some(true) => self.wake_writer(),
            Some(false) => {}
            None => self.push_when_room(producer, entry),
        }
    }

    /// The ring is full: the writer sets the pace. Sleep until it has emptied the rings (it
    /// wakes the threads that wait), unless recording stopped.
    #[cold]
    fn push_when_room(&self, producer: &mut Producer, entry: Entry) {
        loop {
            if !self.is_recording() || self.forked() {
                return;
            }
            lock(&self.shared.stalled).push(std::thread::current());
            self.wake_writer();
            // A bound on the sleep, in case the writer emptied the ring before this thread
            // was on its list.
            std::thread::park_timeout(Duration::from_millis(1));
            if producer.push(entry).is_some() {
                return;
            }
        }
    }

    fn wake_writer(&self) {
        self.writer.unpark();
    }

    /// Whether this is a forked child, which has no writer thread; it then stops recording.
    fn forked(&self) -> bool {
        let forked = std::process::id() != self.pid;
        if forked {
            self.shared.on.store(false, Ordering::Relaxed);
        }
        forked
    }

    /// Write everything recorded so far, and return once it is in the file (or recording
    /// stopped). A call still under way in another thread is waited for a moment, then written
    /// when it ends.
    pub fn flush(&self) {
        if self.forked() || !self.is_recording() {
            return;
        }
        let target = self.shared.order.0.load(Ordering::Relaxed);
        let deadline = Instant::now() + FLUSH_WAIT;
        let mut progress = self.shared.progress();
        progress.wanted = progress.wanted.max(target);
        let rounds = progress.rounds + 2;
        progress.wanted_rounds = progress.wanted_rounds.max(rounds);
        self.wake_writer();
        while (progress.written_below < target || progress.rounds < rounds) && self.is_recording() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return;
            };
            progress = self
                .shared
                .written
                .wait_timeout(progress, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// A successful reservation of `size` bytes at `ptr` (0 for size 0: nothing is recorded).
    /// Numbered after the reservation: after the release that gave the address back.
    pub fn alloc(&self, device: i32, size: u64, stream: StreamHandle, ptr: DevicePtr) {
        if ptr != 0 && self.is_recording() {
            self.record(Call::Alloc {
                device,
                size,
                stream,
                ptr,
            });
        }
    }

    /// A reservation that failed with out-of-memory, as a `mark` (the replay has no block for it).
    pub fn out_of_memory(&self, device: i32, size: u64) {
        if self.is_recording() {
            self.record(Call::OutOfMemory { device, size });
        }
    }

    /// Run `call`, numbered before it runs, and record `recorded` if it succeeds.
    fn numbered_before(&self, recorded: Call, call: impl FnOnce() -> Result<()>) -> Result<()> {
        if !self.is_recording() {
            return call();
        }
        let mut placed = Placed {
            recorder: self,
            entry: Entry {
                seq: self.take_place(),
                call: Call::Skip,
            },
        };
        let result = call();
        if result.is_ok() {
            placed.entry.call = recorded;
        }
        result
    }

    /// Run the release of `ptr` and record it if it succeeds. Numbered before it runs: before
    /// the reservation that gets the address next.
    pub fn release(&self, ptr: DevicePtr, release: impl FnOnce() -> Result<()>) -> Result<()> {
        let recorded = if ptr == 0 {
            Call::Skip
        } else {
            Call::Free { ptr }
        };
        self.numbered_before(recorded, release)
    }

    /// Run `record_stream(ptr, stream)` and record it if it succeeds (numbered before it runs,
    /// like a release).
    pub fn record_stream(
        &self,
        ptr: DevicePtr,
        stream: StreamHandle,
        call: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.numbered_before(Call::RecordStream { ptr, stream }, call)
    }

    /// A successful `rm_warmup(device, bytes)`.
    pub fn warmup(&self, device: i32, bytes: u64) {
        if self.is_recording() {
            self.record(Call::Warmup { device, bytes });
        }
    }

    /// A successful `rm_free_reusable` (`None`: every device).
    pub fn empty_cache(&self, device: Option<i32>) {
        if self.is_recording() {
            self.record(Call::EmptyCache { device });
        }
    }
}

impl Drop for Recorder {
    /// Write what is left, then stop the writer thread.
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            return;
        }
        self.flush();
        self.shared.stop.store(true, Ordering::Release);
        self.wake_writer();
        if let Some(writer) = self.joined.take() {
            let _ = writer.join();
        }
    }
}

static RECORDER: OnceLock<Option<Recorder>> = OnceLock::new();

/// The process's recorder, opened on first use when `RESMEM_CONF` has `record:PATH`; `None`
/// when it has not, or the file could not be opened (said once on stderr).
pub fn global() -> Option<&'static Recorder> {
    RECORDER
        .get_or_init(|| {
            let path = runtime::settings().ok()?.record.as_deref()?;
            let device_memory = runtime::started()
                .and_then(|pool| pool.mem_get_info(0).ok())
                .map(|(_, total)| total);
            match Recorder::open(path, device_memory) {
                Ok(recorder) => {
                    // SAFETY: `flush_at_exit` is an `extern "C" fn()` that never unwinds (its
                    // body cannot panic past the lock it recovers); registered once.
                    unsafe { libc::atexit(flush_at_exit) };
                    Some(recorder)
                }
                Err(message) => {
                    let _ = writeln!(std::io::stderr(), "{message}");
                    None
                }
            }
        })
        .as_ref()
}

extern "C" fn flush_at_exit() {
    if let Some(Some(recorder)) = RECORDER.get() {
        recorder.flush();
    }
}

/// Record a reservation's outcome: `Ok(ptr)` as an `alloc`, out-of-memory as a `mark`.
pub fn reserved(device: i32, size: u64, stream: StreamHandle, outcome: &Result<DevicePtr>) {
    if let Some(r) = global() {
        match outcome {
            Ok(ptr) => r.alloc(device, size, stream, *ptr),
            Err(e) if e.is_out_of_memory() => r.out_of_memory(device, size),
            Err(_) => {}
        }
    }
}

/// Release `ptr` with `release`, recorded as a `free` when it succeeds.
pub fn release(ptr: DevicePtr, release: impl FnOnce() -> Result<()>) -> Result<()> {
    match global() {
        Some(r) => r.release(ptr, release),
        None => release(),
    }
}

/// `record_stream` through `call`, recorded when it succeeds.
pub fn record_stream(
    ptr: DevicePtr,
    stream: StreamHandle,
    call: impl FnOnce() -> Result<()>,
) -> Result<()> {
    match global() {
        Some(r) => r.record_stream(ptr, stream, call),
        None => call(),
    }
}

/// A successful warm-up of `bytes` on `device`.
pub fn warmed_up(device: i32, bytes: u64) {
    if let Some(r) = global() {
        r.warmup(device, bytes);
    }
}

/// A successful return of idle cache (`None`: every device).
pub fn emptied(device: Option<i32>) {
    if let Some(r) = global() {
        r.empty_cache(device);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn scratch(name: &str) -> String {
        let dir = std::env::temp_dir().join(format!("resmem-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        path.to_string_lossy().into_owned()
    }

    #[test]
    fn every_call_becomes_one_line_of_the_replay_format() {
        let path = scratch("calls-%p.jsonl");
        let r = Recorder::open(&path, Some(24 << 30)).unwrap();
        assert!(r
            .path()
            .ends_with(&format!("calls-{}.jsonl", std::process::id())));
        r.alloc(0, 1000, 0, 0x7000_0000_0000);
        r.alloc(1, 0, 0, 0); // size 0: nothing
        r.alloc(1, 4096, 0x55, 0x7100_0000_0200);
        r.record_stream(0x7000_0000_0000, 0x66, || Ok(())).unwrap();
        r.release(0x7000_0000_0000, || Ok(())).unwrap();
        let failed = r.release(0x1234, || Err(Error::invalid_pointer("unknown")));
        assert!(failed.is_err());
        r.warmup(1, 8 << 20);
        r.empty_cache(Some(1));
        r.empty_cache(None);
        r.out_of_memory(0, 1 << 50);
        r.flush();
        let text = std::fs::read_to_string(r.path()).unwrap();
        let pid = std::process::id();
        let expected = format!(
            "{{\"op\":\"meta\",\"name\":\"recorded\",\"device_memory\":25769803776,\"description\":\"recorded by resmem from process {pid}\"}}\n\
             {{\"op\":\"alloc\",\"id\":123145302310912,\"size\":1000,\"stream\":0,\"device\":0}}\n\
             {{\"op\":\"alloc\",\"id\":124244813939200,\"size\":4096,\"stream\":85,\"device\":1}}\n\
             {{\"op\":\"record_stream\",\"id\":123145302310912,\"stream\":102}}\n\
             {{\"op\":\"free\",\"id\":123145302310912}}\n\
             {{\"op\":\"warmup\",\"bytes\":8388608,\"device\":1}}\n\
             {{\"op\":\"empty_cache\",\"device\":1}}\n\
             {{\"op\":\"empty_cache\"}}\n\
             {{\"op\":\"mark\",\"label\":\"out of memory: 1125899906842624 bytes on device 0\"}}\n"
        );
        assert_eq!(text, expected);
    }

    #[test]
    fn an_existing_trace_is_appended_to_without_a_second_meta_line() {
        let path = scratch("append.jsonl");
        let first = Recorder::open(&path, None).unwrap();
        first.alloc(0, 512, 0, 512);
        first.flush();
        let second = Recorder::open(&path, None).unwrap();
        second.release(512, || Ok(())).unwrap();
        second.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with(r#"{"op":"meta","name":"recorded","description""#));
        assert_eq!(
            lines[1],
            r#"{"op":"alloc","id":512,"size":512,"stream":0,"device":0}"#
        );
        assert_eq!(lines[2], r#"{"op":"free","id":512}"#);
    }

    #[test]
    fn a_threads_calls_reach_the_file_after_the_thread_exits() {
        let path = scratch("thread-exit.jsonl");
        let r = Recorder::open(&path, None).unwrap();
        let n = 3 * ring::CAPACITY as u64 + 10; // more than a ring holds: the thread waits for room
        std::thread::scope(|s| {
            s.spawn(|| {
                for k in 1..=n {
                    r.alloc(0, 512, 0, 512 * k);
                }
            });
        });
        r.flush();
        let written = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = written.lines().collect();
        assert_eq!(lines.len(), 1 + n as usize);
        for (k, line) in lines[1..].iter().enumerate() {
            let id = 512 * (k as u64 + 1);
            assert_eq!(
                *line,
                format!(r#"{{"op":"alloc","id":{id},"size":512,"stream":0,"device":0}}"#)
            );
        }
        // The exited thread's ring was forgotten once emptied.
        assert!(lock(&r.shared.rings).len() <= 1);
    }

    /// Run `body` while another thread's recorded release of 0x1000 is inside the pool call
    /// (its order number taken, its line not yet pushed); the release ends after `body`.
    fn while_a_release_is_under_way(r: &Recorder, body: impl FnOnce()) {
        let (inside, started) = std::sync::mpsc::channel();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            s.spawn(move || {
                r.release(0x1000, || {
                    inside.send(()).unwrap();
                    wait.recv().unwrap();
                    Ok(())
                })
                .unwrap();
            });
            started.recv().unwrap();
            body();
            go.send(()).unwrap();
        });
    }

    #[test]
    fn a_release_comes_before_the_calls_made_after_it_started_in_other_threads() {
        let path = scratch("order.jsonl");
        let r = Recorder::open(&path, None).unwrap();
        r.alloc(0, 512, 0, 0x1000); // this thread's ring is drained first
        while_a_release_is_under_way(&r, || {
            // The release has its place: these come after it, though pushed before it.
            r.alloc(0, 512, 0, 0x2000);
            r.alloc(0, 512, 0, 0x1000);
        });
        r.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().skip(1).collect();
        assert_eq!(
            lines,
            [
                r#"{"op":"alloc","id":4096,"size":512,"stream":0,"device":0}"#,
                r#"{"op":"free","id":4096}"#,
                r#"{"op":"alloc","id":8192,"size":512,"stream":0,"device":0}"#,
                r#"{"op":"alloc","id":4096,"size":512,"stream":0,"device":0}"#,
            ]
        );
    }

    #[test]
    fn a_flush_does_not_wait_forever_for_a_call_still_under_way() {
        let path = scratch("stuck.jsonl");
        let r = Recorder::open(&path, None).unwrap();
        while_a_release_is_under_way(&r, || {
            r.alloc(0, 512, 0, 0x2000);
            r.flush();
            // The release's place was given up: what followed it is written.
            let text = std::fs::read_to_string(&path).unwrap();
            assert_eq!(
                text.lines().skip(1).collect::<Vec<_>>(),
                [r#"{"op":"alloc","id":8192,"size":512,"stream":0,"device":0}"#]
            );
        });
        r.flush();
        // The release, once over, is written late rather than lost.
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().last(), Some(r#"{"op":"free","id":4096}"#));
        assert_eq!(text.lines().count(), 3);
    }

    #[test]
    fn a_call_from_a_thread_local_destructor_after_the_ring_is_gone_is_recorded() {
        static RECORDER: OnceLock<Recorder> = OnceLock::new();
        struct Late;
        impl Drop for Late {
            fn drop(&mut self) {
                RECORDER.get().unwrap().alloc(0, 512, 0, 0x3000);
            }
        }
        thread_local! {
            static LATE: Late = const { Late };
        }
        let path = scratch("late.jsonl");
        let r = RECORDER.get_or_init(|| Recorder::open(&path, None).unwrap());
        std::thread::spawn(|| {
            // Registered first, destroyed last: after this thread's ring.
            LATE.with(|_| {});
            RECORDER.get().unwrap().alloc(0, 512, 0, 0x1000);
        })
        .join()
        .unwrap();
        r.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text.lines().skip(1).collect::<Vec<_>>(),
            [
                r#"{"op":"alloc","id":4096,"size":512,"stream":0,"device":0}"#,
                r#"{"op":"alloc","id":12288,"size":512,"stream":0,"device":0}"#,
            ]
        );
        assert!(lock(&r.shared.stray).is_empty());
    }

    #[test]
    fn a_write_error_stops_the_recording_and_the_calls_go_on() {
        // /dev/full accepts the open and fails every write with ENOSPC.
        let r = Recorder::open("/dev/full", None).unwrap();
        r.alloc(0, 512, 0, 512);
        r.flush();
        assert!(!r.is_recording());
        // The release itself still runs and its result comes back.
        let mut released = false;
        r.release(512, || {
            released = true;
            Ok(())
        })
        .unwrap();
        assert!(released);
        // Stopped: calls take no place any more.
        let taken = r.shared.order.0.load(Ordering::Relaxed);
        r.alloc(0, 512, 0, 1024);
        r.warmup(0, 512);
        assert_eq!(r.shared.order.0.load(Ordering::Relaxed), taken);
    }

    #[test]
    fn a_file_that_cannot_be_opened_says_so() {
        let e = Recorder::open("/nonexistent-dir/trace.jsonl", None)
            .err()
            .unwrap();
        assert!(
            e.starts_with("resmem: cannot record to /nonexistent-dir/trace.jsonl: "),
            "{e}"
        );
    }
}
