"""Replay tileq.prepacked's W4A16 routing below DEQUANT_MIN_M tokens (and its split over K above) on
measured timings (no GPU).

    python scripts/int4_small_m_rule.py bench/results/h200/int4/split-k/int4.csv
    python scripts/int4_small_m_rule.py bench/results/h200/int4/split-k/routed/int4.csv

The CSV comes from ``scripts/int4_bench.py --small-m-prefill [--prefill-split]``. Per weight and
M it collects every timed path: the decode kernel ('w4a16_decode', or the default row where that
ran the decode kernel), and each Gluon prefill kernel instance by its name (token tile, split),
from the forced rows and from the default row. For each problem it takes the time of what
``prefill.plan`` chooses now and of what the rule without the split chose (``prefers`` and
``tokens_for``: unsplit Gluon kernel or the decode kernel; from DEQUANT_MIN_M tokens the unsplit
kernel), and prints per M: the speed-up of the current choice over that one, how far it is from
the fastest timed path, and its speed against bf16 cuBLAS and tileq's int8 rowcol of the same
run. Problems where either choice was not timed stay out (counted as 'untimed').
"""

from __future__ import annotations

import collections
import csv
import statistics
import sys

SMS = 132


def load(path):
    """{(set, shape, m, n, k): {path: ms}}: 'decode', a Gluon instance's config tag, 'bf16', 'int8'."""
    t = collections.defaultdict(dict)
    for r in csv.DictReader(open(path)):
        if not r["ms"]:
            continue
        key = (r["set"], r["shape"], int(r["m"]), int(r["n"]), int(r["k"]))
        impl, cfg, ms = r["impl"], r["config"], float(r["ms"])
        if impl == "bf16_cublas":
            t[key]["bf16"] = ms
        elif impl == "int8_rowcol":
            t[key]["int8"] = ms
        elif impl == "w4a16_decode" or (impl == "w4a16_prepacked" and cfg.startswith("m64n")):
            t[key]["decode"] = ms
        elif impl.startswith("w4a16_") and "__gluon_" in cfg and impl != "w4a16_prepacked_channel":
            t[key][cfg.split("__")[-1].removesuffix("_sm90")] = ms
    return t


def main() -> int:
    sys.path.insert(0, "src")
    from tileq.prepacked import prefill
    from tileq.prepacked.dequant import DEQUANT_MIN_M

    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    by_m = collections.defaultdict(list)
    untimed = collections.Counter()
    worse = []
    for (s, shape, m, n, k), d in sorted(load(sys.argv[1]).items()):
        if m < prefill.MIN_M:
            continue
        now = prefill.plan(m, n, k, SMS)
        if m >= DEQUANT_MIN_M or prefill.prefers(m, n, SMS):
            before = prefill.config_tag(prefill.tokens_for(m, n, SMS))
        else:
            before = "decode"
        now = "decode" if now is None else prefill.config_tag(*now)
        paths = {p: v for p, v in d.items() if p not in ("bf16", "int8")}
        if now not in d or before not in d or "bf16" not in d or "int8" not in d:
            untimed[m] += 1
            continue
        best = min(paths.values())
        by_m[m].append((d[before] / d[now], d[now] / best, d["bf16"] / d[now], d[now] / d["int8"]))
        if d[before] / d[now] < 0.97:
            worse.append(f"{shape} M={m}: {now} {d[now] * 1e3:.1f} us against {before} {d[before] * 1e3:.1f} us")
    print(f"{'M':>4} {'n':>3} | {'speed-up over the rule without split':>36} | {'off fastest':>17} | "
          f"{'bf16 / now':>10} | {'now / int8':>10}")
    for m in sorted(by_m):
        v = by_m[m]
        col = lambda i: [x[i] for x in v]  # noqa: E731
        med = statistics.median
        print(f"{m:>4} {len(v):>3} | {med(col(0)):>18.3f} ({min(col(0)):.3f}-{max(col(0)):.3f}) | "
              f"{med(col(1)):>7.3f} / {max(col(1)):.3f} | {med(col(2)):>10.3f} | {med(col(3)):>10.3f}")
    for line in worse:
        print(f"- slower than before by more than 3%: {line}")
    if untimed:
        print(f"- untimed (a chosen path not in the file): {dict(sorted(untimed.items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
