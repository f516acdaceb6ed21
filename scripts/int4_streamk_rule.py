"""Replay tileq.prepacked's stream-K choice (``prefill.streamk_for``) on measured timings (no GPU).

    python scripts/int4_streamk_rule.py bench/results/h200/int4/streamk-hybrid/int4.csv

The CSV comes from ``scripts/int4_bench.py --streamk``: beside the default path
('w4a16_prepacked', 'w4a16_prepacked_channel') it times the Gluon prefill kernel with stream-K
forced, 128- and 256-token tiles ('w4a16_streamk[_channel]_t128' / '_t256'), and where the
default took stream-K the plan's tiling without it ('w4a16_plan[_channel]'), which then stands
for the plan. Where the plan's path was the Gluon kernel, the script takes the path the current
rule picks (the plan's tiling, or stream-K with the rule's token tile) and prints per M and
scale kind: its time against the plan's (median, range, how many calls it changes) and against
the fastest timed.
"""

from __future__ import annotations

import collections
import csv
import re
import statistics
import sys

SMS = 132


def main() -> int:
    from tileq.prepacked import prefill

    t = collections.defaultdict(dict)
    cfg = {}
    for r in csv.DictReader(open(sys.argv[1])):
        if r["ms"] and int(r["m"]):
            key = (r["shape"], int(r["m"]), int(r["n"]), int(r["k"]))
            t[key][r["impl"]] = float(r["ms"])
            cfg[key + (r["impl"],)] = r["config"]
    out = collections.defaultdict(lambda: ([], [], 0))
    for (shape, m, n, k), d in sorted(t.items()):
        for kind, base, prefix, plan_impl in (
                ("group", "w4a16_prepacked", "w4a16_streamk_t", "w4a16_plan"),
                ("vector", "w4a16_prepacked_channel", "w4a16_streamk_channel_t", "w4a16_plan_channel")):
            if plan_impl in d:  # (the default ran stream-K: the plan's tiling was timed apart)
                base = plan_impl
            config = cfg.get((shape, m, n, k, base), "")
            if base not in d or "__gluon_" not in config or "_stk_" in config:
                continue
            tokens = int(re.search(r"_w128t(\d+)k512", config).group(1))
            split = int(re.search(r"_sk(\d+)", config).group(1)) if "_sk" in config else 1
            t_sk, on = prefill.streamk_for(m, n, k, tokens, split, SMS)
            chosen = d.get(f"{prefix}{t_sk}") if on else d[base]
            if chosen is None:
                continue
            timed = [d[base]] + [d[i] for i in (f"{prefix}128", f"{prefix}256") if i in d]
            vs_default, vs_best, changed = out[(m, kind)]
            vs_default.append(d[base] / chosen)
            vs_best.append(min(timed) / chosen)
            out[(m, kind)] = (vs_default, vs_best, changed + on)
    print("    M  scales | default / chosen (median, min, max) | fastest / chosen (median, min) | stream-K")
    for (m, kind), (vd, vb, changed) in sorted(out.items()):
        print(f"{m:5d} {kind:>7s} | {statistics.median(vd):.3f} {min(vd):.3f} {max(vd):.3f}"
              f"                 | {statistics.median(vb):.3f} {min(vb):.3f}"
              f"                  | {changed} of {len(vd)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
