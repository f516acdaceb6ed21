"""tileq.prepacked's decode config rule against a config sweep from scripts/int4_bench.py (no GPU).

    python scripts/int4_decode_rule.py bench/results/h200/int4/int4.csv
    python scripts/int4_decode_rule.py bench/results/h200/int4/int4_sweep_m1-64.csv --large-m

Per (weight, M) with a swept config set: the previous rule's config (16-token tiles, three
stages, K split until the programs cover the SMs 1.5 times), the current rule's
(``int4p.launch.decode_rule``), the fastest measured config, their times, and the current rule's
gain over the previous one; then the medians, per weight set, and, at the same split, how two
stages and the 128-register cap compare with three stages by how many programs each SM must hold
(the occupancy bands the rule is built on). Times are the minimum over rows of the same config
in the file. A problem whose rule config was not measured shows '-' and stays out of the medians.

``--large-m``: the same for M > 16 (32-token tiles; the split rule, the fastest 32-token and
16-token configs, and the split that runs the programs in one wave at two per SM).
``--w4a8``: the W4A8 rows (fp8 activations, 'w4a8_prepacked' / '_sweep', ``int4_bench.py
--sweep-w4a8``) against the rule's fp8 branch; the previous rule is the same three-stage one.
``--sweep-only``: ignore the 'w4a16_prepacked' rows (in CSVs written before the bench labelled
them with the config that ran, e.g. int4_sweep_maxnreg168.csv, they ran the tuned table's).
"""

from __future__ import annotations

import argparse
import collections
import csv
import statistics
import sys

SMS = 132


def load(path, sweep_only, kind="w4a16"):
    from tileq.prepacked.launch import Int4pConfig

    t = collections.defaultdict(dict)
    meta = {}
    for r in csv.DictReader(open(path)):
        if not r["ms"] or r["impl"] not in (f"{kind}_prepacked", f"{kind}_prepacked_sweep"):
            continue
        if sweep_only and r["impl"] == f"{kind}_prepacked":
            continue
        try:
            cfg = Int4pConfig.parse_tag(r["config"])
        except ValueError:
            continue  # a prefill path's name
        key = (r["shape"], int(r["m"]))
        meta[key] = (r["set"], int(r["n"]), int(r["k"]))
        t[key][cfg] = min(t[key].get(cfg, 1e18), float(r["ms"]) * 1000)
    return t, meta


