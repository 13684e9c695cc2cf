#!/usr/bin/env bash
# The waits behind rm_free_reusable (benches/c/pairs.c `pauses`: 100k 2 MiB blocks released,
# a segment each with classic segments, a few large ones with the default's headroom; and
# `lent`, the default with 100k idle segments of two lent runs each; `classic-busy` and
# `default-busy`, 1000 blocks with driver calls that take a real driver's time, BUSY in the
# CUDA_SIM_DELAYS syntax; `classic-growth` and `default-growth`, the waits behind a thread whose
# 200 reserves of 256 MiB make the pool grow, with creations of 1 ms, GROW in the same syntax;
# `stitch-32` and `stitch-64`, behind a thread whose reserves are made of 32 and 64 cached pieces,
# a cuMemMap of 19 us each; `stitch-busy` and `stitch-return`, the same with a wait of 2 ms for
# the device first),
# the same waits behind a plain pthread mutex held 20 us
# at a time (`handoff`: the machine's share), and pairs of 128 MiB blocks, which the front cache
# passes to the pool, from one thread and from two threads on two devices (`devices`), through
# the shipped libresmem.so. With BASELINE_LIB=path/to/another/libresmem.so, every run does the
# same with that library too, alternating, for a comparison in the same session. The lock holds
# themselves are timed by a copy of the library built with the `hold-probe` feature
# (src/pool/probe.rs: each hold of the device's lock by rm_free_reusable, wall-clock and thread
# CPU time, and glibc's fastbin chunks before and after it); BASELINE_PROBE_LIB names another
# such copy to compare. Prints a Markdown section.
#
#   scripts/bench-pauses.sh
#   RUNS=5 BASELINE_LIB=/tmp/old/libresmem.so scripts/bench-pauses.sh
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
# The `-busy` cases: the driver's calls take this long (a device busy for 2 ms, a cuMemFree of
# 50 us, virtual-memory calls of 19 us as measured on an H200), over this many segments.
busy=${BUSY:-cuCtxSynchronize=2ms,cuMemFree_v2=50us,cuMemUnmap=19us,cuMemRelease=19us,cuMemAddressFree=19us}
busy_segments=${BUSY_SEGMENTS:-1000}
# The `-growth` cases: creating memory takes 1 ms (an assumption for a large allocation), the
# virtual-memory calls that map it 19 us (the H200's).
grow=${GROW:-cuMemAlloc_v2=1ms,cuMemCreate=1ms,cuMemMap=19us,cuMemSetAccess=19us,cuMemAddressReserve=19us}
cargo build --release -q -p resmem -p libcuda-sim
cargo build --release -q -p resmem --features hold-probe --target-dir target/hold-probe
out=target/bench-pauses
libs=("this:$PWD/target/release/libresmem.so")
if [ -n "${BASELINE_LIB:-}" ]; then
  libs=("baseline:$BASELINE_LIB" "${libs[@]}")
fi
probes=("probe-this:$PWD/target/hold-probe/release/libresmem.so")
if [ -n "${BASELINE_PROBE_LIB:-}" ]; then
  probes=("probe-baseline:$BASELINE_PROBE_LIB" "${probes[@]}")
fi
for entry in "${libs[@]}" "${probes[@]}"; do
  name=${entry%%:*}
  mkdir -p "$out/$name"
  cp "${entry#*:}" "$out/$name/libresmem.so.0"
  gcc -O2 -std=c11 -Wall -Wextra -Iinclude benches/c/pairs.c -o "$out/$name/pairs" \
    -L"$PWD/$out/$name" -l:libresmem.so.0 -Wl,-rpath,"$PWD/$out/$name" -lpthread -ldl
