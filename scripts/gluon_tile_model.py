#!/usr/bin/env python3
"""Check the Gluon kernel's wave model (``kernels/gluon/config.py``) against measured tilings.

Reads ``gluon_bench.py --variants plan,128:6,128:6:1:0:a,64:8,64:8:1:0:a,256:4:1:1`` CSVs (one per
scheme; the variants' rows in that order per problem, then the baseline) and prints, per problem,
the tiling the model picks (``tile_costs``, as ``choose_tiles`` does), the fastest measured one,
the chosen one's speed as a fraction of the fastest, and both against the baseline; then the
summary per scheme and M range. No GPU needed.

    python3 scripts/gluon_tile_model.py bench/results/h200/gluon/tiles/{rowcol,abquant,int8}.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tileq.catalog.families import family_spec  # noqa: E402
from tileq.catalog.names import parse_family  # noqa: E402
from tileq.kernels.gluon.config import tile_costs  # noqa: E402

# The --variants order of the CSVs, as tile_costs names the tilings; the planner's own row and
# the split 128 x 64 row are not candidates of the model.
VARIANTS = ["plan", "128", "128+split", "64", "64+split", "256"]
FAMILIES = {"rowcol": "rowcol_fp8xfp8_rcr_prefill", "abquant": "abquant_fp8xfp8_rcr_prefill",
            "int8": "rowcol_i8xi8_rcr_prefill"}


def load(path: Path) -> OrderedDict:
    """{(m, n, k): {"ms": {variant: ms}, "base": baseline ms}}"""
    by: OrderedDict = OrderedDict()
    for row in csv.DictReader(path.open()):
        key = (int(row["m"]), int(row["n"]), int(row["k"]))
        entry = by.setdefault(key, {"ms": {}, "base": None})
        if row["impl"] == "gluon":
            entry["ms"][VARIANTS[len(entry["ms"])]] = float(row["ms"])
        else:
            entry["base"] = float(row["ms"])
    return by


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", nargs="+", type=Path, help="rowcol.csv, abquant.csv, int8.csv (scheme from the name)")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--quiet", action="store_true", help="summaries only")
    args = p.parse_args()
    for path in args.csv:
        scheme = path.stem
        family = parse_family(FAMILIES[scheme])
        fractions, chosen_vs_base, best_vs_base = [], {}, {}
        if not args.quiet:
            print(f"\n{scheme}: chosen (model) / best (measured); speed vs the baseline")
        for (m, n, k), entry in load(path).items():
            spec = replace(family_spec(family, m, n, k))
            costs = tile_costs(spec, args.sms)
            chosen = min(costs, key=lambda key: costs[key][0])
            ms = {v: t for v, t in entry["ms"].items() if v in costs}
            best = min(ms, key=ms.get)
            frac = ms[best] / ms[chosen]
            fractions.append(frac)
            band = "128-512" if m <= 512 else "1024+"
            chosen_vs_base.setdefault(band, []).append(entry["base"] / ms[chosen])
            best_vs_base.setdefault(band, []).append(entry["base"] / ms[best])
            if not args.quiet:
                print(f"  {m:5d} {n:6d} {k:6d}  {chosen:10s} {best:10s} {frac:6.3f}   "
                      f"{entry['base'] / ms[chosen]:.3f} / {entry['base'] / ms[best]:.3f}")
        print(f"{scheme}: the chosen tiling at {statistics.mean(fractions):.3f} of the best's speed on average, "
              f"{min(fractions):.3f} at worst, under 0.97 on {sum(f < 0.97 for f in fractions)} of {len(fractions)}")
        for band in chosen_vs_base:
            print(f"  M {band}: median vs the baseline {statistics.median(chosen_vs_base[band]):.3f} "
                  f"(best measured tiling {statistics.median(best_vs_base[band]):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
