"""Write tileq.prepacked's tuned decode table from a config sweep of scripts/int4_bench.py (no GPU).

    python scripts/int4_tune_table.py bench/results/h200/int4/scale-ahead/int4.csv \
        --out src/tileq/int4p/data/tuned_sm90.json --date 2026-12-01 --env "..."

The table has two entries per weight: m = 1 serves M = 1, m = 16 serves M 2-16
(``int4p.launch.config_for``). For each, the swept config with the least total time over the
file's M values in that range (the minimum over rows of the same config per M; a config must have
been timed at every one of them) is written when it beats the heuristic's config
(``int4p.launch.decode_rule``) by more than --margin in the same run; otherwise the weight keeps
the heuristic. Prints what it chose and why.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import sys

IMPLS = ("w4a16_prepacked", "w4a16_prepacked_sweep")
RANGES = {1: (1, 1), 16: (2, 16)}  # table key -> the M values it serves


def load(path: str, sets: set[str]):
    """{(shape, n, k): {m: {config: ms}}} of the shapes in ``sets``"""
    t = collections.defaultdict(lambda: collections.defaultdict(dict))
    for r in csv.DictReader(open(path)):
        if not r["ms"] or r["impl"] not in IMPLS or not r["config"] or r["set"] not in sets:
            continue
        key = (r["shape"], int(r["n"]), int(r["k"]))
        by_cfg = t[key][int(r["m"])]
        by_cfg[r["config"]] = min(float(r["ms"]), by_cfg.get(r["config"], float("inf")))
    return t


def choose(per_m: dict, ms: list[int], heuristic: dict[int, str]):
    """(best config, its total ms, the heuristic's total ms) over the M values ``ms``."""
    common = set.intersection(*(set(per_m[m]) for m in ms))
    totals = {c: sum(per_m[m][c] for m in ms) for c in common}
    if not totals:
        return None
    best = min(totals, key=totals.get)
    heur = [heuristic[m] for m in ms]
    if any(h not in per_m[m] for h, m in zip(heur, ms)):
        return None
    return best, totals[best], sum(per_m[m][h] for h, m in zip(heur, ms))


def main() -> int:
    sys.path.insert(0, "src")
    from tileq.prepacked.launch import decode_rule

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--out", required=True)
    p.add_argument("--margin", type=float, default=0.03, help="the gain over the heuristic needed")
    p.add_argument("--date", required=True)
    p.add_argument("--env", required=True, help="GPU, driver, torch, Triton of the run")
    p.add_argument("--sets", default="llm", help="the bench's shape sets to tune (default llm: the "
                   "'untuned' and 'fresh' sets stay out of the table, to measure the heuristic on)")
    args = p.parse_args()

    entries = []
    for (shape, n, k), per_m in sorted(load(args.csv, set(args.sets.split(","))).items()):
        for key, (lo, hi) in RANGES.items():
            ms = sorted(m for m in per_m if lo <= m <= hi)
            if not ms:
                continue
            heuristic = {m: decode_rule(m, n, k)[0].tag for m in ms}
            got = choose(per_m, ms, heuristic)
            if got is None:
                print(f"{shape} m={key}: the heuristic's config or a common config was not timed; skipped")
                continue
            best, best_ms, heur_ms = got
            gain = heur_ms / best_ms
            keep = gain > 1 + args.margin
            print(f"{shape:<22} m={key:<2} (M {ms}) best {best} {best_ms * 1e3:.1f} us, heuristic "
                  f"{'/'.join(sorted(set(heuristic.values())))} {heur_ms * 1e3:.1f} us: "
                  f"{gain:.3f}x -> {'table' if keep else 'heuristic'}")
            if keep:
                entries.append(dict(n=n, k=k, m=key, config=best, us=round(best_ms * 1e3 / len(ms), 2),
                                    heuristic="/".join(sorted(set(heuristic.values()))),
                                    heuristic_us=round(heur_ms * 1e3 / len(ms), 2), shape=shape,
                                    measured_m=ms))
    about = (f"Prepacked-int4 (tileq.prepacked) decode configs measured on {args.env}, {args.date}, W4A16 group "
             f"128, bf16 activations, shape sets {args.sets}, by scripts/int4_bench.py ({args.csv}) and written by "
             f"scripts/int4_tune_table.py: per weight, for M = 1 and for M 2-16, the swept config with the "
             f"least total time over the M values measured in that range, where it beat the heuristic's "
             f"(int4p.launch.decode_rule) by more than {args.margin:.0%} in the same run ('us': mean per M). "
             f"Entry m=1 serves M = 1, m=16 serves M 2-16; other sizes use the heuristic. Used for bf16 and "
             f"fp16 activations only (tileq.prepacked.launch.config_for).")
    with open(args.out, "w") as f:
        json.dump(dict(about=about, arch="sm_90", entries=entries), f, indent=1)
        f.write("\n")
    print(f"{len(entries)} entries -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
