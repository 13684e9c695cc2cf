//! The special stream handles: what the pool calls them, and what the driver is passed.
//!
//! `CU_STREAM_LEGACY` (`cudaStreamLegacy`, `0x1`) is the NULL stream under another name for
//! every driver call this library makes (none is a `_ptsz` variant): the pool knows it as stream
//! `0`, so that blocks released on one name are reused on the other at once.
//!
//! `CU_STREAM_PER_THREAD` (`cudaStreamPerThread`, `0x2`) is one value naming a different stream
//! in each host thread: the calling thread's own default stream. Kept as one stream, a block
//! released by one thread would be handed to another thread at once, its kernels on another
//! stream still reading it, with no order between the two. The pool instead knows each thread's
//! per-thread stream as a stream of its own, named by a key with the top bit set (no stream
//! handle, a pointer into the driver's memory, has it) and the thread's number, unique in the
//! process and never reused ([`key`]). The driver is passed `0x2` for the calling thread's key
//! only ([`handle`]); no handle names another thread's per-thread stream from this thread, so
//! recording an event on it fails, and the pool then waits for the whole device instead, as it
//! does for a destroyed stream: another thread's blocks are reused only after its work.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{DriverError, DriverResult, StreamHandle};

/// `CU_STREAM_LEGACY`: the NULL stream, by another name.
pub const CU_STREAM_LEGACY: StreamHandle = 0x1;

/// `CU_STREAM_PER_THREAD`: the calling thread's own default stream.
pub const CU_STREAM_PER_THREAD: StreamHandle = 0x2;

/// The bit that marks a key as a thread's per-thread stream.
const PER_THREAD: StreamHandle = 1 << 63;

/// `CUDA_ERROR_INVALID_HANDLE`.
const CUDA_ERROR_INVALID_HANDLE: i32 = 400;

/// The calling thread's per-thread stream key: its number, unique in the process, with the top
/// bit set (number 0, no thread's, where the thread's storage is already gone as it exits).
fn own_key() -> StreamHandle {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static KEY: StreamHandle = PER_THREAD | NEXT.fetch_add(1, Ordering::Relaxed);
    }
    KEY.try_with(|k| *k).unwrap_or(PER_THREAD)
}

/// The pool's name for the stream a caller passed: `0` for `CU_STREAM_LEGACY`, the calling
/// thread's key for `CU_STREAM_PER_THREAD`, any other value as it is.
#[inline(always)]
pub fn key(stream: StreamHandle) -> StreamHandle {
    match stream {
        CU_STREAM_LEGACY => 0,
        CU_STREAM_PER_THREAD => own_key(),
        other => other,
    }
}

/// The handle to pass the driver's `call` for the pool's stream `key`: `CU_STREAM_PER_THREAD`
/// for the calling thread's key, an error for another thread's (no handle names it here), any
/// other value as it is.
#[inline]
pub fn handle(call: &'static str, key: StreamHandle) -> DriverResult<StreamHandle> {
    if key & PER_THREAD == 0 {
        return Ok(key);
    }
    if key == own_key() {
        return Ok(CU_STREAM_PER_THREAD);
    }
    Err(DriverError {
        call,
        code: CUDA_ERROR_INVALID_HANDLE,
        name: "CUDA_ERROR_INVALID_HANDLE".to_string(),
        description: format!(
            "stream key {key:#x} is another thread's per-thread default stream, which no handle \
             names from this thread"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_legacy_stream_is_the_null_stream_and_other_handles_stay() {
        assert_eq!(key(CU_STREAM_LEGACY), 0);
        assert_eq!(key(0), 0);
        assert_eq!(key(0x7f00_0000_1000), 0x7f00_0000_1000);
        assert_eq!(
            handle("cuEventRecord", 0x7f00_0000_1000),
            Ok(0x7f00_0000_1000)
        );
    }

    #[test]
    fn each_thread_has_its_own_per_thread_stream_and_names_only_its_own() {
        let mine = key(CU_STREAM_PER_THREAD);
        assert_eq!(key(CU_STREAM_PER_THREAD), mine, "the same in one thread");
        assert_ne!(mine & PER_THREAD, 0);
        assert_eq!(handle("cuEventRecord", mine), Ok(CU_STREAM_PER_THREAD));
        let theirs = std::thread::spawn(|| {
            let theirs = key(CU_STREAM_PER_THREAD);
            assert_eq!(
                handle("cuStreamWaitEvent", theirs),
                Ok(CU_STREAM_PER_THREAD)
            );
            theirs
        })
        .join()
        .unwrap();
        assert_ne!(theirs, mine);
        let err = handle("cuStreamWaitEvent", theirs).unwrap_err();
        assert_eq!(
            (err.call, err.code),
            ("cuStreamWaitEvent", CUDA_ERROR_INVALID_HANDLE)
        );
        assert!(err.description.contains("another thread's"), "{err}");
        // A thread that ended does not give its number to a new one.
        let next = std::thread::spawn(|| key(CU_STREAM_PER_THREAD))
            .join()
            .unwrap();
        assert!(next != theirs && next != mine);
    }
}
