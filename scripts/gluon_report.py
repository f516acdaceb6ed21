"""Summarize scripts/gluon_bench.py CSVs: Gluon / baseline medians per shape set and M range.

    python3 scripts/gluon_report.py bench/results/h200/gluon/gluon.csv [more.csv ...] [--plot out.png]

Per problem the first Gluon row is the planner's config (gluon_bench writes it first); further
Gluon rows are forced --variants, summarized per config. An int8 CSV (gluon_bench --scheme int8)
also gets the Gluon kernel against torch._int_mm alone (its vs_int_mm column; the issue's target
is >= 1.3x). Shape sets: 'qwen3' (Qwen3-14B, which
the earlier tables were tuned on), 'llama3' (Llama-3-8B, where the wide-tile gain of
kernels/gluon/config.py was fitted), 'untuned' (every other (N, K): DeepSeek-V3 and
Mistral-Small-24B in the committed runs).
"""

from __future__ import annotations

import csv
import statistics
import sys

SETS = {(5120, 5120): "qwen3", (17408, 5120): "qwen3", (5120, 17408): "qwen3",
        (4096, 4096): "llama3", (14336, 4096): "llama3"}
RANGES = ((128, 512), (1024, 8192))


def _fmt(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f}, n={len(vals)})"


# Ratio columns of gluon_bench's CSV and what they are against (vs_int_mm: int8 CSVs only,
# absent from those written before it existed).
RATIOS = {"vs_cublaslt": "the scheme's torch baseline", "vs_int_mm": "torch._int_mm alone (target >= 1.3x)"}


def summarize(path: str) -> list[str]:
    all_rows = list(csv.DictReader(open(path)))
    out = []
    for column, against in RATIOS.items():
        rows = [r for r in all_rows if r["impl"] == "gluon" and r.get(column)]
        if rows:
            out += _summary(path, rows, column, against)
    return out


def _summary(path: str, rows: list[dict], column: str, against: str) -> list[str]:
    plan, by_config = {}, {}
    for r in rows:
        key = (int(r["m"]), int(r["n"]), int(r["k"]))
        ratio = float(r[column])
        if key not in plan:
            plan[key] = ratio
        else:
            by_config.setdefault(r["config"], {})[key] = ratio
    out = [f"## {path}: Gluon / {against}", "", "| set | M | planner's config: median (min-max, n) |",
           "|---|---|---|"]
    for name in ("qwen3", "llama3", "untuned", "all"):
        for lo, hi in RANGES:
            vals = [v for (m, n, k), v in plan.items() if lo <= m <= hi
                    and name in ("all", SETS.get((n, k), "untuned"))]
            out.append(f"| {name} | {lo}-{hi} | {_fmt(vals)} |")
    ms = sorted({m for m, _, _ in plan})
    out += ["", "| M | " + " | ".join(str(m) for m in ms) + " |", "|---" * (len(ms) + 1) + "|",
            "| median | " + " | ".join(f"{statistics.median([v for (mm, _, _), v in plan.items() if mm == m]):.3f}"
                                       for m in ms) + " |"]
    for config, vals in sorted(by_config.items()):
        out.append(f"\nforced {config}: M 128-512 {_fmt([v for (m, _, _), v in vals.items() if m <= 512])}; "
                   f"M >= 1024 {_fmt([v for (m, _, _), v in vals.items() if m >= 1024])}")
    return out + [""]


def plot(paths: list[str], out: str) -> None:
    """Gluon / baseline against M (log scale): the planner's config per (N, K) as points, the
    median per M as a line, one panel per CSV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paths), figsize=(5.5 * len(paths), 4), squeeze=False)
    for ax, path in zip(axes[0], paths):
        plan = {}
        for r in csv.DictReader(open(path)):
            if r["impl"] == "gluon" and r["vs_cublaslt"]:
                plan.setdefault((int(r["m"]), int(r["n"]), int(r["k"])), float(r["vs_cublaslt"]))
        ms = sorted({m for m, _, _ in plan})
        ax.scatter([m for m, _, _ in plan], list(plan.values()), s=10, alpha=0.5, label="one (N, K)")
        ax.plot(ms, [statistics.median([v for (mm, _, _), v in plan.items() if mm == m]) for m in ms],
                "o-", color="C1", label="median")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M")
        ax.set_ylabel("Gluon / baseline (speed)")
        ax.set_title(path.rsplit("/", 1)[-1])
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    args = sys.argv[1:]
    out = None
    if "--plot" in args:
        i = args.index("--plot")
        out = args[i + 1]
        del args[i:i + 2]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    for path in args:
        print("\n".join(summarize(path)) + "\n")
    if out:
        plot(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
