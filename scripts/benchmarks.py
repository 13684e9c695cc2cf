#!/usr/bin/env python3
"""Measure and print BENCHMARKS.md.

    scripts/benchmarks.py > BENCHMARKS.md               # runs `cargo bench -p resmem-cli --bench pool`
                                                        # and `--bench record` first
    scripts/benchmarks.py --skip-run > BENCHMARKS.md    # reuses target/criterion
    scripts/benchmarks.py --replays-only                # the policy tables and the demo only

Figures are criterion's median time per operation (ns); every ratio is to the reference in the
same group, measured in the same run. The policy tables come from scripts/policy-check.py (every
trace in traces/ and every snapshot in ../shared/real-snapshots/) and the seed from `resmem demo`.
"""
import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRIT = os.path.join(ROOT, "target", "criterion")
SIZES = ["512B", "64KiB", "4MiB", "64MiB"]
CACHED = ["0", "1000", "10000", "100000"]


def sh(*cmd):
    return subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def median(*parts):
    path = os.path.join(CRIT, *parts, "new", "estimates.json")
    with open(path) as f:
        return json.load(f)["median"]["point_estimate"]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def policy_sections(w):
    """The policies on every shipped trace and shared snapshot, and the seed scenario."""
    w("## Policies on every shipped trace and shared snapshot\n")
    w("`scripts/policy-check.py --markdown`: each trace in `traces/` and each PyTorch snapshot in")
    w("`../shared/real-snapshots/` replayed under PyTorch's policy (the reference, in the same run),")
    w("resmem with classic segments and resmem on the virtual-memory API (`*`: resmem's default).")
    w("Snapshots on a simulated 80 GiB device, traces on their own. Smallest device: bisection to")
    w("32 MiB. Creating calls: `cuMemAlloc` + `cuMemCreate`. Driver time: the simulator's cost model")
    w("(`cuda-sim/src/ledger.rs`). Fragmentation: 1 - peak requested / peak reserved. The last column")
    w("is the acceptance criteria for the default against PyTorch's policy.\n")
    check = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "policy-check.py"),
                            "--markdown", "--no-build"], cwd=ROOT, capture_output=True, text=True)
    w(check.stdout.rstrip() + "\n")
    w(check.stderr.strip() + "\n")
    w("## The seed scenario\n")
    w("`cargo run --release -p resmem-cli -- demo`\n")
    w("```")
    w(sh(os.path.join(ROOT, "target", "release", "resmem"), "demo").rstrip())
    w("```")