done
export RESMEM_DRIVER=cuda RESMEM_CUDA_LIBRARY="$PWD/target/release/libcuda_sim.so"
# Only this run's files are read back (no holds of an earlier run's libraries).
rm -f "$out"/holds-* "$out"/work-*
: > "$out/results"
for i in $(seq 1 "$runs"); do
  for entry in "${libs[@]}"; do
    name=${entry%%:*}
    echo "$name $i default $(CUDA_SIM_DEVICES=240GiB "$out/$name/pairs" pauses)" >> "$out/results"
    echo "$name $i lent $(CUDA_SIM_DEVICES=960GiB "$out/$name/pairs" pauses 100000 lent)" \
      >> "$out/results"
    echo "$name $i classic $(CUDA_SIM_DEVICES=240GiB RESMEM_CONF=vmm:false "$out/$name/pairs" pauses)" \
      >> "$out/results"
    # A driver that takes a real one's time (CUDA_SIM_DELAYS): a busy device to wait for.
    echo "$name $i classic-busy $(CUDA_SIM_DEVICES=240GiB CUDA_SIM_DELAYS="$busy" \
      RESMEM_CONF=vmm:false "$out/$name/pairs" pauses "$busy_segments")" >> "$out/results"
    echo "$name $i default-busy $(CUDA_SIM_DEVICES=240GiB CUDA_SIM_DELAYS="$busy" \
      "$out/$name/pairs" pauses "$busy_segments")" >> "$out/results"
    # Another thread's reserves make the pool grow, each creation taking a real driver's time.
    echo "$name $i classic-growth $(CUDA_SIM_DEVICES=240GiB CUDA_SIM_DELAYS="$grow" \
      RESMEM_CONF=vmm:false "$out/$name/pairs" growth)" >> "$out/results"
    echo "$name $i default-growth $(CUDA_SIM_DEVICES=240GiB CUDA_SIM_DELAYS="$grow" \
      "$out/$name/pairs" growth)" >> "$out/results"
    # Another thread's reserves are made of cached pages alone: 32 pieces, then 64.
    echo "$name $i stitch-32 $(CUDA_SIM_DEVICES=80GiB CUDA_SIM_DELAYS="$grow" \
      "$out/$name/pairs" stitch 100 $((128 << 20)))" >> "$out/results"
    echo "$name $i stitch-64 $(CUDA_SIM_DEVICES=80GiB CUDA_SIM_DELAYS="$grow" \
      "$out/$name/pairs" stitch 100 $((256 << 20)))" >> "$out/results"
    # The same from 32 blocks of 66 MiB, one released afresh before each range: a wait for a
    # busy device (2 ms) before the range may be used.
    echo "$name $i stitch-busy $(CUDA_SIM_DEVICES=80GiB CUDA_SIM_DELAYS="cuCtxSynchronize=2ms,$grow" \
      "$out/$name/pairs" stitch 30 $((32 * 66 << 20)) $((66 << 20)) touch)" >> "$out/results"
    # The same with no rm_free_reusable: each range, 2 MiB larger than the last, takes the last
    # one apart first, after a wait for the device.
    echo "$name $i stitch-return $(CUDA_SIM_DEVICES=80GiB CUDA_SIM_DELAYS="cuCtxSynchronize=2ms,cuMemUnmap=19us,$grow" \
      "$out/$name/pairs" stitch 30 $((32 * 66 << 20)) $((66 << 20)) return)" >> "$out/results"
    CUDA_SIM_DEVICES=80GiB,80GiB "$out/$name/pairs" devices | sed "s/^/$name $i /" >> "$out/results"
    CUDA_SIM_DEVICES=80GiB "$out/$name/pairs" streams | sed "s/^/$name $i /" >> "$out/results"
  done
  echo "reference $i mutex $("$out/this/pairs" handoff)" >> "$out/results"
  "$out/this/pairs" work 12000 > "$out/work-$i"
  for entry in "${probes[@]}"; do
    name=${entry%%:*}
    CUDA_SIM_DEVICES=240GiB "$out/$name/pairs" pauses > /dev/null 2> "$out/holds-${name#probe-}-$i-default"
    CUDA_SIM_DEVICES=960GiB "$out/$name/pairs" pauses 100000 lent > /dev/null \
      2> "$out/holds-${name#probe-}-$i-lent"
    CUDA_SIM_DEVICES=240GiB RESMEM_CONF=vmm:false "$out/$name/pairs" pauses > /dev/null \
      2> "$out/holds-${name#probe-}-$i-classic"
  done
