"""Replay tileq.prepacked's W4A8 routing (fp8 activations, per-token scales) on measured timings (no GPU).

    python scripts/int4_w4a8_rule.py bench/results/h200/int4/w4a8-gluon/int4.csv
    python scripts/int4_w4a8_rule.py bench/results/h200/int4/fp8-prefill/int4.csv

The CSV comes from ``scripts/int4_bench.py --w4a8-via-bf16 --w4a8-gluon --w4a8-fused``, whose
forced rows time each W4A8 path per weight and M: 'w4a8_fp8_kernel' (the decode kernel
converting the fp8 activations itself), 'w4a8_via_bf16' (cast to bf16, the W4A16 decode kernel),
'w4a8_gluon' / 'w4a8_gluon_channel' (the Gluon prefill kernel on cast activations, group /
per-channel scales), 'w4a8_fused' (its fp8 build, group scales) and 'w4a8_fp8_prefill' /
'w4a8_fp8_prefill_channel' (the int4 values as fp8, tileq's fp8 GEMM). For each problem it
names the path the current rules take (``launch.compute_type``, ``prefill.plan``,
``prefill.W4A8_MAX_M`` and ``fp8_prefill.fused_for``, the bench's activations being e4m3) and
prints per M and scale kind: how far that path is
from the fastest timed one (median / worst), and its speed against tileq's fp8 rowcol GEMM and
int8 rowcol of the same run. Problems where the chosen path was not timed count as 'untimed'.
"""

from __future__ import annotations

import collections
import csv
import statistics
import sys

SMS = 132
_PATHS = {"w4a8_fp8_kernel": ("group", "fp8_kernel"), "w4a8_via_bf16": ("group", "cast"),
          "w4a8_gluon": ("group", "gluon"), "w4a8_fused": ("group", "fused"), "w4a8_fp8_prefill": ("group", "fp8_gemm"),
          "w4a8_gluon_channel": ("vector", "gluon"), "w4a8_fp8_prefill_channel": ("vector", "fp8_gemm")}


def load(path):
    """{(shape, m, n, k): {(scale kind, path) or baseline: ms}}."""
    t = collections.defaultdict(dict)
    for r in csv.DictReader(open(path)):
        if not r["ms"] or not int(r["m"]):
            continue
        key = (r["shape"], int(r["m"]), int(r["n"]), int(r["k"]))
        if r["impl"] in _PATHS:
            t[key][_PATHS[r["impl"]]] = float(r["ms"])
        elif r["impl"] in ("fp8_rowcol", "int8_rowcol"):
            t[key][r["impl"]] = float(r["ms"])
    return t


def chosen(m: int, n: int, k: int, w_kind: str) -> str:
    """The W4A8 path linear_prepacked takes on an sm_90 GPU with SMS SMs."""
    from tileq.prepacked import prefill
    from tileq.prepacked.dequant import DEQUANT_MIN_M
    from tileq.prepacked.fp8_prefill import fused_for
    from tileq.prepacked.launch import compute_type

    plan = prefill.plan(m, n, k, SMS, x_scale=True)
    if plan is not None and fused_for(m, "fp8", w_kind, n, k):
        return "fused"
    if plan is not None and m < prefill.W4A8_MAX_M:
        return "gluon"
    if m >= DEQUANT_MIN_M:
        return "fp8_gemm"
    return "cast" if compute_type(m, n, k, "fp8") == "bf16" else "fp8_kernel"


def main() -> int:
    sys.path.insert(0, "src")
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    rows = collections.defaultdict(list)
    untimed = collections.Counter()
    for (shape, m, n, k), d in sorted(load(sys.argv[1]).items()):
        for w_kind in ("group", "vector"):
            timed = {p: ms for (kind, p), ms in ((key, v) for key, v in d.items() if isinstance(key, tuple))
                     if kind == w_kind}
            if not timed:
                continue
            path = chosen(m, n, k, w_kind)
            if path not in timed:
                untimed[(m, w_kind)] += 1
                continue
            now = timed[path]
            rows[(m, w_kind)].append((now / min(timed.values()), path,
                                      d["fp8_rowcol"] / now if "fp8_rowcol" in d else None,
                                      now / d["int8_rowcol"] if "int8_rowcol" in d else None))
    print(f"{'M':>5} {'scales':>7} {'n':>3} | {'chosen / fastest (median, worst)':>32} | {'fp8 rowcol / chosen':>19} | "
          f"{'chosen / int8':>13} | paths")
    med = statistics.median
    for (m, w_kind), v in sorted(rows.items()):
        off = [x[0] for x in v]
        f8 = [x[2] for x in v if x[2]]
        i8 = [x[3] for x in v if x[3]]
        paths = dict(collections.Counter(x[1] for x in v))
        print(f"{m:>5} {w_kind:>7} {len(v):>3} | {med(off):>23.3f} {max(off):>8.3f} | "
              f"{med(f8) if f8 else float('nan'):>19.3f} | {med(i8) if i8 else float('nan'):>13.3f} | {paths}")
    if untimed:
        print(f"- untimed (the chosen path not in the file): {dict(sorted(untimed.items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
