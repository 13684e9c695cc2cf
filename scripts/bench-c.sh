#!/usr/bin/env bash
# The C benchmark (benches/c/pairs.c) through the shipped libresmem.so, with glibc's malloc +
# free measured in the same run: cache-hit pairs from 1, 2, 4 and 8 threads (each on its own
# simulated stream) at 512 B, 64 KiB, 4 MiB and 64 MiB with 0, 1k and 100k other blocks cached;
# rm_get_stats with those caches; the pairs from 1 and 2 threads again, timed in alternation
# (`pairs scaling`: ROUNDS rounds per run), for the scaling from one thread to two, which one
# pass over the cases leaves to the machine's noise; and the instructions of one pair under
# callgrind. (The waits behind rm_free_reusable are scripts/bench-pauses.sh's.) Runs everything
# RUNS times (default 3) and prints a Markdown section with the minimum and the median of the runs. Then the one-thread
# pair under a sweep of the worker's stack shifts (`pairs sweep`, 0 to 4032 bytes in steps of 64,
# with 0 and 100k blocks cached): where a block's record sits relative to the stack the calls
# write to must not decide its time, so each case is given as the minimum, median and maximum over
# the shifts (each shift's figure the minimum over its timings: 4 passes in each run).
#
#   scripts/bench-c.sh            # build (release), run, print the section
#   RUNS=1 scripts/bench-c.sh     # one run
#   REPORT_ONLY=1 scripts/bench-c.sh   # print the section from the last runs' files
#   SWEEP_ONLY=1 scripts/bench-c.sh    # only the stack-shift sweep (and its table)
#   ROUNDS=N scripts/bench-c.sh   # N alternating rounds of 1 and 2 threads per run (5)
#   BEFORE_LIB=DIR scripts/bench-c.sh  # also the sweep with DIR/libresmem.so.0 (another build,
#                                      # e.g. of an earlier commit) in each run, for its table
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
rounds=${ROUNDS:-5}
out=target/bench-c
. scripts/c-bench.sh
c_bench_build pairs "$out"
if [ -z "${REPORT_ONLY:-}" ]; then
  rm -f "$out"/sweep-before.*
  for i in $(seq 1 "$runs"); do
    if [ -z "${SWEEP_ONLY:-}" ]; then
      CUDA_SIM_DEVICES=80GiB "$out/pairs" > "$out/pairs.$i"
      CUDA_SIM_DEVICES=80GiB "$out/pairs" scaling "$rounds" > "$out/scaling.$i"
    fi
    for cached in 0 100000; do
      if [ -n "${BEFORE_LIB:-}" ]; then
        LD_LIBRARY_PATH="$BEFORE_LIB" CUDA_SIM_DEVICES=80GiB "$out/pairs" sweep "$cached" \
          > "$out/sweep-before.$cached.$i"
      fi
      CUDA_SIM_DEVICES=80GiB "$out/pairs" sweep "$cached" > "$out/sweep.$cached.$i"
    done
  done
fi
if [ -z "${REPORT_ONLY:-}" ] && [ -z "${SWEEP_ONLY:-}" ]; then
  # Instructions of one cache-hit pair (callgrind: 120k pairs less 20k pairs, over 100k).
  : > "$out/instructions"
  if command -v valgrind >/dev/null; then
    for size in 512 65536 4194304 67108864; do
      count() {
        CUDA_SIM_DEVICES=80GiB valgrind --tool=callgrind --callgrind-out-file=/dev/null \
          "$out/pairs" count "$1" "$size" 2>&1 | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
      }
      a=$(count 20000)
      b=$(count 120000)
      echo "$size $(( (b - a) / 100000 ))" >> "$out/instructions"
    done
  fi