done
python3 - "$out/results" "$runs" "$out" <<'PY'
import sys, platform, subprocess, datetime, glob, os
path, runs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cpu = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
print(f"`scripts/bench-pauses.sh`, {runs} runs; date {datetime.date.today()}; {platform.machine()}, "
      f"{cpu} CPUs (`nproc`), Linux {platform.release()}; simulated devices through "
      "`libcuda_sim.so`. Waits in µs of `rm_mem_get_info` calls in a loop on another thread "
      "(they take the device's lock), with nothing else running (alone) and during "
      "`rm_free_reusable`: `default`, 100k 2 MiB blocks reserved and released (240 GiB device; "
      "the default's growth headroom packs them into a few large segments); `lent`, the default "
      "with 100k idle segments made of two lent 2 MiB pages each (`pairs pauses 100000 lent`, "
      "960 GiB device); `classic`, classic segments, the 100k blocks a segment each; "
      f"`classic-busy` and `default-busy`, {os.environ.get('BUSY_SEGMENTS', '1000')} blocks with "
      "driver calls that take a real driver's time (`CUDA_SIM_DELAYS="
      f"{os.environ.get('BUSY', 'cuCtxSynchronize=2ms,cuMemFree_v2=50us,cuMemUnmap=19us,cuMemRelease=19us,cuMemAddressFree=19us')}`: "
      "a device busy for 2 ms at each wait for it); `classic-growth` and `default-growth`, "
      "while another thread reserves 200 blocks of 256 MiB, each kept, so that the pool grows, "
      "creating memory as a real driver would (`CUDA_SIM_DELAYS="
      f"{os.environ.get('GROW', 'cuMemAlloc_v2=1ms,cuMemCreate=1ms,cuMemMap=19us,cuMemSetAccess=19us,cuMemAddressReserve=19us')}`; "
      "the time column is then the 200 reserves'); `stitch-32` and `stitch-64`, the default "
      "while another thread makes 100 reserves of 128 and 256 MiB from 32 and 64 free 4 MiB "
      "blocks between live ones (a `cuMemMap` each, with the same delays), each released and "
      "taken apart by `rm_free_reusable` before the next (`pairs stitch 100 SIZE`; the time "
      "column is the 100 rounds'); `stitch-busy`, the same 30 times from 32 free 66 MiB blocks, "
      "one of them reserved and released afresh before each range, on a device busy for 2 ms at "
      "each wait for it (`pairs stitch 30 2112MiB 66MiB touch`); `stitch-return`, the same "
      "with no `rm_free_reusable`, each range 2 MiB larger than the last, which the reserve takes "
      "apart first (`pairs stitch 30 2112MiB 66MiB return`); `mutex` is the same "
      "probe behind a pthread mutex held 20 µs at a time, 320 times, with the pool's hand-over "
      "between holds (the machine's share).\n")
