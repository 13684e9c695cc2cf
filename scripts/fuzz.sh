#!/usr/bin/env bash
# Fuzz RESMEM_CONF parsing, operation sequences and the snapshot reader with libFuzzer
# (libfuzzer-sys) on the stable toolchain, for a bounded time per target. Not part of CI.
#
#   scripts/fuzz.sh [SECONDS per target, default 300] [TARGET...: conf ops snapshot]
#
# The targets are built the way cargo-fuzz builds them, with SanitizerCoverage instrumentation
# (-C passes=sancov-module and LLVM options, all stable) and debug assertions; no sanitizer, so no
# nightly toolchain is needed. Corpora are kept in fuzz/corpus/<target>, crashes in
# fuzz/artifacts/<target>.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-300}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(conf ops snapshot)
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
# An explicit --target keeps the instrumentation out of build scripts, as cargo-fuzz does.
host=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --bins --target "$host"
for target in "${targets[@]}"; do
  mkdir -p "corpus/$target" "artifacts/$target"
  # The snapshot reader starts from a real pickle's shape.
  [ "$target" != snapshot ] || cp -n ../traces/fixtures/snapshot_small.pickle corpus/snapshot/
  echo "== fuzzing $target for ${seconds}s"
  ./target/"$host"/release/"$target" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="artifacts/$target/" "corpus/$target" 2>&1 | tee "artifacts/$target.log" | grep -E "^(#[0-9]+.*DONE|stat::|==|INFO: (Running|Loaded))|panicked|ERROR" || true
  if ls "artifacts/$target"/crash-* >/dev/null 2>&1; then
    echo "$target: crashes found in fuzz/artifacts/$target"
    exit 1
  fi
done
