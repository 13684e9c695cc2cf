#!/usr/bin/env python3
"""Issue 9's policy check: every shipped trace and every PyTorch snapshot in a folder, replayed
under PyTorch's policy and resmem's classic and virtual-memory policies (and resmem's default,
marked, if it is neither; and the default behind the front caches the C library adds,
`resmem-front`, checked but not judged), with the criteria that resmem's default must meet against PyTorch's:

  peak reserved <= PyTorch's + 0.5%; smallest device <= PyTorch's; out-of-memory events <=
  PyTorch's; memory-creating driver calls (cuMemAlloc + cuMemCreate) <= PyTorch's; where
  PyTorch's fragmentation exceeds 5%, at most half of it.

Fragmentation is 1 - peak requested bytes / peak reserved bytes, for every policy
(traces/README.md). Driver time is the simulator's estimate (cuda-sim/src/ledger.rs).

    scripts/policy-check.py                       # snapshots from ../shared/real-snapshots
    scripts/policy-check.py SNAPSHOT_DIR          # another folder of *.pickle
    scripts/policy-check.py --markdown            # the table for BENCHMARKS.md
    scripts/policy-check.py --handle-part 2MiB    # as on the CUDA driver (pages, or larger parts)
    scripts/policy-check.py --torch-conf max_split_size_mb:128   # against PyTorch so tuned

It builds the command (release) first, prints one block per trace, and exits 1 if any trace
fails a criterion. It is a measurement, not a test.
"""
import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESMEM = ROOT / "target" / "release" / "resmem"
GIB = 1 << 30
# More arguments for every replay: `--handle-part SIZE` replays as on the CUDA driver.
REPLAY_ARGS = []


