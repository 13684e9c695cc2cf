//! `RESMEM_CONF=record:PATH`: every allocator call of the process (C API, PyTorch entry points,
//! `LD_PRELOAD` hooks) written to PATH as a trace in `resmem replay`'s JSON-lines format
//! (`traces/README.md`), so that the policies can be compared on exactly this workload.
//!
//! - Calls go, binary, into one buffer under one lock (which orders them); every 2048 calls, and
//!   at exit, a writer thread formats the batch and writes it with one `write(2)` to the file,
//!   opened with `O_APPEND`: lines of several threads or processes never interleave. `%p` in
//!   PATH becomes the process id: one file per process.
//! - A release (and a `record_stream`) is recorded under that lock together with the pool call,
//!   so a block's `free` line always precedes the `alloc` line of whoever gets its address next.
//!   Block ids are the addresses, which CUDA keeps distinct across devices.
//! - Failing to open or write the file stops the recording with one line on stderr; the program
//!   and its allocations go on.
//! - PATH comes from `RESMEM_CONF`, which a setuid or setgid program ignores
//!   ([`crate::runtime::var`]).

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::driver::{DevicePtr, StreamHandle};
use crate::error::Result;
use crate::runtime;

/// Calls are handed to the writer thread this many at a time.
const BATCH: usize = 2048;

/// One recorded call, kept binary until the writer thread formats it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    Alloc {
        device: i32,
        size: u64,
        stream: StreamHandle,
        ptr: DevicePtr,
    },
    Free {
        ptr: DevicePtr,
    },
    RecordStream {
        ptr: DevicePtr,
        stream: StreamHandle,
    },
    Warmup {
        device: i32,
        bytes: u64,
    },
    EmptyCache {
        device: Option<i32>,
    },
    OutOfMemory {
        device: i32,
        size: u64,
    },
}

enum Message {
    /// Lines already formatted (the `meta` line).
    Text(Vec<u8>),
    Calls(Vec<Call>),
    /// Answer once everything sent before has been written.
    Flush(SyncSender<()>),
}

/// What the callers and the writer thread share.
struct Shared {
    path: String,
    /// False once recording stopped (a write failed): calls then skip the lock.
    on: AtomicBool,
}

/// A trace being written to one file: callers append calls to a buffer under one lock (which
/// also orders them), and a writer thread formats each full buffer and writes it with one
/// `write(2)`, so that formatting and the system call stay off the callers' path.
pub struct Recorder {
    shared: Arc<Shared>,
    /// The process that opened the file: a forked child (which has no writer thread) drops the
    /// parent's buffered calls instead of writing them a second time.
    pid: u32,
    state: Mutex<State>,
}

