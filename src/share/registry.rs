//! One device's registry: a small file shared by the resmem processes of one user that use the
//! device, mapped into each of them.
//!
//! The file (`<dir>/resmem-<uid>-<uuid>`, mode 0600) holds a header and one slot per process:
//! its pid and start time (so that a reused pid is never taken for the process), the reusable
//! bytes it would give up, the bytes it still wants, and the bytes others returned for it. Two
//! counters in the header are futex words: `requests` is bumped when a process posts what it
//! wants, `answers` when a process returned memory; waiters sleep on them across processes.
//!
//! Every field is an atomic, so a reader never sees a torn value. Claiming a slot and answering
//! requests happen under an exclusive `flock` of the file: the kernel drops it when its holder
//! exits or is killed, so a dead process never blocks the others, and every attempt to take it
//! is bounded in time. A slot whose process is gone is reclaimed by the next holder.
//!
//! A file that is not a registry of this device (another owner, other permissions, the wrong
//! size, another magic or UUID) is refused: [`Registry::open`] says why and the caller turns
//! sharing off.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The file's first bytes.
const MAGIC: [u8; 8] = *b"RESMEMS1";
/// Layout version.
const VERSION: u32 = 1;
/// Processes a registry has room for.
pub const SLOTS: usize = 64;

/// The first 64 bytes of the file.
#[repr(C)]
struct Header {
    magic: [u8; 8],
    version: u32,
    slots: u32,
    uuid: [u8; 16],
    /// Futex word, bumped when a process posts a request.
    requests: AtomicU32,
    /// Futex word, bumped when a process returned memory for a request.
    answers: AtomicU32,
    _reserved: [u64; 3],
}

/// One process's row, 64 bytes. `pid == 0`: free.
#[repr(C)]
pub struct Slot {
    pid: AtomicU64,
    start: AtomicU64,
    /// Which registry handle of the process (a process may open the registry more than once).
    token: AtomicU64,
    /// What the process would give up on request (its reusable bytes), as it last said.
    reusable: AtomicU64,
    /// Bytes it still wants from the others (0: no request open).
    want: AtomicU64,
    /// Bytes the others returned to the driver at its requests, ever.
    received: AtomicU64,
    _reserved: [u64; 2],
}

/// The whole file.
#[repr(C)]
struct Layout {
    header: Header,
    slots: [Slot; SLOTS],
}

/// The registry's size in bytes.
pub const FILE_BYTES: usize = std::mem::size_of::<Layout>();
const _: () = assert!(FILE_BYTES == 64 + 64 * SLOTS);

/// The start time of process `pid` (clock ticks after boot, `/proc/<pid>/stat` field 22);
/// `None` when there is no such process, or it has exited and only waits to be reaped (a
/// zombie holds no memory any more).
pub fn start_time(pid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    if matches!(fields.next()?, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// This process's effective user id.
pub fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The registry's file name for a device UUID and a user.
pub fn file_name(uuid: &[u8; 16], uid: u32) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("resmem-{uid}-{hex}")
}

/// Why a file found at the registry's path is refused, from what `fstat` says of it; `None`
/// when it may be a registry. Pure, for tests.
pub fn check_file(owner: u32, me: u32, mode: u32, size: u64, regular: bool) -> Option<String> {
    if !regular {
        Some("is not a regular file".into())
    } else if owner != me {
        Some(format!(
            "belongs to uid {owner}, not to this user (uid {me})"
        ))
    } else if mode & 0o077 != 0 {
        Some(format!(
            "has mode {:o}: other users could read or change it (a registry is 600)",
            mode & 0o777
        ))
    } else if size != FILE_BYTES as u64 {
        Some(format!(
            "is {size} bytes, not the {FILE_BYTES} of a registry"
        ))
    } else {
        None
    }
}

/// A registry, mapped.
pub struct Registry {
    file: File,
    map: *mut Layout,
    path: PathBuf,
    pid: u64,
    start: u64,
    token: u64,
}

// SAFETY: the mapping is shared memory that every process and thread accesses only through
// atomics (or the header's fields that nobody writes after creation); the pointer stays valid
// until drop.
unsafe impl Send for Registry {}
// SAFETY: as above.
unsafe impl Sync for Registry {}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Some(slot) = self.find_mine() {
            slot.want.store(0, Ordering::SeqCst);
            slot.pid.store(0, Ordering::SeqCst);
        }
        // SAFETY: the mapping was made by `open` with this length and is dropped once.
        unsafe { libc::munmap(self.map.cast(), FILE_BYTES) };
    }
}

