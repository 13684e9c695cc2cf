#!/usr/bin/env bash
# The pool's and the simulator's unit tests (plain Rust, no FFI) under Miri, which checks for
# undefined behaviour: out-of-bounds or misaligned accesses, use after free, invalid values,
# data races between the threads of the threaded tests. Not part of CI: it needs a nightly
# toolchain with the miri component, and takes minutes.
#
#   scripts/miri.sh            # the selection below
#   scripts/miri.sh FILTER     # only tests whose name contains FILTER
#
# Skipped: the exhaustive, large-count and threaded tests (every bin boundary, 100,000 cached
# blocks, the 100 KB hostile strings, threads sharing a pool: each over 10 minutes when every
# access is checked; tests/stress.rs covers the threads natively), and the tests that load
# libraries with dlopen or read the environment, and those of processes sharing a device
# (files, flock, mmap, futexes), which Miri cannot run.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo +nightly miri --version >/dev/null 2>&1; then
  echo "Miri needs a nightly toolchain: rustup toolchain install nightly --component miri"
  exit 2
fi
skip=(--skip every_found_block_fits --skip bins_are_monotonic --skip a_hundred_thousand
      --skip messages_quote_at_most --skip driver::cuda --skip runtime:: --skip global_instance
      --skip malformed_configuration --skip threads_share
      --skip share:: --skip shared:: --skip uuids_are_shared)
# The pool tests leak one simulator each on purpose (Box::leak: the driver needs a 'static one),
# so Miri's end-of-run leak report is turned off; valgrind checks leaks on the C side.
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-strict-provenance -Zmiri-ignore-leaks}"
cargo +nightly miri test -p resmem --lib -- "${skip[@]}" "$@"
cargo +nightly miri test -p cuda-sim --lib -- "${skip[@]}" "$@"
