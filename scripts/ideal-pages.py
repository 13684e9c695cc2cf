#!/usr/bin/env python3
"""The fragmentation an ideal page-granular pool would reach on a trace: a bound, not a policy.

Blocks are placed as PyTorch's policy places them in one segment without end: best fit by size
among the free extents of the address space (512-byte rounding, the front of the extent taken,
neighbours merged on release), a request no extent holds going to the end. Only the 2 MiB pages
holding a live byte are counted as reserved, as if every free page were unmapped at once and
mapped again wherever it is next needed, in place too. CUDA rules that last part out for pages
inside a mapping (`cuMemUnmap` takes whole mappings only), so no pool reaches this; the gap
between it and a policy is what fragmentation that policy could still remove.

    scripts/ideal-pages.py traces/interleaved-lifetimes.jsonl

Prints the peak of those pages, the peak of the bytes asked for, and the fragmentation by the
replay's definition (1 - peak requested / peak reserved). Trace format: traces/README.md
(`alloc` and `free` lines; the rest is ignored).
"""

import bisect
import json
import sys

PAGE = 2 << 20
ROUND = 512


def main(path):
    free = []  # free extents below `top`, sorted by address: (start, end)
    top = 0
    live = {}
    pages = {}  # page -> live bytes in it
    held = peak_held = requested = peak_requested = 0

    def touch(start, end, sign):
        nonlocal held
        page = start // PAGE
        while page * PAGE < end:
            part = min(end, (page + 1) * PAGE) - max(start, page * PAGE)
            before = pages.get(page, 0)
            after = before + sign * part
            held += (after > 0) - (before > 0)
            if after:
                pages[page] = after
            else:
                pages.pop(page, None)
            page += 1

    def give_back(start, end):
        nonlocal top
        i = bisect.bisect_left(free, (start, end))
        if i > 0 and free[i - 1][1] == start:
            start = free.pop(i - 1)[0]
            i -= 1
        if i < len(free) and free[i][0] == end:
            end = free.pop(i)[1]
        if end == top:
            top = start
        else:
            free.insert(i, (start, end))

    for line in open(path):
        if not line.strip() or line.startswith("#"):
            continue
        op = json.loads(line)
        if op["op"] == "alloc":
            size = -(-op["size"] // ROUND) * ROUND
            fits = [(e - s, i) for i, (s, e) in enumerate(free) if e - s >= size]
            if fits:
                _, i = min(fits)
                start, end = free.pop(i)
                if end - start > size:
                    free.insert(i, (start + size, end))
            else:
                start = top
                top += size
            live[op["id"]] = (start, size, op["size"])
            requested += op["size"]
            touch(start, start + size, 1)
            peak_held = max(peak_held, held)
            peak_requested = max(peak_requested, requested)
        elif op["op"] == "free":
            start, size, asked = live.pop(op["id"])
            requested -= asked
            touch(start, start + size, -1)
            give_back(start, start + size)
    reserved = peak_held * PAGE
    frag = 1 - peak_requested / reserved if reserved else 0.0
    print(f"{path}: peak pages {reserved / 2**20:.0f} MiB, peak requested "
          f"{peak_requested / 2**20:.0f} MiB, fragmentation {100 * frag:.2f} %")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        main(arg)
