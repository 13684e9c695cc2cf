//! One recorded call: its fixed-size binary form (five words, what a thread's ring holds) and
//! its line in `resmem replay`'s JSON-lines format (what the writer thread makes of it).

use crate::driver::{DevicePtr, StreamHandle};

/// A recorded call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
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
    /// A call that took a place in the order and then failed: no line.
    Skip,
}

/// A call and its place in the process's order of calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub seq: u64,
    pub call: Call,
}

/// An entry as five words: the place, the kind with the device, and three operands.
pub(crate) type Words = [u64; 5];

const SKIP: u64 = 0;
const ALLOC: u64 = 1;
const FREE: u64 = 2;
const RECORD_STREAM: u64 = 3;
const WARMUP: u64 = 4;
const EMPTY_CACHE_ONE: u64 = 5;
const EMPTY_CACHE_ALL: u64 = 6;
const OUT_OF_MEMORY: u64 = 7;

impl Entry {
    pub fn to_words(self) -> Words {
        let kind = |kind: u64, device: i32| kind << 32 | u64::from(device as u32);
        let (head, a, b, c) = match self.call {
            Call::Skip => (kind(SKIP, 0), 0, 0, 0),
            Call::Alloc {
                device,
                size,
                stream,
                ptr,
            } => (kind(ALLOC, device), ptr, size, stream),
            Call::Free { ptr } => (kind(FREE, 0), ptr, 0, 0),
            Call::RecordStream { ptr, stream } => (kind(RECORD_STREAM, 0), ptr, 0, stream),
            Call::Warmup { device, bytes } => (kind(WARMUP, device), 0, bytes, 0),
            Call::EmptyCache {
                device: Some(device),
            } => (kind(EMPTY_CACHE_ONE, device), 0, 0, 0),
            Call::EmptyCache { device: None } => (kind(EMPTY_CACHE_ALL, 0), 0, 0, 0),
            Call::OutOfMemory { device, size } => (kind(OUT_OF_MEMORY, device), 0, size, 0),
        };
        [self.seq, head, a, b, c]
    }

    pub fn from_words(w: Words) -> Entry {
        let [seq, head, a, b, c] = w;
        let device = head as u32 as i32;
        let call = match head >> 32 {
            ALLOC => Call::Alloc {
                device,
                size: b,
                stream: c,
                ptr: a,
            },
            FREE => Call::Free { ptr: a },
            RECORD_STREAM => Call::RecordStream { ptr: a, stream: c },
            WARMUP => Call::Warmup { device, bytes: b },
            EMPTY_CACHE_ONE => Call::EmptyCache {
                device: Some(device),
            },
            EMPTY_CACHE_ALL => Call::EmptyCache { device: None },
            OUT_OF_MEMORY => Call::OutOfMemory { device, size: b },
            _ => Call::Skip,
        };
        Entry { seq, call }
    }
}

/// `call` as one line of the replay format (nothing for [`Call::Skip`]).
pub(crate) fn format_line(b: &mut Vec<u8>, call: &Call) {
    match *call {
        Call::Skip => return,
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

/// `value` in decimal, four digits per division (two short chains of pairs), without `fmt`.
pub(crate) fn push_u64(b: &mut Vec<u8>, mut value: u64) {
    let pair = |n: u64| {
        let at = n as usize * 2;
        [PAIRS[at], PAIRS[at + 1]]
    };
    if value < 10 {
        b.push(b'0' + value as u8);
        return;
    }
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    while value >= 10_000 {
        let four = value % 10_000;
        value /= 10_000;
        i -= 4;
        digits[i..i + 2].copy_from_slice(&pair(four / 100));
        digits[i + 2..i + 4].copy_from_slice(&pair(four % 100));
    }
    if value >= 100 {
        i -= 2;
        digits[i..i + 2].copy_from_slice(&pair(value % 100));
        value /= 100;
    }
    if value >= 10 {
        i -= 2;
        digits[i..i + 2].copy_from_slice(&pair(value));
    } else {
        i -= 1;
        digits[i] = b'0' + value as u8;
    }
    b.extend_from_slice(&digits[i..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_call_survives_its_five_words() {
        let calls = [
            Call::Alloc {
                device: 3,
                size: 1 << 40,
                stream: 0x55,
                ptr: 0x7000_0000_0200,
            },
            Call::Free { ptr: u64::MAX },
            Call::RecordStream {
                ptr: 512,
                stream: 7,
            },
            Call::Warmup {
                device: -1,
                bytes: 8 << 20,
            },
            Call::EmptyCache { device: Some(0) },
            Call::EmptyCache { device: None },
            Call::OutOfMemory {
                device: i32::MAX,
                size: 1 << 50,
            },
            Call::Skip,
        ];
        for (seq, call) in calls.into_iter().enumerate() {
            let entry = Entry {
                seq: seq as u64 + (1 << 60),
                call,
            };
            assert_eq!(Entry::from_words(entry.to_words()), entry);
        }
    }

    #[test]
    fn a_skipped_call_has_no_line() {
        let mut b = b"x".to_vec();
        format_line(&mut b, &Call::Skip);
        assert_eq!(b, b"x");
    }

    #[test]
    fn numbers_are_written_in_decimal() {
        let mut b = Vec::new();
        for v in [
            0,
            7,
            10,
            99,
            100,
            512,
            1000,
            9999,
            10_000,
            10_001,
            100_000,
            1_000_000,
            123_145_302_310_912,
            u64::MAX,
        ] {
            push_u64(&mut b, v);
            b.push(b' ');
        }
        push_i64(&mut b, -1);
        assert_eq!(
            String::from_utf8(b).unwrap(),
            "0 7 10 99 100 512 1000 9999 10000 10001 100000 1000000 123145302310912 \
             18446744073709551615 -1"
        );
    }
}
