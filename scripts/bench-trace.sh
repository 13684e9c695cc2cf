#!/usr/bin/env bash
# Whole workloads through the shipped libresmem.so from C (benches/c/trace.c), where the pairs
# of scripts/bench-c.sh are cache hits only: the shipped traces (traces/*.jsonl, their reserves
# and releases; their rm_warmup calls left out) and generated workloads of
# scripts/policy-sweep.py's families, each replayed REPS times over (default 20) on one thread,
# RUNS times (default 3). Prints a Markdown table: CPU time per operation, the minimum and the
# median over the runs of each run's minimum over its repetitions (the first left out), and the
# reserves served from a free block (rm_get_stats' cache hits: no new segment). With BEFORE_LIB=DIR (a directory holding another build's
# libresmem.so, e.g. of an earlier commit), each run times that library too, right after this
# one, and the table gives both and their ratio.
#
#   scripts/bench-trace.sh
#   BEFORE_LIB=/tmp/before-target/release RUNS=5 scripts/bench-trace.sh
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
reps=${REPS:-20}
out=target/bench-trace
mkdir -p "$out/ops" "$out/before"
. scripts/c-bench.sh
# The program finds the library beside itself, or in BEFORE_LIB.
c_bench_build trace "$out"
if [ -n "${BEFORE_LIB:-}" ]; then
  ln -sf "$BEFORE_LIB/libresmem.so" "$out/before/libresmem.so.0"
fi

# Each workload as `a ID SIZE STREAM` / `f ID` lines, with its device's memory in a .mem file.
python3 - "$out/ops" <<'EOF'
import importlib.util, json, pathlib, sys

root, out = pathlib.Path.cwd(), pathlib.Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("sweep", root / "scripts" / "policy-sweep.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)

def write(name, lines):
    ids, ops, memory = {}, [], 80 << 30
    for o in lines:
        if o["op"] == "meta":
            memory = o.get("device_memory", memory)
        elif o["op"] == "alloc":
            ids[o["id"]] = len(ids)
            ops.append(f"a {ids[o['id']]} {o['size']} {o.get('stream', 0)}")
        elif o["op"] == "free":
            ops.append(f"f {ids[o['id']]}")
    (out / f"{name}.ops").write_text("\n".join(ops) + "\n")
    (out / f"{name}.mem").write_text(f"{memory}\n")

for path in sorted((root / "traces").glob("*.jsonl")):
    write(path.stem, [json.loads(line) for line in path.read_text().splitlines()])
for family in ["training", "decode", "serve", "multistream", "random", "interleaved"]:
    trace = sweep.FAMILIES[family](1000)
    write(trace.lines[0]["name"], trace.lines)
EOF

rm -f "$out"/runs.*
for i in $(seq 1 "$runs"); do
  for ops in "$out"/ops/*.ops; do
    name=$(basename "$ops" .ops)
    memory=$(cat "${ops%.ops}.mem")
    echo "$name now $(CUDA_SIM_DEVICES=$memory "$out/trace" "$ops" "$reps")" >> "$out/runs.$i"
    if [ -n "${BEFORE_LIB:-}" ]; then
      echo "$name before $(LD_LIBRARY_PATH="$out/before" CUDA_SIM_DEVICES=$memory \
        "$out/trace" "$ops" "$reps")" >> "$out/runs.$i"
    fi
  done
done

python3 - "$out" "$runs" <<'EOF'
import collections, statistics, sys

out, runs = sys.argv[1], int(sys.argv[2])
times, hits = collections.defaultdict(list), {}
for i in range(1, runs + 1):
    for line in open(f"{out}/runs.{i}"):
        name, lib, _, ops, reps, best, _median, reserves, hit, _peak = line.split()
        times[name, lib].append(float(best))
        hits[name, lib] = (int(ops), int(reserves), int(hit))
names = sorted({name for name, _ in times})
before = any(lib == "before" for _, lib in times)
fmt = lambda xs: f"{min(xs):.1f} / {statistics.median(xs):.1f}"
head = "| workload | operations | ns per operation, min / median |"
rule = "| --- | ---: | ---: |"
if before:
    head += " before, min / median | now / before (minima) |"
    rule += " ---: | ---: |"
print(head + " reserves served from a free block |")
print(rule + " ---: |")
for name in names:
    ops, reserves, hit = hits[name, "now"]
    row = f"| {name} | {ops:,} | {fmt(times[name, 'now'])} |"
    if before:
        ratio = min(times[name, "now"]) / min(times[name, "before"])
        row += f" {fmt(times[name, 'before'])} | {ratio:.2f} |"
    print(row + f" {100 * hit / reserves:.1f} % |")
EOF
