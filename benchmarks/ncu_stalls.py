#!/usr/bin/env python3
"""Summarizes Nsight Compute's per-instruction warp stall samples of one kernel:
the CSV of `ncu --import R.ncu-rep --page source --print-source sass --csv`.
Prints the samples per SASS opcode and the instructions with the most samples
(with their neighbours' opcodes, to place them in the code).

    python3 benchmarks/ncu_stalls.py source.csv [--top 30]"""

import argparse
import collections
import csv
import sys

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("csv")
ap.add_argument("--top", type=int, default=30)
args = ap.parse_args()

with open(args.csv, newline="") as f:
    lines = f.read().splitlines()
start = next((i for i, line in enumerate(lines) if line.startswith('"') and "Source" in line), None)
if start is None:
    sys.exit("no CSV header with a Source column found")
rows = list(csv.DictReader(lines[start:]))
cols = rows[0].keys() if rows else []
src_col = next(c for c in cols if c.strip() == "Source")
all_col = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
not_col = next((c for c in cols if "Warp Stall Sampling (Not" in c), None)
if all_col is None:
    sys.exit(f"no stall sampling column among {list(cols)}")


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


total = sum(num(r[all_col]) for r in rows) or 1.0
by_op = collections.Counter()
for r in rows:
    op = r[src_col].strip().split(" ")[0] if r[src_col].strip() else "?"
    if op.startswith("@"):
        op = r[src_col].strip().split(" ")[1]
    by_op[op.split(".")[0]] += num(r[all_col])
print(f"{len(rows)} instructions, {total:.0f} samples (all); by opcode:")
for op, n in by_op.most_common(15):
    print(f"  {op:16s} {n / total * 100:5.1f}%")
print(f"top {args.top} instructions:")
order = sorted(range(len(rows)), key=lambda i: -num(rows[i][all_col]))
for i in order[: args.top]:
    r = rows[i]
    ctx = " | ".join(rows[j][src_col].strip()[:28] for j in (i - 1, i + 1) if 0 <= j < len(rows))
    ni = f" not-issued {num(r[not_col]) / total * 100:4.1f}%" if not_col else ""
    print(f"  {num(r[all_col]) / total * 100:5.1f}%{ni}  [{i:5d}] {r[src_col].strip()[:60]}   ({ctx})")