print("| library | run | policy | timed call (ms) | phase | calls | median | 99.9th pct | max | calls over 100 µs |")
print("| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
pairs = []
for line in open(path):
    f = line.split()
    if f[2] in ("device_pair", "stream_pair"):
        pairs.append((f[0], f[1], f[2][0] + f[3], f"{f[4]} / {f[5]}"))
        continue
    lib, run, policy, rest = f[0], f[1], f[2], f[4:]
    if policy == "mutex":
        total, nums = "-", rest[2:]
    else:
        total, nums = rest[1], rest[3:]
    for phase, p in (("alone", nums[0:5]), ("during", nums[5:10])):
        print(f"| {lib} | {run} | {policy} | {total} | {phase} | {int(p[0]):,} | {p[1]} | {p[2]} | "
              f"{float(p[3]):.0f} | {p[4]} |")
print()
print("Pairs of 128 MiB blocks (reserve + release through the pool, the front cache passing them "
      "on), ns per pair per thread, wall / the thread's own CPU time (which leaves out waiting for "
      "a CPU), one thread on device 0, then two threads on devices 0 and 1 (`pairs devices`), "
      "then two threads on device 0, each on its own stream (`pairs streams`: every call takes "
      "the one device's lock):\n")
print("| library | run | 1 thread, wall / CPU | 2 threads, 2 devices, wall / CPU | "
      "2 threads, 1 device, wall / CPU |")
print("| --- | ---: | ---: | ---: | ---: |")
rows = {}
for lib, run, threads, ns in pairs:
    rows.setdefault((lib, run), {})[threads] = ns
for (lib, run), v in rows.items():
    print(f"| {lib} | {run} | {v.get('d1', '-')} | {v.get('d2', '-')} | {v.get('s2', '-')} |")
print()
print("The holds of the device's lock by `rm_free_reusable` (as above: `default`, 100k 2 MiB "
      "blocks released; `lent`, 100k idle segments of lent pages; `classic`, 100k segments), timed "
      "inside the library (a copy built with the `hold-probe` feature), in µs: wall-clock, and "
      "the sweeping thread's own CPU time. For the longest hold (wall): its sweep step; glibc's "
      "count of free chunks in its fastbins before and after it (`mallinfo2`, read outside the "
      "timed span: a fall means glibc merged them all, `malloc_consolidate`, inside the hold); "
      "and the thread's involuntary context switches in it (`getrusage`: a preemption). The last "
      "column counts the holds in which more than 100 fastbin chunks were merged, and gives the "
      "longest of them in CPU time. "
      "`fixed work` is the machine's own share, with no pool and no lock: 12,000 spans (about "
      "as many as the `lent` sweep's holds) of a fixed number of steps of a random walk through 64 MiB, as many as take 25 µs at the median "
      "(`pairs work`), timed the same way in the same run.\n")
print("| library | run | policy | holds | median | 99th pct | max wall | max CPU | holds over 100 µs, wall / CPU | longest: step, fastbin, switches | holds merging over 100 fastbin chunks: count, longest CPU |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
def holds(name):
    return [l.split()[1:] for l in open(name) if l.startswith("hold ")]
for run in range(1, runs + 1):
    for lib in ("baseline", "this"):
        for policy in ("default", "lent", "classic"):
            name = os.path.join(out, f"holds-{lib}-{run}-{policy}")
            if not os.path.exists(name):
                continue
            h = holds(name)
            wall = sorted(int(x[1]) for x in h)
            cpu = sorted(int(x[2]) for x in h)
            n = len(wall)
            longest = max(h, key=lambda x: int(x[1]))
            merging = [int(x[2]) for x in h if int(x[3]) - int(x[4]) > 100]
            over_w = sum(1 for x in wall if x > 100_000)
            over_c = sum(1 for x in cpu if x > 100_000)
            print(f"| {lib} | {run} | {policy} | {n} | {wall[n // 2] / 1e3:.1f} | "
                  f"{wall[min(n - 1, n * 99 // 100)] / 1e3:.1f} | {wall[-1] / 1e3:.1f} | "
                  f"{cpu[-1] / 1e3:.1f} | {over_w} / {over_c} | {longest[0]}, "
                  f"{int(longest[3]):,} → {int(longest[4]):,}, {longest[6]} | {len(merging)}"
                  f"{', ' + format(max(merging) / 1e3, '.1f') if merging else ''} |")
    w = open(os.path.join(out, f"work-{run}")).read().split()
    print(f"| reference | {run} | fixed work | {w[1]} | {w[2]} | {w[3]} | {w[4]} | {w[5]} | "
          f"{w[6]} / {w[7]} | - | - |")
PY
