#!/usr/bin/env bash
# The C programs of c_examples/ under valgrind memcheck, against both simulator paths: zero
# errors and zero definitely-lost bytes, or a non-zero exit. Run after `cargo test` (which
# compiles the programs into target/debug/c_examples/).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/debug/c_examples
sim_lib="$PWD/target/debug/libcuda_sim.so"
for need in "$dir/quickstart" "$dir/errors" "$dir/hostile" "$dir/fork" "$dir/loader" "$dir/exit" \
  "$dir/unload" "$dir/workload" "$dir/share" \
  "$sim_lib"; do
  [ -e "$need" ] || { echo "missing $need: run cargo test first"; exit 1; }
done
vg=(valgrind --tool=memcheck --error-exitcode=99 --leak-check=full
    --errors-for-leak-kinds=definite --show-leak-kinds=definite --track-fds=no -q)
runs=0
check() { # driver, program, args... (extra environment in $EXTRA)
  local driver=$1; shift
  local env=(env -u RESMEM_CONF -u CUDA_SIM_FAULTS -u RESMEM_TEST_PANIC CUDA_SIM_DEVICES=24GiB)
  if [ "$driver" = sim ]; then env+=(RESMEM_DRIVER=sim); else env+=(RESMEM_CUDA_LIBRARY="$sim_lib"); fi
  # shellcheck disable=SC2206
  env+=(${EXTRA:-})
  if ! "${env[@]}" "${vg[@]}" "$@" >/tmp/resmem-valgrind.out 2>&1; then
    echo "valgrind: $driver $* failed:"; cat /tmp/resmem-valgrind.out; exit 1
  fi
  runs=$((runs + 1))
  echo "ok   memcheck $driver $*"
}
for driver in sim library; do
  check "$driver" "$dir/quickstart"
  check "$driver" "$dir/errors"
  check "$driver" "$dir/loader"
  check "$driver" "$dir/fork"
  EXTRA="CUDA_SIM_DEVICES=4GiB,4GiB" check "$driver" "$dir/hostile"
  EXTRA="RESMEM_TEST_PANIC=rm_reserve" check "$driver" "$dir/hostile" panic
  # Through the loaded library the first cuMemCreate is the driver's check that it maps at
  # offsets into an allocation (src/driver/cuda.rs), before the pool's first growth.
  first=1; [ "$driver" = sim ] || first=2
  EXTRA="CUDA_SIM_FAULTS=cuMemCreate@$first=719,cuMemCreate@$((first + 1))=2,cuMemCreate@$((first + 2))=2" \
    check "$driver" "$dir/hostile" faults cuMemCreate
  EXTRA="RESMEM_CONF=vmm:false CUDA_SIM_FAULTS=cuMemAlloc_v2@1=719,cuMemAlloc_v2@2=2,cuMemAlloc_v2@3=2" \
    check "$driver" "$dir/hostile" faults
  check "$driver" "$dir/exit"
  EXTRA="RESMEM_CONF=vmm:true" check "$driver" "$dir/exit"
  check "$driver" "$dir/unload" "$PWD/target/debug/libresmem.so" 30
done
EXTRA="RESMEM_CONF=no_such_key:1" check sim "$dir/errors" bad-conf
# Recording: four threads' calls through the writer thread, flushed at exit.
trace=$(mktemp -d)/trace.jsonl
EXTRA="RESMEM_CONF=record:$trace CUDA_SIM_DEVICES=1GiB,1GiB" check sim "$dir/workload"
[ "$(wc -l <"$trace")" -eq 40013 ] || { echo "valgrind: the recorded trace has $(wc -l <"$trace") lines, not 40013"; exit 1; }
rm -r "$(dirname "$trace")"
# Sharing on: the registry, its mapping, the helper thread and a request answered by another
# process (not under valgrind) that caches 16 GiB of the shared 24 GiB device.
share_dir=$(mktemp -d)
share_env=(CUDA_SIM_DEVICES=24GiB RESMEM_DRIVER=sim RESMEM_CONF=share:true
           RESMEM_SHARE_DIR="$share_dir" CUDA_SIM_SHARED="$share_dir/capacity")
mkfifo "$share_dir/in"
env "${share_env[@]}" "$dir/share" hold 16 <"$share_dir/in" >"$share_dir/out" &
holder=$!
exec 3>"$share_dir/in"
until grep -q ready "$share_dir/out" 2>/dev/null; do sleep 0.1; done
EXTRA="${share_env[*]} RESMEM_CONF=share:true,share_wait_ms:5000" check sim "$dir/share" ask 12
grep -q '^status=0' /tmp/resmem-valgrind.out || { echo "share ask 12 did not get the memory:"; cat /tmp/resmem-valgrind.out; exit 1; }
exec 3>&-
wait "$holder"
rm -rf "$share_dir"
echo "valgrind: $runs programs, 0 errors, 0 definitely lost"
