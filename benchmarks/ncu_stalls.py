"""Warp-stall samples of an Nsight Compute source page, summed by reason and by SASS opcode.

    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_stalls.py sass.csv          (gpu_session.sh ncu runs both)
"""
import collections
import csv
import re
import sys


def main(path: str):
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    data = [r for r in rows[2:] if len(r) == len(hdr)]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]

    def num(r, h):
        return float(r[ix[h]].replace(",", "") or 0)

    total = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    for r in data:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[ix["Source"]].strip()).split(" ")[0]
        for h in reasons:
            total[h] += num(r, h)
            by_op[op][h] += num(r, h)
        by_op[op]["samples"] += num(r, "Warp Stall Sampling (All Samples)")
        by_op[op]["executed"] += num(r, "Instructions Executed")
    n = sum(total.values())
    print("samples", int(n))
    for h, v in total.most_common(12):
        print(f"  {h:28s} {100 * v / n:5.1f}%")
    print("by opcode: % of samples, warp instructions executed, [reasons above 0.4 %]")
    for op, c in sorted(by_op.items(), key=lambda kv: -kv[1]["samples"])[:22]:
        top = ", ".join(f"{k[6:]} {100 * v / n:.1f}" for k, v in c.most_common()
                        if k.startswith("stall_") and v > 0.004 * n)
        print(f"  {op:30s} {100 * c['samples'] / n:5.1f}%  {c['executed']:10.3g}  [{top}]")


if __name__ == "__main__":
    main(sys.argv[1])
