#!/usr/bin/env python3
"""One training step's GPU timeline, from an Nsight Systems trace.

    step_profile.py TRACE.csv [--top N]

TRACE.csv is `nsys stats --report cuda_gpu_trace --format csv` of a run of
bench:train (gpu-check.sh makes it): one row per kernel, memcpy and memset
with its start and duration in ns. A trainer step ends in its one read, a
device-to-host copy, so the time from one such copy's end to the next is a
step as the host sees it. The last of those intervals holding at least
--min-ops GPU operations (a step has hundreds; the reads of start-up hold
few) is reported:

- its length, the time the GPU was busy (the union of its operations'
  intervals) and idle (the rest), and the idle time in gaps of 10 us and
  more;
- the longest gaps, each with the operations before and after it (where the
  device waited for the host, or for a read);
- the kernels by total time, grouped by name (template arguments and
  parameters dropped), with their launches and share of the step.

Prints markdown. Exit status 1 when the trace holds no such step.
"""

import argparse
import csv
import re
import sys

GAP_NS = 10_000  # a gap worth naming: 10 us


def short_name(name):
    """A kernel's name without 'void ', namespaces, template arguments and parameters."""
    n = name.strip()
    if n.startswith("[") or ("(" not in n and "<" not in n):
        return n[:60]  # [CUDA memcpy ...], [CUDA memset], or a plain name (cuBLAS's nvjet_..., sm90_...)
    n = n[5:] if n.startswith("void ") else n
    n = n.replace("(anonymous namespace)::", "")
    depth, cut = 0, len(n)
    for i, c in enumerate(n):  # the first '<' or '(' outside brackets ends the qualified name
        if c in "<(" and depth == 0:
            cut = i
            break
    n = n[:cut]
    return n.split("::")[-1][:60] or name[:60]


def is_read(name):
    return "memcpy" in name.lower() and re.search(r"DtoH|Device-to-Host", name) is not None


def load(path):
    ops = []
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = None
        for row in rows:
            if header is None:
                if "Start (ns)" in row and "Duration (ns)" in row and "Name" in row:
                    header = {h: i for i, h in enumerate(row)}
                continue  # nsys may print lines before the header
            if len(row) < len(header):
                continue
            try:
                start, dur = int(float(row[header["Start (ns)"]])), int(float(row[header["Duration (ns)"]]))
            except ValueError:
                continue
            ops.append((start, dur, row[header["Name"]]))
    if header is None:
        raise ValueError(f"{path}: no header with Start (ns), Duration (ns) and Name")
    ops.sort()
    return ops


def last_step(ops, min_ops):
    ends = [s + d for s, d, n in ops if is_read(n)]
    for a, b in reversed(list(zip(ends, ends[1:]))):
        inside = [op for op in ops if op[0] >= a and op[0] + op[1] <= b]
        if len(inside) >= min_ops:
            return a, b, inside
    return None


def report(ops, top, min_ops):
    found = last_step(ops, min_ops)
    if found is None:
        print(f"no step: no two device-to-host reads with {min_ops} or more GPU operations between them")
        return 1
    a, b, inside = found
    busy, gaps, cursor = 0, [], a  # the union of the intervals, in start order
    prev = "(the previous read)"
    for s, d, n in inside:
        if s > cursor:
            gaps.append((s - cursor, cursor - a, prev, n))
        end = s + d
        if end > cursor:
            busy += end - max(s, cursor)
            cursor = end
            prev = n
    if b > cursor:
        gaps.append((b - cursor, cursor - a, prev, "(this step's read)"))
    wall = b - a
    idle = wall - busy
    big = [g for g in gaps if g[0] >= GAP_NS]
    ms = lambda ns: ns / 1e6
    print(f"One step, the last whole one in the trace: {ms(wall):.2f} ms from read to read, "
          f"{len(inside)} GPU operations; the GPU busy {ms(busy):.2f} ms ({100 * busy / wall:.1f} %), "
          f"idle {ms(idle):.2f} ms in {len(gaps)} gaps, {ms(sum(g[0] for g in big)):.2f} ms of it in "
          f"{len(big)} gaps of 10 us or more.")
    print()
    print("| longest gaps | at (ms into the step) | after | before |")
    print("|---|---|---|---|")
    for g, at, before, after in sorted(gaps, reverse=True)[:5]:
        print(f"| {g / 1e3:.1f} us | {ms(at):.3f} | {short_name(before)} | {short_name(after)} |")
    print()
    groups = {}
    for s, d, n in inside:
        k = short_name(n)
        c, t = groups.get(k, (0, 0))
        groups[k] = (c + 1, t + d)
    print("| kernels and copies | launches | ms | share of the step |")
    print("|---|---|---|---|")
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    for k, (c, t) in ranked[:top]:
        print(f"| {k} | {c} | {ms(t):.3f} | {100 * t / wall:.1f} % |")
    rest = ranked[top:]
    if rest:
        c, t = sum(v[0] for _, v in rest), sum(v[1] for _, v in rest)
        print(f"| {len(rest)} others | {c} | {ms(t):.3f} | {100 * t / wall:.1f} % |")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="nsys stats --report cuda_gpu_trace --format csv output")
    p.add_argument("--top", type=int, default=15, help="kernel groups listed (default 15)")
    p.add_argument("--min-ops", type=int, default=50, help="GPU operations a step holds at least (default 50)")
    args = p.parse_args()
    try:
        ops = load(args.trace)
    except (OSError, ValueError) as e:
        print(f"step_profile: {e}", file=sys.stderr)
        return 2
    return report(ops, args.top, args.min_ops)


if __name__ == "__main__":
    sys.exit(main())