fi
python3 - "$out" "$runs" "${SWEEP_ONLY:-}" <<'PY'
import statistics, sys, platform, subprocess, datetime, os
out, runs, sweep_only = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def human(n):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"
def sweep_table(name="sweep", title="The one-thread pair under a sweep of stack shifts"):
    # (impl, size, cached) -> shift -> CPU ns of each run
    shifts = {}
    for cached in (0, 100000):
        for i in range(1, runs + 1):
            for line in open(f"{out}/{name}.{cached}.{i}"):
                f = line.split()
                if f[0] == "shift":
                    key = (f[1], int(f[2]), int(f[3]))
                    shifts.setdefault(key, {}).setdefault(int(f[4]), []).append(float(f[6]))
    def over_shifts(key):
        # The minimum over the runs at each shift, in shift order.
        return [min(v) for _, v in sorted(shifts[key].items())]
    print(f"### {title}\n")
    n = len(shifts[next(iter(shifts))])
    timings = len(next(iter(shifts[next(iter(shifts))].values())))
    print(f"`scripts/bench-c.sh` (`pairs sweep 0` and `pairs sweep 100000`), {runs} runs; date "
          f"{datetime.date.today()}. One thread repeats `rm_reserve` + `rm_release` (glibc: `malloc` + "
          f"`free`) for 20 ms (after 5 ms to start) with its stack shifted by each of {n} shifts (0 to "
          f"{64 * (n - 1)} bytes, steps of 64), so that the stack the calls write to sits at every "
          "offset within a page relative to the block's record and the rest of what the hit path "
          "reads; every run times each shift in 4 passes over them all, each thread on the same "
          "stream (so the same bin). CPU time per pair; each shift's figure is its minimum over its "
          f"{timings} timings (the passes of all runs: the machine's other work only adds); then the "
          "minimum, median and maximum over the shifts. Worst / glibc is the maximum over the shifts "
          "over glibc's median; flatness is the maximum over the shifts with 100k cached over the "
          "median with 0 cached.\n")
    print("| size | cached | resmem min / median / max (ns) | shifts over 20 ns | glibc min / median / max (ns) | worst / glibc | flatness (worst) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in sorted({k[1] for k in shifts}):
        base = statistics.median(over_shifts(("resmem", size, 0)))
        for cached in (0, 100000):
            r, g = over_shifts(("resmem", size, cached)), over_shifts(("glibc", size, cached))
            gm = statistics.median(g)
            flat = f"{max(r) / base:.2f}" if cached else ""
            print(f"| {human(size)} | {cached:,} | {min(r):.1f} / {statistics.median(r):.1f} / {max(r):.1f} | "
                  f"{sum(x > 20 for x in r)} of {len(r)} | {min(g):.1f} / {gm:.1f} / {max(g):.1f} | "
                  f"{max(r) / gm:.2f} | {flat} |")
    print()
def sweep_tables():
    sweep_table()
    if os.path.exists(f"{out}/sweep-before.0.1"):
        sweep_table("sweep-before", "The same sweep with the library of `BEFORE_LIB`, in the same runs")
if sweep_only:
    sweep_tables()
    sys.exit(0)
pairs, stats = {}, {}
for i in range(1, runs + 1):
    for line in open(f"{out}/pairs.{i}"):
        f = line.split()
        if f[0] == "pair":
            # (wall, CPU) ns per pair per thread
            pairs.setdefault((f[1], int(f[2]), int(f[3]), int(f[4])), []).append((float(f[5]), float(f[6])))
        elif f[0] == "stats":
            stats.setdefault(int(f[1]), []).append(float(f[2]))
def mm(v):
    return min(v), statistics.median(v)
def wall(v):
    return [w for w, _ in v]
def cpu_time(v):
    return [c for _, c in v]
cpu = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
print("## Cache-hit pairs through `libresmem.so` from C, 1 to 8 threads (front caches)\n")
print(f"`scripts/bench-c.sh` (benches/c/pairs.c), {runs} runs; date {datetime.date.today()}; "
      f"{platform.machine()}, {cpu} CPUs (`nproc`), Linux {platform.release()}; simulated "
      "device through `libcuda_sim.so` (80 GiB). Each thread has its own stream and repeats "
      "`rm_reserve` + `rm_release` of one size for 200 ms; each figure is the median over "
      "threads of each thread's time per pair, then the minimum / median over the runs: wall "
      "time, and the thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`: the time it ran, leaving out "
      "the time it waited for a CPU). glibc is `malloc` + `free` of the same size in the same "
      "process and run. The ratios are of the minima of CPU time. With more threads than the 2 "
      "CPUs, threads share a CPU, so a thread's wall time per pair grows with them.\n")
print("| cached | size | threads | resmem wall (ns) | resmem CPU (ns) | glibc wall (ns) | glibc CPU (ns) | resmem / glibc | resmem / 1 thread | glibc / 1 thread |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for cached in sorted({k[3] for k in pairs}):
    for size in sorted({k[2] for k in pairs}):
        one = min(cpu_time(pairs[("resmem", 1, size, cached)]))
        g_one = min(cpu_time(pairs[("glibc", 1, size, cached)]))
        for threads in sorted({k[1] for k in pairs}):
            r, g = pairs[("resmem", threads, size, cached)], pairs[("glibc", threads, size, cached)]
            rw, rc, gw, gc = mm(wall(r)), mm(cpu_time(r)), mm(wall(g)), mm(cpu_time(g))
            print(f"| {cached:,} | {human(size)} | {threads} | {rw[0]:.1f} / {rw[1]:.1f} | "
                  f"{rc[0]:.1f} / {rc[1]:.1f} | {gw[0]:.1f} / {gw[1]:.1f} | {gc[0]:.1f} / {gc[1]:.1f} | "
                  f"{rc[0] / gc[0]:.2f} | {rc[0] / one:.2f} | {gc[0] / g_one:.2f} |")
print()
flat = []
for size in sorted({k[2] for k in pairs}):
    a = min(cpu_time(pairs[("resmem", 1, size, 0)]))
    b = min(cpu_time(pairs[("resmem", 1, size, max(k[3] for k in pairs))]))
    flat.append(f"{human(size)} {b / a:.2f}")
print("Flatness (one thread, 100k cached / 0 cached, minima of CPU time): " + ", ".join(flat) + "\n")
print("| cached | `rm_get_stats` min / median (ns) |")
print("| ---: | ---: |")
for cached in sorted(stats):
    s = mm(stats[cached])
    print(f"| {cached:,} | {s[0]:.0f} / {s[1]:.0f} |")
print()
scale = {}
for i in range(1, runs + 1):
    path = f"{out}/scaling.{i}"
    if not os.path.exists(path):
        continue
    rnd = {}
    for line in open(path):
        f = line.split()
        if f[0] == "scaling":
            key = (f[1], int(f[3]), int(f[4]))
            # Each line is one round's timing of its (impl, size, cached) at 1 or 2 threads, the
            # 1-thread one first: pair them up round by round.
            rnd.setdefault((key, int(f[2])), []).append(float(f[6]))
    for (key, threads), v in rnd.items():
        scale.setdefault((key, threads), []).extend(v)
if scale:
    n = len(next(iter(scale.values())))
    print("### Two threads against one, in alternation\n")
    print(f"`scripts/bench-c.sh` (`pairs scaling {os.environ.get('ROUNDS', '5')}` in each of {runs} runs): "
          f"{n} rounds of each case; in each round the pair from 1 thread, then from 2 threads "
          "(each on its own stream), resmem's then glibc's, 100 ms each (after 10 ms to start), "
          "so that both thread counts meet the machine's other work alike. CPU time per pair per "
          "thread (the median over threads). Min: the minimum over the rounds, and the ratio of the "
          "minima; median ratio: each round's 2-thread figure over its 1-thread figure, the median "
          "over the rounds.\n")
    print("| cached | size | resmem 1 / 2 threads, min (ns) | resmem ratio of minima | resmem median ratio | glibc 1 / 2 threads, min (ns) | glibc ratio of minima | glibc median ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cached in sorted({k[0][2] for k in scale}):
        for size in sorted({k[0][1] for k in scale}):
            row = [f"{cached:,}", human(size)]
            for impl in ("resmem", "glibc"):
                one, two = scale[((impl, size, cached), 1)], scale[((impl, size, cached), 2)]
                ratios = [b / a for a, b in zip(one, two)]
                row += [f"{min(one):.1f} / {min(two):.1f}", f"{min(two) / min(one):.2f}",
                        f"{statistics.median(ratios):.2f}"]
            print("| " + " | ".join(row) + " |")
    print()
print("The waits behind `rm_free_reusable` are measured by `scripts/bench-pauses.sh` (below).\n")
instructions = [line.split() for line in open(f"{out}/instructions")]
if instructions:
    print("Instructions of one cache-hit pair, one thread (callgrind, `pairs count`): " +
          ", ".join(f"{human(int(size))} {n}" for size, n in instructions) + "\n")
sweep_tables()
PY