def replay(path, policy):
    out = subprocess.run(
        [str(RESMEM), "replay", str(path), "--policy", policy, "--min-device", "--json",
         *REPLAY_ARGS],
        cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def figures(path, front=False):
    """The trace's JSON figures with every policy, resmem's default added if none is it, and
    with `front` the default behind the front caches the C library adds (`resmem-front`)."""
    report = replay(path, "all")
    if not any(p["default"] for p in report["policies"]):
        default = replay(path, "resmem")["policies"][0]
        report["policies"].append(default)
    if front:
        report["policies"].append(replay(path, "resmem-front")["policies"][0])
    return report


# The criteria, as `checks` names them, with a column header for each.
PEAK = "peak reserved <= torch +0.5%"
DEVICE = "smallest device <= torch"
OOMS = "OOMs <= torch"
CALLS = "creating calls <= torch"
FRAGMENTATION = "fragmentation <= torch / 2"
CRITERIA = {PEAK: "peak", DEVICE: "smallest device", OOMS: "OOMs", CALLS: "creating",
            FRAGMENTATION: "fragmentation"}


def checks(torch, default):
    """(criterion, passed) for resmem's default against PyTorch's policy."""
    t_dev, d_dev = torch["smallest_device"], default["smallest_device"]
    device_ok = d_dev is not None and (t_dev is None or d_dev <= t_dev)
    # A PyTorch run that failed requests the default served did less work: its peak is no bar.
    torch_failed = torch["ooms"] > default["ooms"]
    peak = (PEAK
            + (f" (n/a: PyTorch's policy failed {torch['ooms']} request(s) the default served)"
               if torch_failed else ""),
            torch_failed or default["peak_reserved"] <= torch["peak_reserved"] * 1.005)
    out = [
        peak,
        (DEVICE, device_ok),
        (OOMS, default["ooms"] <= torch["ooms"]),
        (CALLS, default["creating_calls"] <= torch["creating_calls"]),
    ]
    if torch["fragmentation"] > 0.05:
        out.append((FRAGMENTATION,
                    default["fragmentation"] <= torch["fragmentation"] / 2))
    return out


def judged(path, front=False):
    """The trace's report, PyTorch's figures, the default's, and the criteria checked."""
    report = figures(path, front)
    policies = report["policies"]
    torch = next(p for p in policies if p["policy"] == "torch")
    default = next(p for p in policies if p["default"])
    return report, torch, default, checks(torch, default)


def judged_front(path):
    """PyTorch's figures, the default's behind the front caches (`resmem-front`), and the
    criteria checked: those two replays alone."""
    torch, front = (replay(path, p)["policies"][0] for p in ("torch", "resmem-front"))
    return torch, front, checks(torch, front)


def gib(n):
    return "none" if n is None else f"{n / GIB:.2f}"


def row(p):
    name = p["policy"] + (" *" if p["default"] else "")
    return (name, gib(p["peak_reserved"]), gib(p["smallest_device"]), str(p["ooms"]),
            str(p["creating_calls"]), f"{p['driver_time_us'] / 1000:.2f}",
            f"{100 * p['fragmentation']:.2f} %")


HEADER = ("policy", "peak reserved (GiB)", "smallest device (GiB)", "OOMs",
          "creating calls", "est. driver time (ms)", "fragmentation")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshots", nargs="?", default=str(ROOT.parent / "shared" / "real-snapshots"),
                        help="a folder of PyTorch memory snapshots (*.pickle)")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--no-build", action="store_true", help="use target/release/resmem as is")
    parser.add_argument("--handle-part", metavar="SIZE",
                        help="replay as on the CUDA driver, resmem's handles made of parts of "
                        "SIZE (2MiB: a page each, the default there)")
    parser.add_argument("--torch-conf", metavar="CONF",
                        help="PyTorch's policy with these PYTORCH_CUDA_ALLOC_CONF settings "
                        "(max_split_size_mb, max_non_split_rounding_mb, "
                        "roundup_power2_divisions, expandable_segments), as PyTorch tuned")
    args = parser.parse_args()
    if args.handle_part:
        REPLAY_ARGS.extend(["--handle-part", args.handle_part])
    if args.torch_conf:
        REPLAY_ARGS.extend(["--torch-conf", args.torch_conf])
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "resmem-cli"], cwd=ROOT, check=True)
    paths = sorted((ROOT / "traces").glob("*.jsonl"))
    folder = pathlib.Path(args.snapshots)
    if folder.is_dir():
        paths += sorted(folder.glob("*.pickle"))
    else:
        print(f"policy-check: {folder} is not a folder; shipped traces only", file=sys.stderr)
    failed = []
    front_missed = []
    recorded_rows = []
    if args.markdown:
        print("| trace | " + " | ".join(HEADER) + " | default vs torch |")
        print("| --- | " + " | ".join(["---"] + ["---:"] * (len(HEADER) - 1)) + " | --- |")
    for path in paths:
        report, torch, default, results = judged(path, front=True)
        policies = report["policies"]
        # Shown and checked, not judged: what the C library's callers get (the front caches
        # change which free blocks the pool sees), against the same criteria.
        front = next(p for p in policies if p["policy"] == "resmem-front")
        front_results = checks(torch, front)
        front_misses = ", ".join(name for name, ok in front_results if not ok)
        if front_misses:
            front_missed.append(f"{report['trace']} ({front_misses})")
        verdict = "PASS" if all(ok for _, ok in results) else "FAIL"
        if verdict == "FAIL":
            failed.append(report["trace"])
        missed = ", ".join(name for name, ok in results if not ok)
        recorded = report.get("torch_recorded_peak_reserved")
        if recorded is not None:
            recorded_rows.append((path.name, recorded, torch["peak_reserved"]))
        if args.markdown:
            for i, p in enumerate(policies):
                name = f"`{path.name}`" if i == 0 else ""
                mark = (verdict + (f": {missed}" if missed else "")) if i == 0 else ""
                if p is front:
                    mark = "front: " + (f"misses {front_misses}" if front_misses else "meets all")
                print(f"| {name} | " + " | ".join(row(p)) + f" | {mark} |")
            continue
        print(f"== {path.name}: {report['allocations']} allocations")
        if recorded is not None:
            ratio = torch["peak_reserved"] / max(recorded, 1)
            print(f"   PyTorch recorded a peak reserved of {gib(recorded)} GiB; its policy "
                  f"replayed {gib(torch['peak_reserved'])} GiB ({ratio:.4f} x)")
        widths = [16] + [max(len(h), 10) for h in HEADER[1:]]
        print("   " + "  ".join(h.rjust(w) for h, w in zip(HEADER, widths)))
        for p in policies:
            print("   " + "  ".join(c.rjust(w) for c, w in zip(row(p), widths)))
        for name, ok in results:
            print(f"   {'PASS' if ok else 'FAIL'}  {name}")
        print(f"   {verdict}")
    if args.markdown and recorded_rows:
        print("\n| snapshot | peak reserved PyTorch recorded (GiB) | torch policy replayed (GiB) "
              "| replayed / recorded |")
        print("| --- | ---: | ---: | ---: |")
        for name, recorded, replayed in recorded_rows:
            print(f"| `{name}` | {recorded / GIB:.3f} | {replayed / GIB:.3f} "
                  f"| {replayed / max(recorded, 1):.4f} |")
    print(f"\n{len(paths) - len(failed)} of {len(paths)} traces pass"
          + (f"; failing: {', '.join(failed)}" if failed else ""),
          file=sys.stderr if args.markdown else sys.stdout)
    print(f"resmem-front (not judged) meets every criterion on {len(paths) - len(front_missed)} "
          f"of {len(paths)}" + (f"; misses: {'; '.join(front_missed)}" if front_missed else ""),
          file=sys.stderr if args.markdown else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
