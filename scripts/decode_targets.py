"""The decode issue's target table from a ``tileq bench --suite decode-targets`` results.csv.

    python scripts/decode_targets.py bench/results/h200/decode/results.csv

Weight TB/s counts the weight bytes alone (N x K at the weight's width), over M <= 16 and weights
of 25 MB or more; "vs torch" is the same-scheme torch path of the same run (int8 rowcol:
torch._int_mm + dequantization; fp8 rowcol: _scaled_mm row-wise; abquant: cuBLASLt block-wise),
as median (min-max) of the per-shape ratios. int4 bquant: tileq time over tileq's int8 rowcol
time at the same (M, N, K).
"""

import csv
import statistics
import sys
from collections import defaultdict

TARGETS = {  # case -> same-scheme torch baseline
    "rowcol:i8xi8:rcr": "torch_int_mm_dequant",
    "rowcol:fp8xfp8:rcr": "torch_scaled_mm_rowwise",
    "abquant:fp8xfp8:rcr": "torch_scaled_mm_blockwise",
}
INT4 = ["bquant:fp8xi4:rcr", "bquant:bf16xi4:rcr"]


def _spread(xs):
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main(path: str) -> None:
    t = defaultdict(dict)  # (case, m, n, k) -> impl -> ms
    for r in csv.DictReader(open(path)):
        if r["status"] == "ok":
            t[(r["case"], int(r["m"]), int(r["n"]), int(r["k"]))][r["impl"]] = float(r["time_ms"])
    print("| case | weight TB/s, median (min-max) | vs same-scheme torch, median (min-max) | problems |")
    print("|---|---|---|---|")
    for case, base in TARGETS.items():
        tbps, ratio = [], []
        for (c, m, n, k), impls in t.items():
            if c != case or m > 16 or n * k < 25e6 or "tileq" not in impls:
                continue
            tbps.append(n * k / (impls["tileq"] * 1e-3) / 1e12)
            if base in impls:
                ratio.append(impls[base] / impls["tileq"])
        print(f"| {case} | {_spread(tbps)} | {_spread(ratio)}x | {len(tbps)} |")
    print()
    print("| case | time / int8 rowcol time, median (min-max), M <= 16 | M <= 64 |")
    print("|---|---|---|")
    for case in INT4:
        small, all_m = [], []
        for (c, m, n, k), impls in t.items():
            i8 = t.get(("rowcol:i8xi8:rcr", m, n, k), {}).get("tileq")
            if c == case and "tileq" in impls and i8:
                all_m.append(impls["tileq"] / i8)
                if m <= 16:
                    small.append(impls["tileq"] / i8)
        print(f"| {case} | {_spread(small)} | {_spread(all_m)} |")


if __name__ == "__main__":
    main(sys.argv[1])