def record_section(w):
    """What recording (RESMEM_CONF=record:PATH) adds to a cache-hit pair (benches/record.rs)."""
    w("## Recording (`RESMEM_CONF=record:PATH`): a cache-hit pair, recorded and not\n")
    w("`cargo bench -p resmem-cli --bench record`: the C-ABI pair, and the same pair with the recorder")
    w("calls its hooks make (into a recorder writing to `/dev/null`), in the same run, seen three ways:")
    w("elapsed time per pair (`wall`); the CPU time of the calling thread per pair (`caller CPU`,")
    w("`CLOCK_THREAD_CPUTIME_ID`: what recording costs the program's own thread); the writer thread's")
    w("CPU time per recorded pair (`writer CPU`: the sorting and formatting moved off the program's")
    w("threads). In a loop of nothing but pairs the writer, formatting two lines per pair, sets the")
    w("pace of `wall` as soon as it has no core of its own. The target is at most 10% more than the")
    w("plain pair.\n")
    w("| size | pair, wall (ns) | recorded, wall (ns) | wall ratio | pair, caller CPU (ns) "
      "| recorded, caller CPU (ns) | caller CPU ratio | writer CPU (ns) |")
    w("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in ("512B", "4MiB"):
        pw, rw = median("record", "wall_pair", s), median("record", "wall_pair-recorded", s)
        pc = median("record", "caller-cpu_pair", s)
        rc = median("record", "caller-cpu_pair-recorded", s)
        wc = median("record", "writer-cpu_pair-recorded", s)
        w(f"| {s} | {pw:.1f} | {rw:.1f} | {rw / pw:.2f} | {pc:.1f} | {rc:.1f} | {rc / pc:.2f} "
          f"| {wc:.1f} |")
    w("")
    worst = max(median("record", "caller-cpu_pair-recorded", s) / median("record", "caller-cpu_pair", s)
                for s in ("512B", "4MiB"))
    w(f"The target (recorded / plain at most 1.10) is {'met' if worst <= 1.10 else 'not met'} "
      f"for the calling thread's CPU time (worst ratio {worst:.2f}).\n")
    alone = median("record", "wall_recorder-alone")
    w(f"Recorder alone (an `alloc` entry and a `free` entry, wall): {alone:.1f} ns.\n")
    bp, br = median("record", "bursts_pair"), median("record", "bursts_pair-recorded")
    ba = median("record", "bursts_recorder-alone")
    w(f"512 B pairs in bursts of 400 with an untimed flush after each (no writer running beside "
      f"them), wall per pair: {bp:.1f} ns plain, {br:.1f} ns recorded ({br / bp:.2f}); the "
      f"recorder's two calls alone: {ba:.1f} ns.\n")
    p2 = median("record", "wall_2-threads_pair")
    r2 = median("record", "wall_2-threads_pair-recorded")
    w(f"Two threads making 512 B pairs at once, wall per pair: {p2:.1f} ns plain, {r2:.1f} ns recorded "
      f"({r2 / p2:.2f}).\n")


def main():
    if "--replays-only" in sys.argv:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "resmem-cli"], cwd=ROOT,
                       check=True, stdout=sys.stderr)
        out = []
        w = out.append
        w(f"Measured {datetime.date.today().isoformat()} on {cpu_model()}, {sh('nproc').strip()} "
          "CPUs, devices simulated in process.\n")
        policy_sections(w)
        print("\n".join(out))
        return
    if "--skip-run" not in sys.argv:
        for bench in ("pool", "record"):
            subprocess.run(["cargo", "bench", "-p", "resmem-cli", "--bench", bench], cwd=ROOT,
                           check=True, stdout=sys.stderr)
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "resmem-cli"], cwd=ROOT,
                   check=True, stdout=sys.stderr)
    out = []
    w = out.append
    w("# Benchmarks\n")
    w("Measured with `scripts/benchmarks.py > BENCHMARKS.md` (which runs `cargo bench -p resmem-cli")
    w("--bench pool`, `cargo bench -p resmem-cli --bench record` and `resmem replay` on every trace);")
    w("`--skip-run` re-prints from `target/criterion`.\n")
    w(f"- date: {datetime.date.today().isoformat()}")
    w(f"- machine: {cpu_model()}, {sh('nproc').strip()} CPUs (`nproc`), {platform.system()} "
      f"{platform.release()}")
    w(f"- {sh('rustc', '--version').strip()}; devices simulated in process (`RESMEM_DRIVER=sim`, 80 GiB)")
    w("- figures: criterion's median per operation; each ratio is to the reference named in its "
      "column, measured in the same run\n")

    w("## Cache-hit `rm_reserve` + `rm_release` pair through the C ABI\n")
    w("With N other blocks cached (90% small up to 128 KiB, 10% large, each kept apart by a live")
    w("512-byte block). `torch` is the PyTorch-policy baseline's pair (`cli/src/baseline/torch.rs`),")
    w("`glibc` is `malloc` + `free` of the same size.\n")
    w("| cached | size | resmem (ns) | torch (ns) | glibc (ns) | resmem / glibc | resmem / torch |")
    w("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in CACHED:
        for s in SIZES:
            g = f"pair_{n}-cached"
            r, t, c = (median(g, who, s) for who in ("resmem", "torch", "glibc"))
            w(f"| {int(n):,} | {s} | {r:.1f} | {t:.1f} | {c:.1f} | {r / c:.2f} | {r / t:.2f} |")
    w("")
    met = sum(1 for n in CACHED for s in SIZES
              if median(f"pair_{n}-cached", "resmem", s) <= 20
              and median(f"pair_{n}-cached", "resmem", s) <= 2 * median(f"pair_{n}-cached", "glibc", s))
    w(f"Targets of issue 11 (a pair <= 20 ns and <= 2x glibc's): met in {met} of {len(CACHED) * len(SIZES)} cases.")
    w("On a machine whose cores are shared with other work, single figures vary by tens of percent.\n")
    w("Flatness (resmem's pair with 100k cached / with 0 cached): " + ", ".join(
        f"{s} {median('pair_100000-cached', 'resmem', s) / median('pair_0-cached', 'resmem', s):.2f}"
        for s in SIZES) + "\n")

    w("## The same pair from 2 threads on 2 streams at once\n")
    w("Wall time per pair while both threads run.\n")
    w("| size | resmem (ns) | torch (ns) | glibc (ns) | resmem / glibc | resmem / torch |")
    w("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in SIZES:
        r, t, c = (median("pair-2-threads", who, s) for who in ("resmem", "torch", "glibc"))
        w(f"| {s} | {r:.1f} | {t:.1f} | {c:.1f} | {r / c:.2f} | {r / t:.2f} |")
    w("")

    record_section(w)

    w("## `rm_mem_get_info` against the bare simulated driver call\n")
    r, d, t = (median("mem_get_info", who) for who in ("resmem", "sim-driver", "torch"))
    w("| call | ns | / sim driver |")
    w("| --- | ---: | ---: |")
    w(f"| `rm_mem_get_info` (driver free + reusable) | {r:.1f} | {r / d:.2f} |")
    w(f"| simulated driver `mem_get_info` | {d:.1f} | 1.00 |")
    w(f"| torch baseline `mem_get_info` (the driver's view) | {t:.1f} | {t / d:.2f} |")
    w("")

    w("## A segment built from cached holes, on the simulated driver\n")
    w("A 1 GiB request on a 2 GiB simulated device holding a 1.5 GiB warm-up split into 24 blocks of")
    w("64 MiB with every other one released (768 MiB free in twelve pieces, 512 MiB left on the")
    w("driver). The default maps the twelve pieces into a new range and creates one 256 MiB handle")
    w("(one address reserve, one create, 13 maps, as `src/pool/tests/pages.rs` asserts); classic")
    w("segments cannot serve it at all. For reference, the same request on an empty device, with the")
    w("virtual-memory API (reserve, create, map, access) and with one `cuMemAlloc`.\n")
    h, f, c = (median("stitch-1GiB", who) for who in
               ("resmem-vmm-from-holes", "resmem-vmm-fresh", "resmem-classic-fresh"))
    w("| case | time (us) | / classic fresh |")
    w("| --- | ---: | ---: |")
    w(f"| default, from holes | {h / 1000:.1f} | {h / c:.2f} |")
    w(f"| default, fresh | {f / 1000:.1f} | {f / c:.2f} |")
    w(f"| classic, fresh | {c / 1000:.1f} | 1.00 |")
    w("")
    w("The simulator's time is not the driver's: `resmem replay` estimates driver time with a")
    w("per-call cost model (`cuda-sim/src/ledger.rs`), and the H200 figures in the README predate")
    w("this design.\n")
    w("## Growth among many cached free blocks\n")
    w("A 1 GiB request that the cache cannot cover, so the default creates it, on a simulated device")
    w("holding 1,000 or 100,000 free 4 MiB blocks, each between two live ones. The search for cached")
    w("pieces to map into the new range looks only at the largest free blocks and at those just")
    w("large enough to cover what is left (`DevicePool::lendable`), not at every free block.\n")
    small, large = (median("growth-among-free-blocks", n) for n in ("1000", "100000"))
    w("| free blocks cached | time (us) | / 1,000 cached |")
    w("| ---: | ---: | ---: |")
    w(f"| 1,000 | {small / 1000:.1f} | 1.00 |")
    w(f"| 100,000 | {large / 1000:.1f} | {large / small:.2f} |")
    w("")

    policy_sections(w)

    # Two processes sharing a device: seconds to run, so run even with --skip-run.
    w(sh("cargo", "bench", "-q", "-p", "resmem-cli", "--bench", "share").rstrip() + "\n")
    w("`cargo run --release -p resmem-cli -- demo --processes 2`\n")
    w("```")
    w(sh(os.path.join(ROOT, "target", "release", "resmem"), "demo", "--processes", "2").rstrip())
    w("```")
    print("\n".join(out))


if __name__ == "__main__":
    main()
