//! Capacity shared across processes (`CUDA_SIM_SHARED=name`): several processes, each with its
//! own simulator, see one device memory, as processes sharing a GPU do.
//!
//! A small file (`/dev/shm/cuda-sim-<name>`, or the path itself when the name holds a `/`)
//! holds one slot per process: its pid, its start time (so that a reused pid is not mistaken
//! for the process), and its pages in use per device. Every change and every check runs under
//! an exclusive `flock` of the file, which the kernel drops when its holder exits or is killed,
//! so a dead process never blocks the others. A slot whose process is gone is reclaimed by the
//! next caller: a killed process's memory is free again, as on the driver.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;

/// The file's first bytes.
const MAGIC: &[u8; 8] = b"CUDASIM1";
/// Processes the file has room for.
const SLOTS: usize = 64;
/// Devices counted per process (a shared simulator has at most this many).
pub(crate) const DEVICES: usize = 8;
/// A slot: pid, start time, instance, then pages in use per device (u64 each).
const SLOT_BYTES: usize = 24 + 8 * DEVICES;
const HEADER_BYTES: usize = 16;
const FILE_BYTES: usize = HEADER_BYTES + SLOTS * SLOT_BYTES;

/// One process's row.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
struct Slot {
    pid: u64,
    start: u64,
    /// Which simulator of the process (a process may hold several).
    instance: u64,
    pages: [u64; DEVICES],
}

impl Slot {
    fn decode(bytes: &[u8]) -> Slot {
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
        let mut pages = [0; DEVICES];
        for (d, p) in pages.iter_mut().enumerate() {
            *p = word(3 + d);
        }
        Slot {
            pid: word(0),
            start: word(1),
            instance: word(2),
            pages,
        }
    }