def previous_rule(m, n, k, num_sms=SMS):
    """The rule before the occupancy bands: three stages at every M <= 16."""
    from tileq.prepacked.launch import Int4pConfig

    tiles, ktiles, split = -(-n // 64), -(-k // 512), 1
    while 2 * tiles * split < 3 * num_sms and ktiles >= 4 * split:
        split *= 2
    return Int4pConfig(16, split, 3)


def short(cfg):
    return f"s{cfg.stages} sk{cfg.split_k}" + (f" r{cfg.maxnreg}" if cfg.maxnreg else "") \
        + ("" if cfg.bm == 16 else f" n{cfg.bm}")


def fmt(x, spec="6.1f"):
    return "-" if x is None else format(x, spec)


def small_m(t, meta, x_type="bf16"):
    from tileq.prepacked.launch import Int4pConfig, decode_rule

    rows = []
    for (shape, m), times in sorted(t.items(), key=lambda kv: (kv[0][1], meta[kv[0]][1] * meta[kv[0]][2])):
        if m > 16 or len(times) < 4:
            continue
        s, n, k = meta[(shape, m)]
        rule, _ = decode_rule(m, n, k, x_type)
        prev = previous_rule(m, n, k)
        best = min(times, key=times.get)
        rows.append((s, shape, m, n, k, prev, rule, best, times.get(prev), times.get(rule), times[best]))
    print("| weight | set | M | N x K | programs | previous | rule | fastest | previous us | rule us "
          "| fastest us | rule / fastest | previous / rule |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s, shape, m, n, k, prev, rule, best, tp, tr, tb in rows:
        gain = tp / tr if tp and tr else None
        print(f"| {shape} | {s} | {m} | {n} x {k} | {-(-n // 64) * rule.split_k} | {short(prev)} | {short(rule)} "
              f"| {short(best)} | {fmt(tp)} | {fmt(tr)} | {fmt(tb)} | {fmt(tr / tb if tr else None, '.3f')} "
              f"| {fmt(gain, '.3f')} |")
    print()
    for label, sel in (("all", lambda r: True), ("M = 1", lambda r: r[2] == 1), ("M > 1", lambda r: r[2] > 1),
                       ("set llm", lambda r: r[0] == "llm"), ("set untuned", lambda r: r[0] == "untuned"),
                       ("set fresh", lambda r: r[0] == "fresh")):
        g = [r[8] / r[9] for r in rows if sel(r) and r[8] and r[9]]
        off = [r[9] / r[10] for r in rows if sel(r) and r[9]]
        if not g:
            continue
        print(f"- {label}: previous / rule median {statistics.median(g):.3f} (min {min(g):.3f}, max {max(g):.3f}, "
              f"{len(g)} problems); rule within 1% of the fastest on {sum(x <= 1.01 for x in off)} of {len(off)}, "
              f"at most {max(off):.3f}x")
    missing = [f"{r[1]} M={r[2]} {r[6].tag}" for r in rows if r[9] is None]
    if missing:
        print(f"- rule config not measured: {', '.join(missing)}")

    # Same split: two stages and the cap against three stages, by programs per SM.
    bands = collections.defaultdict(lambda: collections.defaultdict(list))
    for (shape, m), times in t.items():
        if m > 16:
            continue
        s, n, k = meta[(shape, m)]
        for split in (1, 2, 4, 8, 16):
            s3 = times.get(Int4pConfig(16, split, 3))
            s2 = times.get(Int4pConfig(16, split, 2))
            cap = times.get(Int4pConfig(16, split, 2, 4, 128))
            p = -(-n // 64) * split
            band = next((f"<= {b} x SMs" for b in (2, 3, 4) if p <= b * SMS), "> 4 x SMs")
            mk = "M = 1" if m == 1 else "M > 1"
            for name, a, b in (("s2 / s3", s2, s3), ("cap / s2", cap, s2), ("cap / s3", cap, s3)):
                if a and b:
                    bands[(mk, band, split > 1)][name].append(a / b)
    print()
    print("| M | programs | split-K | s2 / s3 | cap / s2 | cap / s3 |")
    print("|---|---|---|---|---|---|")
    for key in sorted(bands):
        d = bands[key]

        def cell(name):
            v = d.get(name)
            return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}, {len(v)})" if v else "-"
        print(f"| {key[0]} | {key[1]} | {'> 1' if key[2] else '1'} | {cell('s2 / s3')} | {cell('cap / s2')} "
              f"| {cell('cap / s3')} |")
    print("\n(time ratios at the same split: median (min-max, pairs); below 1 the first is faster)")


def large_m(t, meta):
    from tileq.prepacked.launch import Int4pConfig, decode_rule

    print("| weight | set | M | N x K | rule | rule us | fastest n32 | us | fastest n16 | us | one wave | us "
          "| rule / fastest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    gains = []
    for (shape, m), times in sorted(t.items(), key=lambda kv: (kv[0][1], meta[kv[0]][1] * meta[kv[0]][2])):
        if m <= 16 or len(times) < 3:
            continue
        s, n, k = meta[(shape, m)]
        rule, _ = decode_rule(m, n, k)
        tiles, ktiles, split = -(-n // 64) * -(-m // 32), -(-k // 512), 1
        while 2 * tiles * split <= 2 * SMS and ktiles >= 4 * split:
            split *= 2
        wave = Int4pConfig(32, split, 2)
        b32 = min((c for c in times if c.bm == 32), key=times.get, default=None)
        b16 = min((c for c in times if c.bm == 16), key=times.get, default=None)
        tr, tw = times.get(rule), times.get(wave)
        best = min(times.values())
        if tr and tw:
            gains.append(tr / tw)
        print(f"| {shape} | {s} | {m} | {n} x {k} | {short(rule)} | {fmt(tr)} | {short(b32) if b32 else '-'} "
              f"| {fmt(times.get(b32))} | {short(b16) if b16 else '-'} | {fmt(times.get(b16))} | {short(wave)} "
              f"| {fmt(tw)} | {fmt(tr / best if tr else None, '.3f')} |")
    if gains:
        print(f"\n- one-wave split (largest with 32-token programs <= 2 x SMs) against the rule: median "
              f"{statistics.median(gains):.3f}x faster (min {min(gains):.3f}, max {max(gains):.3f}, {len(gains)})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--large-m", action="store_true", help="M > 16 (32-token tiles) instead of M <= 16")
    p.add_argument("--sweep-only", action="store_true", help="ignore the default-config rows")
    p.add_argument("--w4a8", action="store_true", help="the W4A8 rows and the rule's fp8 branch (M <= 16)")
    args = p.parse_args()
    t, meta = load(args.csv, args.sweep_only, "w4a8" if args.w4a8 else "w4a16")
    if args.w4a8 and args.large_m:
        p.error("--w4a8 replays the decode rule at M <= 16 only")
    if args.w4a8:
        small_m(t, meta, "fp8")
    else:
        (large_m if args.large_m else small_m)(t, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
