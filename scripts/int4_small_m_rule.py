"""Replay tileq.int4p's choice between the decode kernel and the Gluon prefill kernel below
DEQUANT_MIN_M tokens on a measured sweep (no GPU).

    python scripts/int4_small_m_rule.py bench/results/h200/int4/small-m/int4.csv

The CSV comes from ``scripts/int4_bench.py --small-m-prefill``: per weight and M, the default
path of that run ('w4a16_prepacked': the decode kernel, 32-token tiles) and the Gluon prefill
kernel forced with 64- and 128-token tiles ('w4a16_gluon_t64' / '_t128'). For each problem the
script takes the time of what ``prefill.prefers`` and ``prefill.tokens_for`` choose now and prints,
per M, its speed-up over the decode kernel, how far it is from the fastest of the three, and its
speed against bf16 cuBLAS and tileq's int8 rowcol of the same run.
"""

from __future__ import annotations

import collections
import csv
import statistics
import sys

SMS = 132


def main() -> int:
    sys.path.insert(0, "src")
    from tileq.int4p import prefill

    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    t = collections.defaultdict(dict)
    for r in csv.DictReader(open(sys.argv[1])):
        if r["ms"]:
            t[(r["shape"], int(r["m"]), int(r["n"]), int(r["k"]))][r["impl"]] = float(r["ms"])
    by_m = collections.defaultdict(list)
    for (shape, m, n, k), d in sorted(t.items()):
        if "w4a16_gluon_t64" not in d:
            continue
        decode = d["w4a16_prepacked"]
        chosen = (d[f"w4a16_gluon_t{prefill.tokens_for(m, n, SMS)}"] if prefill.prefers(m, n, SMS) else decode)
        best = min(decode, d["w4a16_gluon_t64"], d["w4a16_gluon_t128"])
        by_m[m].append((decode / chosen, chosen / best, d["bf16_cublas"] / chosen, d["bf16_cublas"] / decode,
                        chosen / d["int8_rowcol"], decode / d["int8_rowcol"], shape))
    print(f"{'M':>4} {'n':>3} | {'speed-up over decode: median (min-max)':>38} | {'off best: median / max':>22} | "
          f"{'bf16/chosen (decode)':>20} | {'chosen/int8 (decode)':>20}")
    for m in sorted(by_m):
        v = by_m[m]
        col = lambda i: [x[i] for x in v]  # noqa: E731
        med = statistics.median
        print(f"{m:>4} {len(v):>3} | {med(col(0)):>20.3f} ({min(col(0)):.3f}-{max(col(0)):.3f}) | "
              f"{med(col(1)):>10.3f} / {max(col(1)):.3f} | {med(col(2)):>11.3f} ({med(col(3)):.3f}) | "
              f"{med(col(4)):>11.3f} ({med(col(5)):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