    fn encode(&self) -> [u8; SLOT_BYTES] {
        let mut out = [0u8; SLOT_BYTES];
        let words = [self.pid, self.start, self.instance]
            .into_iter()
            .chain(self.pages);
        for (i, w) in words.enumerate() {
            out[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        out
    }
}

/// The start time of process `pid` (clock ticks after boot, `/proc/<pid>/stat` field 22);
/// `None` when there is no such process, or it has exited and only waits to be reaped (a
/// zombie holds no memory any more).
pub(crate) fn start_time(pid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    if matches!(fields.next()?, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Whether the row belongs to a process that is still running.
fn alive(slot: &Slot) -> bool {
    slot.pid != 0 && start_time(slot.pid) == Some(slot.start)
}

/// This process's handle on the shared file.
#[derive(Debug)]
pub(crate) struct Shared {
    file: File,
    pid: u64,
    start: u64,
    instance: u64,
    path: PathBuf,
}

/// The file a shared name stands for.
pub(crate) fn path_of(name: &str) -> PathBuf {
    if name.contains('/') {
        PathBuf::from(name)
    } else {
        PathBuf::from(format!("/dev/shm/cuda-sim-{name}"))
    }
}

/// Holds the file's lock until dropped.
struct Locked<'a>(&'a Shared);

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // SAFETY: flock on a descriptor this value owns; unlocking cannot fail in a way that
        // matters (the lock also goes with the descriptor).
        unsafe { libc::flock(self.0.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Shared {
    /// Open (creating if needed, mode 0600) the file of `name`, for simulator `instance` of
    /// this process.
    pub(crate) fn open(name: &str, instance: u64) -> Result<Shared, String> {
        if name.is_empty() {
            return Err("the name is empty".into());
        }
        let path = path_of(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let pid = u64::from(std::process::id());
        let start = start_time(pid).ok_or("cannot read this process's start time")?;
        let shared = Shared {
            file,
            pid,
            start,
            instance,
            path,
        };
        {
            let _lock = shared.lock().map_err(|e| format!("cannot lock: {e}"))?;
            let len = shared.file.metadata().map_err(|e| e.to_string())?.len();
            if len == 0 {
                let mut init = vec![0u8; FILE_BYTES];
                init[..8].copy_from_slice(MAGIC);
                shared
                    .file
                    .write_all_at(&init, 0)
                    .map_err(|e| format!("cannot write {}: {e}", shared.path.display()))?;
            } else {
                let mut magic = [0u8; 8];
                let read = shared.file.read_exact_at(&mut magic, 0);
                if len != FILE_BYTES as u64 || read.is_err() || &magic != MAGIC {
                    return Err(format!(
                        "{} is not a cuda-sim shared-capacity file ({len} bytes); remove it",
                        shared.path.display()
                    ));
                }
            }
        }
        Ok(shared)
    }

    fn lock(&self) -> io::Result<Locked<'_>> {
        loop {
            // SAFETY: flock on a descriptor this value owns.
            if unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Locked(self));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    fn read_slots(&self) -> io::Result<Vec<Slot>> {
        let mut bytes = vec![0u8; SLOTS * SLOT_BYTES];
        self.file.read_exact_at(&mut bytes, HEADER_BYTES as u64)?;
        Ok(bytes.chunks(SLOT_BYTES).map(Slot::decode).collect())
    }

    fn write_slot(&self, index: usize, slot: &Slot) -> io::Result<()> {
        let at = HEADER_BYTES + index * SLOT_BYTES;
        self.file.write_all_at(&slot.encode(), at as u64)
    }

    /// Under the lock: the slots, with rows of dead processes cleared, and this process's
    /// index (claimed if it had none).
    fn rows(&self) -> io::Result<(Vec<Slot>, usize)> {
        let mut slots = self.read_slots()?;
        let mut mine = None;
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.pid == self.pid && slot.start == self.start && slot.instance == self.instance {
                mine = mine.or(Some(i));
            } else if slot.pid != 0 && !alive(slot) {
                *slot = Slot::default();
                self.write_slot(i, slot)?;
            }
        }
        let mine = match mine.or_else(|| slots.iter().position(|s| s.pid == 0)) {
            Some(i) => i,
            None => return Err(io::Error::other("all 64 process slots are taken")),
        };
        if slots[mine].pid == 0 {
            slots[mine] = Slot {
                pid: self.pid,
                start: self.start,
                instance: self.instance,
                pages: [0; DEVICES],
            };
        }
        Ok((slots, mine))
    }

    /// Pages of `dev` in use by the other running processes.
    pub(crate) fn others(&self, dev: usize) -> io::Result<u64> {
        let _lock = self.lock()?;
        let (slots, mine) = self.rows()?;
        Ok(others(&slots, mine, dev))
    }

    /// Set this process's pages in use on `dev` to `pages` if, with the other processes'
    /// pages, they fit in `capacity` pages (always when they do not grow). Whether they did.
    pub(crate) fn set_used(&self, dev: usize, pages: u64, capacity: u64) -> io::Result<bool> {
        let _lock = self.lock()?;
        let (mut slots, mine) = self.rows()?;
        if pages > slots[mine].pages[dev] && others(&slots, mine, dev) + pages > capacity {
            return Ok(false);
        }
        slots[mine].pages[dev] = pages;
        self.write_slot(mine, &slots[mine])?;
        Ok(true)
    }
}

fn others(slots: &[Slot], mine: usize, dev: usize) -> u64 {
    slots
        .iter()
        .enumerate()
        .filter(|&(i, s)| i != mine && s.pid != 0)
        .map(|(_, s)| s.pages[dev])
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> String {
        let dir = std::env::temp_dir().join(format!("cuda-sim-shared-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        path.to_string_lossy().into_owned()
    }

    #[test]
    fn slots_round_trip() {
        let slot = Slot {
            pid: 7,
            start: 99,
            instance: 3,
            pages: [1, 2, 3, 4, 5, 6, 7, 8],
        };
        assert_eq!(Slot::decode(&slot.encode()), slot);
    }

    #[test]
    fn this_process_has_a_start_time_and_pid_zero_none() {
        assert!(start_time(u64::from(std::process::id())).is_some());
        assert_eq!(start_time(0), None);
    }

    #[test]
    fn growth_is_refused_past_capacity_counting_other_processes() {
        let path = scratch("grow");
        let a = Shared::open(&path, 0).unwrap();
        assert!(a.set_used(0, 10, 12).unwrap());
        // A row of a dead process (pid 1 never has this start time) is cleared on sight.
        let dead = Slot {
            pid: 1,
            start: u64::MAX,
            instance: 0,
            pages: [5; DEVICES],
        };
        a.write_slot(5, &dead).unwrap();
        assert_eq!(a.others(0).unwrap(), 0);
        assert_eq!(a.read_slots().unwrap()[5], Slot::default());
        // Another simulator of this (running) process.
        let b = Shared::open(&path, 1).unwrap();
        assert!(b.set_used(0, 2, 12).unwrap());
        assert_eq!(a.others(0).unwrap(), 2);
        assert_eq!(b.others(0).unwrap(), 10);
        assert!(!b.set_used(0, 3, 12).unwrap());
        // Without a cap (u64::MAX) growth always fits; shrinking needs no room, even when the
        // pages counted (a's 10, b's 4) exceed the capacity.
        assert!(b.set_used(0, 4, u64::MAX).unwrap());
        assert!(a.set_used(0, 7, 12).unwrap());
        assert!(!a.set_used(0, 9, 12).unwrap());
        assert!(a.set_used(0, 8, 12).unwrap());
        // Shrinking always succeeds.
        assert!(a.set_used(0, 1, 2).unwrap());
    }

    #[test]
    fn a_file_of_the_wrong_size_or_magic_is_refused() {
        let path = scratch("bad");
        std::fs::write(&path, b"garbage").unwrap();
        let e = Shared::open(&path, 0).unwrap_err();
        assert!(
            e.contains("is not a cuda-sim shared-capacity file (7 bytes)"),
            "{e}"
        );
        std::fs::write(&path, vec![1u8; FILE_BYTES]).unwrap();
        let e = Shared::open(&path, 0).unwrap_err();
        assert!(e.contains("not a cuda-sim shared-capacity file"), "{e}");
        assert_eq!(Shared::open("", 0).unwrap_err(), "the name is empty");
    }
}