/// Holds the registry's lock until dropped.
pub struct Locked<'a>(&'a Registry);

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // SAFETY: flock on the registry's own descriptor.
        unsafe { libc::flock(self.0.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Locked<'_> {
    /// The slots of other running processes, clearing those of processes that are gone.
    pub fn others(&self) -> Vec<&Slot> {
        let registry = self.0;
        registry
            .slots()
            .iter()
            .filter(|slot| {
                let pid = slot.pid.load(Ordering::SeqCst);
                let start = slot.start.load(Ordering::SeqCst);
                if pid == 0 || registry.is_mine(slot) {
                    return false;
                }
                if start_time(pid) != Some(start) {
                    slot.clear();
                    return false;
                }
                true
            })
            .collect()
    }
}

impl Slot {
    fn clear(&self) {
        self.pid.store(0, Ordering::SeqCst);
        self.reusable.store(0, Ordering::SeqCst);
        self.want.store(0, Ordering::SeqCst);
        self.received.store(0, Ordering::SeqCst);
    }

    /// Bytes the process still wants.
    pub fn wanted(&self) -> u64 {
        self.want.load(Ordering::SeqCst)
    }

    /// Note that `bytes` were returned for the process: less wanted, more received.
    pub fn answered(&self, bytes: u64) {
        let _ = self
            .want
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                Some(w.saturating_sub(bytes))
            });
        self.received.fetch_add(bytes, Ordering::SeqCst);
    }
}

impl Registry {
    /// Open the registry of device `uuid` in `dir`, creating it if there is none. An error says
    /// why a file there is refused, or what failed.
    pub fn open(dir: &Path, uuid: &[u8; 16]) -> Result<Registry, String> {
        let uid = uid();
        let path = dir.join(file_name(uuid, uid));
        let shown = path.display().to_string();
        if let Err(e) = create(&path, uuid) {
            return Err(format!("cannot create the registry {shown}: {e}"));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| format!("cannot open the registry {shown}: {e}"))?;
        let meta = file
            .metadata()
            .map_err(|e| format!("cannot stat the registry {shown}: {e}"))?;
        if let Some(why) = check_file(
            meta.uid(),
            uid,
            meta.mode(),
            meta.len(),
            meta.file_type().is_file(),
        ) {
            return Err(format!(
                "refusing the registry {shown}: it {why}; remove it"
            ));
        }
        // SAFETY: a shared read-write mapping of a file of exactly FILE_BYTES bytes (checked
        // above); the file may shrink later only by its owner's hand, which is this user.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(format!(
                "cannot map the registry {shown}: {}",
                io::Error::last_os_error()
            ));
        }
        let pid = u64::from(std::process::id());
        let registry = Registry {
            file,
            map: map.cast(),
            path,
            pid,
            start: start_time(pid).ok_or("cannot read this process's start time")?,
            token: {
                static NEXT: AtomicU64 = AtomicU64::new(1);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
        };
        let h = registry.header();
        if h.magic != MAGIC || h.version != VERSION || h.slots != SLOTS as u32 {
            return Err(format!(
                "refusing the registry {shown}: it does not start as a resmem registry \
                 (garbage or another version); remove it"
            ));
        }
        if &h.uuid != uuid {
            return Err(format!(
                "refusing the registry {shown}: it names another device; remove it"
            ));
        }
        Ok(registry)
    }

    /// Where the registry is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is valid and FILE_BYTES long until drop; fields written by other
        // processes are atomics.
        unsafe { &(*self.map).header }
    }

    fn slots(&self) -> &[Slot; SLOTS] {
        // SAFETY: as in `header`.
        unsafe { &(*self.map).slots }
    }

    fn is_mine(&self, s: &Slot) -> bool {
        s.pid.load(Ordering::SeqCst) == self.pid
            && s.start.load(Ordering::SeqCst) == self.start
            && s.token.load(Ordering::SeqCst) == self.token
    }

    fn find_mine(&self) -> Option<&Slot> {
        self.slots().iter().find(|s| self.is_mine(s))
    }

    /// Take the lock, trying until `deadline`; `None` if another process kept it that long.
    pub fn lock_until(&self, deadline: Instant) -> Option<Locked<'_>> {
        loop {
            // SAFETY: flock on the registry's own descriptor.
            if unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Some(Locked(self));
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// This process's slot, claimed under the lock if it has none (clearing slots of processes
    /// that are gone on the way); `None` when every slot is taken by a running process.
    pub fn mine(&self, lock: &Locked<'_>) -> Option<&Slot> {
        if let Some(slot) = self.find_mine() {
            return Some(slot);
        }
        let _ = lock.others();
        let slot = self
            .slots()
            .iter()
            .find(|s| s.pid.load(Ordering::SeqCst) == 0)?;
        slot.clear();
        slot.start.store(self.start, Ordering::SeqCst);
        slot.token.store(self.token, Ordering::SeqCst);
        slot.pid.store(self.pid, Ordering::SeqCst);
        Some(slot)
    }

    /// This process's slot if it has claimed one.
    pub fn own(&self) -> Option<&Slot> {
        self.find_mine()
    }

    /// Say how many reusable bytes this process would give up.
    pub fn publish(&self, reusable: u64) {
        if let Some(slot) = self.find_mine() {
            slot.reusable.store(reusable, Ordering::SeqCst);
        }
    }

    /// The reusable bytes the other running processes said they would give up.
    pub fn others_reusable(&self) -> u64 {
        self.slots()
            .iter()
            .filter(|s| {
                let (pid, start) = (s.pid.load(Ordering::SeqCst), s.start.load(Ordering::SeqCst));
                pid != 0 && !self.is_mine(s) && start_time(pid) == Some(start)
            })
            .map(|s| s.reusable.load(Ordering::SeqCst))
            .fold(0, u64::saturating_add)
    }

    /// Post a request for `bytes` in this process's slot and wake the others. Returns what the
    /// slot had received before, to measure the answer against.
    pub fn post(&self, slot: &Slot, bytes: u64) -> u64 {
        let before = slot.received.load(Ordering::SeqCst);
        slot.want.store(bytes, Ordering::SeqCst);
        self.header().requests.fetch_add(1, Ordering::SeqCst);
        futex_wake(&self.header().requests);
        before
    }

    /// Close this process's request; the bytes received since `before`.
    pub fn close(&self, slot: &Slot, before: u64) -> u64 {
        slot.want.store(0, Ordering::SeqCst);
        slot.received
            .load(Ordering::SeqCst)
            .wrapping_sub(before)
            .min(u64::MAX / 2)
    }

    /// The request counter, to wait on.
    pub fn requests(&self) -> u32 {
        self.header().requests.load(Ordering::SeqCst)
    }

    /// The answer counter, to wait on.
    pub fn answers(&self) -> u32 {
        self.header().answers.load(Ordering::SeqCst)
    }

    /// Sleep until the request counter moves from `seen`, or `timeout`.
    pub fn wait_requests(&self, seen: u32, timeout: Duration) {
        futex_wait(&self.header().requests, seen, timeout);
    }

    /// Sleep until the answer counter moves from `seen`, or `timeout`.
    pub fn wait_answers(&self, seen: u32, timeout: Duration) {
        futex_wait(&self.header().answers, seen, timeout);
    }

    /// Tell the waiting processes that memory was returned.
    pub fn announce(&self) {
        self.header().answers.fetch_add(1, Ordering::SeqCst);
        futex_wake(&self.header().answers);
    }
}