struct State {
    calls: Vec<Call>,
    to_writer: SyncSender<Message>,
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
        let shared = Arc::new(Shared {
            path: path.clone(),
            on: AtomicBool::new(true),
        });
        let (to_writer, from_callers) = sync_channel(4);
        let writer = Arc::clone(&shared);
        crate::unload::pin();
        std::thread::Builder::new()
            .name("resmem-record".into())
            .spawn(move || write_batches(file, &writer, from_callers))
            .map_err(cannot)?;
        if !meta.is_empty() {
            let _ = to_writer.send(Message::Text(meta));
        }
        Ok(Recorder {
            shared,
            pid,
            state: Mutex::new(State {
                calls: Vec::with_capacity(BATCH),
                to_writer,
            }),
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

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Append a call; hand the buffer to the writer when it is full.
    fn push(&self, state: &mut State, call: Call) {
        state.calls.push(call);
        if state.calls.len() >= BATCH {
            let calls = std::mem::replace(&mut state.calls, Vec::with_capacity(BATCH));
            // The writer only goes away when recording stopped; then the calls are dropped.
            let _ = state.to_writer.send(Message::Calls(calls));
        }
    }

    /// Write everything recorded so far, and return once it is in the file.
    pub fn flush(&self) {
        let (done, wait) = sync_channel(1);
        {
            let mut state = self.lock();
            if std::process::id() != self.pid {
                // A forked child: the calls are the parent's to write, and no writer runs here.
                state.calls.clear();
                self.shared.on.store(false, Ordering::Relaxed);
                return;
            }
            let calls = std::mem::take(&mut state.calls);
            if state.to_writer.send(Message::Calls(calls)).is_err()
                || state.to_writer.send(Message::Flush(done)).is_err()
            {
                return;
            }
        }
        let _ = wait.recv();
    }

    /// A successful reservation of `size` bytes at `ptr` (0 for size 0: nothing is recorded).
    pub fn alloc(&self, device: i32, size: u64, stream: StreamHandle, ptr: DevicePtr) {
        if ptr != 0 && self.is_recording() {
            let call = Call::Alloc {
                device,
                size,
                stream,
                ptr,
            };
            self.push(&mut self.lock(), call);
        }
    }

    /// A reservation that failed with out-of-memory, as a `mark` (the replay has no block for it).
    pub fn out_of_memory(&self, device: i32, size: u64) {
        if self.is_recording() {
            self.push(&mut self.lock(), Call::OutOfMemory { device, size });
        }
    }

    /// Run the release of `ptr` and record it if it succeeds, under the recorder's lock.
    pub fn release(&self, ptr: DevicePtr, release: impl FnOnce() -> Result<()>) -> Result<()> {
        if !self.is_recording() {
            return release();
        }
        let mut state = self.lock();
        let result = release();
        if result.is_ok() && ptr != 0 {
            self.push(&mut state, Call::Free { ptr });
        }
        result
    }

    /// Run `record_stream(ptr, stream)` and record it if it succeeds, under the recorder's lock.
    pub fn record_stream(
        &self,
        ptr: DevicePtr,
        stream: StreamHandle,
        call: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if !self.is_recording() {
            return call();
        }
        let mut state = self.lock();
        let result = call();
        if result.is_ok() {
            self.push(&mut state, Call::RecordStream { ptr, stream });
        }
        result
    }

    /// A successful `rm_warmup(device, bytes)`.
    pub fn warmup(&self, device: i32, bytes: u64) {
        if self.is_recording() {
            self.push(&mut self.lock(), Call::Warmup { device, bytes });
        }
    }

    /// A successful `rm_free_reusable` (`None`: every device).
    pub fn empty_cache(&self, device: Option<i32>) {
        if self.is_recording() {
            self.push(&mut self.lock(), Call::EmptyCache { device });
        }
    }
}

/// The writer thread: format each batch and write it with one `write(2)` (`O_APPEND`, so whole
/// lines land together even with other writers); the first failure stops the recording with
/// one line on stderr.
fn write_batches(mut file: File, shared: &Shared, messages: Receiver<Message>) {
    let mut text = Vec::with_capacity(BATCH * 96);
    for message in messages {
        text.clear();
        match message {
            Message::Text(lines) => text = lines,
            Message::Calls(calls) => {
                for call in &calls {
                    format_line(&mut text, call);
                }
            }
            Message::Flush(done) => {
                let _ = done.send(());
            }
        }
        if !text.is_empty() && shared.on.load(Ordering::Relaxed) {
            if let Err(e) = file.write_all(&text) {
                shared.on.store(false, Ordering::Relaxed);
                let _ = writeln!(
                    std::io::stderr(),
                    "resmem: recording to {} stopped: {e}; the program goes on unrecorded",
                    shared.path
                );
            }
        }
    }
}

/// `call` as one line of the replay format.
fn format_line(b: &mut Vec<u8>, call: &Call) {
    match *call {
        Call::Alloc {
            device,
            size,
            stream,
            ptr,
        } => {
            b.extend_from_slice(br#"{"op":"alloc","id":"#);
            push_u64(b, ptr);
            b.extend_from_slice(br#","size":"#);
            push_u64(b, size);
            b.extend_from_slice(br#","stream":"#);
            push_u64(b, stream);
            push_device(b, device);
        }
        Call::Free { ptr } => {
            b.extend_from_slice(br#"{"op":"free","id":"#);
            push_u64(b, ptr);
        }
        Call::RecordStream { ptr, stream } => {
            b.extend_from_slice(br#"{"op":"record_stream","id":"#);
            push_u64(b, ptr);
            b.extend_from_slice(br#","stream":"#);
            push_u64(b, stream);
        }
        Call::Warmup { device, bytes } => {
            b.extend_from_slice(br#"{"op":"warmup","bytes":"#);
            push_u64(b, bytes);
            push_device(b, device);
        }
        Call::EmptyCache { device } => {
            b.extend_from_slice(br#"{"op":"empty_cache""#);
            if let Some(device) = device {
                push_device(b, device);
            }
        }
        Call::OutOfMemory { device, size } => {
            b.extend_from_slice(br#"{"op":"mark","label":"out of memory: "#);
            push_u64(b, size);
            b.extend_from_slice(b" bytes on device ");
            push_i64(b, device.into());
            b.push(b'"');
        }
    }
    b.extend_from_slice(b"}\n");
}

fn push_device(b: &mut Vec<u8>, device: i32) {
    b.extend_from_slice(br#","device":"#);
    push_i64(b, device.into());
}

fn push_i64(b: &mut Vec<u8>, value: i64) {
    if value < 0 {
        b.push(b'-');
    }
    push_u64(b, value.unsigned_abs());
}

/// The decimal digits of 0 to 99, two by two.
const PAIRS: &[u8; 200] = b"00010203040506070809101112131415161718192021222324252627282930313233343536373839404142434445464748495051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899";

/// `value` in decimal, two digits per division, without going through `fmt`.
fn push_u64(b: &mut Vec<u8>, mut value: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    while value >= 100 {
        let pair = (value % 100) as usize * 2;
        value /= 100;
        i -= 2;
        digits[i..i + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if value >= 10 {
        let pair = value as usize * 2;
        i -= 2;
        digits[i..i + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        i -= 1;
        digits[i] = b'0' + value as u8;
    }
    b.extend_from_slice(&digits[i..]);
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
            Err(e) if e.status == crate::error::rm_status::RM_ERROR_OUT_OF_MEMORY => {
                r.out_of_memory(device, size)
            }
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
    fn calls_reach_the_file_in_whole_batches() {
        let path = scratch("batches.jsonl");
        let r = Recorder::open(&path, None).unwrap();
        r.flush();
        let meta = std::fs::read_to_string(&path).unwrap();
        assert_eq!(meta.lines().count(), 1, "{meta}");
        for n in 0..BATCH as u64 - 1 {
            r.alloc(0, 512, 0, 512 * (n + 1));
        }
        // One short of a batch: nothing handed to the writer yet.
        assert_eq!(std::fs::read_to_string(&path).unwrap(), meta);
        for n in BATCH as u64 - 1..2 * BATCH as u64 + 10 {
            r.alloc(0, 512, 0, 512 * (n + 1));
        }
        r.flush();
        let written = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = written.lines().collect();
        assert_eq!(lines.len(), 1 + 2 * BATCH + 10);
        assert_eq!(
            lines[2 * BATCH + 10],
            format!(
                r#"{{"op":"alloc","id":{},"size":512,"stream":0,"device":0}}"#,
                512 * (2 * BATCH + 10)
            )
        );
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
        r.alloc(0, 512, 0, 1024);
        assert!(r.lock().calls.is_empty());
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

    #[test]
    fn numbers_are_written_in_decimal() {
        let mut b = Vec::new();
        for v in [0, 7, 10, 99, 100, 512, 1000, u64::MAX] {
            push_u64(&mut b, v);
            b.push(b' ');
        }
        push_i64(&mut b, -1);
        assert_eq!(
            String::from_utf8(b).unwrap(),
            "0 7 10 99 100 512 1000 18446744073709551615 -1"
        );
    }
}