/// Create the registry at `path` unless a file is there: written whole under a temporary name,
/// then linked into place, so that no process ever opens a half-written registry.
fn create(path: &Path, uuid: &[u8; 16]) -> io::Result<()> {
    if std::fs::symlink_metadata(path).is_ok() {
        return Ok(());
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)?;
    let mut bytes = vec![0u8; FILE_BYTES];
    bytes[..8].copy_from_slice(&MAGIC);
    bytes[8..12].copy_from_slice(&VERSION.to_ne_bytes());
    bytes[12..16].copy_from_slice(&(SLOTS as u32).to_ne_bytes());
    bytes[16..32].copy_from_slice(uuid);
    let written = file.write_all(&bytes);
    drop(file);
    let linked = written.and_then(|()| {
        let (from, to) = (cstring(&tmp)?, cstring(path)?);
        // SAFETY: both are NUL-terminated paths; link fails, changing nothing, if `to` exists.
        if unsafe { libc::link(from.as_ptr(), to.as_ptr()) } == 0 {
            Ok(())
        } else {
            let e = io::Error::last_os_error();
            // Another process created it first: use theirs.
            if e.kind() == io::ErrorKind::AlreadyExists {
                Ok(())
            } else {
                Err(e)
            }
        }
    });
    let _ = std::fs::remove_file(&tmp);
    linked
}

fn cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::other("a NUL in the path"))
}

/// Sleep while `word` holds `seen`, at most `timeout` (a shared, non-private futex: it works
/// across processes mapping the same file).
fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the call; the timespec outlives it. Any
    // result (woken, timed out, interrupted, value already changed) is fine: callers recheck.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        )
    };
}

/// Wake every process sleeping on `word`.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE only reads its address.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("resmem-registry-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    const UUID: [u8; 16] = [7; 16];

    #[test]
    fn files_are_refused_for_each_reason() {
        let size = FILE_BYTES as u64;
        assert_eq!(check_file(1000, 1000, 0o100600, size, true), None);
        for (args, needle) in [
            (
                (0, 1000, 0o600, size, true),
                "belongs to uid 0, not to this user (uid 1000)",
            ),
            ((1000, 1000, 0o644, size, true), "has mode 644"),
            (
                (1000, 1000, 0o600, 3, true),
                "is 3 bytes, not the 4160 of a registry",
            ),
            ((1000, 1000, 0o600, size, false), "is not a regular file"),
        ] {
            let why = check_file(args.0, args.1, args.2, args.3, args.4).unwrap();
            assert!(why.contains(needle), "{why}");
        }
    }

    #[test]
    fn a_new_registry_is_private_and_the_second_open_shares_it() {
        let dir = scratch("new");
        let a = Registry::open(&dir, &UUID).unwrap();
        let meta = std::fs::metadata(a.path()).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.len(), FILE_BYTES as u64);
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let b = Registry::open(&dir, &UUID).unwrap();
        assert_eq!(a.path(), b.path());
        let e = Registry::open(&dir, &UUID).map(drop);
        assert!(e.is_ok());
    }

    #[test]
    fn slots_are_claimed_once_and_dead_ones_reclaimed() {
        let dir = scratch("slots");
        let r = Registry::open(&dir, &UUID).unwrap();
        assert!(r.own().is_none());
        let lock = r.lock_until(Instant::now()).unwrap();
        let mine = r.mine(&lock).unwrap() as *const Slot;
        assert_eq!(r.mine(&lock).unwrap() as *const Slot, mine);
        // A slot of a process that is gone (pid 1 never has this start time).
        let dead = &r.slots()[9];
        dead.pid.store(1, Ordering::SeqCst);
        dead.start.store(u64::MAX, Ordering::SeqCst);
        dead.reusable.store(5, Ordering::SeqCst);
        assert_eq!(r.others_reusable(), 0);
        assert!(lock.others().is_empty());
        assert_eq!(dead.pid.load(Ordering::SeqCst), 0);
        // A running other process: this one under another handle.
        let other = &r.slots()[10];
        other.start.store(r.start, Ordering::SeqCst);
        other.token.store(0, Ordering::SeqCst);
        other.pid.store(r.pid, Ordering::SeqCst);
        other.reusable.store(3 << 30, Ordering::SeqCst);
        assert_eq!(lock.others().len(), 1);
        assert_eq!(r.others_reusable(), 3 << 30);
        drop(lock);
        // A second holder cannot take the lock while it is held.
        let held = r.lock_until(Instant::now()).unwrap();
        let r2 = Registry::open(&dir, &UUID).unwrap();
        assert!(r2
            .lock_until(Instant::now() + Duration::from_millis(5))
            .is_none());
        drop(held);
        assert!(r2.lock_until(Instant::now()).is_some());
    }

    #[test]
    fn a_request_is_answered_and_counted() {
        let dir = scratch("request");
        let r = Registry::open(&dir, &UUID).unwrap();
        let lock = r.lock_until(Instant::now()).unwrap();
        let slot = r.mine(&lock).unwrap();
        drop(lock);
        let seen = r.requests();
        let before = r.post(slot, 4 << 30);
        assert_eq!(r.requests(), seen.wrapping_add(1));
        assert_eq!(slot.wanted(), 4 << 30);
        slot.answered(6 << 30);
        assert_eq!(slot.wanted(), 0);
        assert_eq!(r.close(slot, before), 6 << 30);
        // Waits return at once when the counter already moved.
        r.wait_requests(seen, Duration::from_secs(5));
        r.wait_answers(r.answers().wrapping_add(1), Duration::from_secs(5));
    }

    #[test]
    fn garbage_and_another_device_are_refused() {
        let dir = scratch("garbage");
        let path = dir.join(file_name(&UUID, uid()));
        std::fs::write(&path, vec![0xA5u8; FILE_BYTES]).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let e = Registry::open(&dir, &UUID).err().unwrap();
        assert!(e.contains("does not start as a resmem registry"), "{e}");
        std::fs::remove_file(&path).unwrap();
        drop(Registry::open(&dir, &[9; 16]).unwrap());
        std::fs::rename(dir.join(file_name(&[9; 16], uid())), &path).unwrap();
        let e = Registry::open(&dir, &UUID).err().unwrap();
        assert!(e.contains("names another device"), "{e}");
    }
}
