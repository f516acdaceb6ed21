"""PNG plots (matplotlib, optional): TFLOP/s and TB/s against M per case, tileq vs baselines.

Each implementation is a line through the median over the suite's shapes at each M, with the
min-max range shaded; the measured ceilings (the peak of the case's compute type, the device copy
bandwidth) are horizontal dashed lines. A last plot shows tileq's median speedup over the best
baseline against M, one line per case.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict

from . import results as R
from .report import best_baseline, group_by_case


def _compute_kind(case_name: str) -> str:
    from ..dtypes import OperandType, compute_type
    from .cases import parse_case

    c = parse_case(case_name)
    ct = compute_type(c.a, c.b)
    if ct is OperandType.I8:
        return "int8"
    if ct in (OperandType.BF16, OperandType.FP16):
        return "bf16"
    return "fp8"


def _series(rows: list[R.Result], attr: str):
    """impl -> sorted [(M, median, min, max)] over shapes."""
    by = defaultdict(lambda: defaultdict(list))
    for r in rows:
        v = getattr(r, attr)
        if r.timed and v is not None:
            by[r.impl][r.m].append(v)
    return {impl: sorted((m, statistics.median(v), min(v), max(v)) for m, v in ms.items())
            for impl, ms in by.items()}


def write_plots(rows: list[R.Result], out_dir: str, ceilings=None, title: str = "") -> tuple[list[str], str | None]:
    """(file names written under out_dir, a note when plots were skipped or limited)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed: plots skipped (pip install matplotlib)."
    if not any(r.timed for r in rows):
        return [], "No timed rows (timings need a GPU): plots skipped."
    written: list[str] = []
    by_case = group_by_case(rows)
    for case, shapes in by_case.items():
        case_rows = [r for impls in shapes.values() for r in impls.values()]
        if not any(r.timed for r in case_rows):
            continue
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        flops_unit = "TOP/s" if _compute_kind(case) == "int8" else "TFLOP/s"
        for ax, attr, unit in ((axes[0], "tflops", flops_unit), (axes[1], "tbps", "TB/s")):
            for impl, pts in _series(case_rows, attr).items():
                ms = [p[0] for p in pts]
                style = dict(lw=2.4, marker="o", zorder=3) if impl == "tileq" else dict(lw=1.3, marker=".")
                line, = ax.plot(ms, [p[1] for p in pts], label=impl, **style)
                if any(p[2] != p[3] for p in pts):
                    ax.fill_between(ms, [p[2] for p in pts], [p[3] for p in pts],
                                    color=line.get_color(), alpha=0.12)
            if ceilings is not None:
                if attr == "tflops":
                    kind = _compute_kind(case)
                    peak = ceilings.peak_for(kind)
                    if peak:
                        ax.axhline(peak, ls="--", color="gray", lw=1)
                        ax.annotate(f"{kind} peak (torch, measured) {peak:.0f}", (0.01, peak),
                                    xycoords=("axes fraction", "data"), va="bottom", fontsize=8,
                                    color="gray")
                elif ceilings.copy_tbps:
                    ax.axhline(ceilings.copy_tbps, ls="--", color="gray", lw=1)
                    ax.annotate(f"copy (measured) {ceilings.copy_tbps:.2f}", (0.01, ceilings.copy_tbps),
                                xycoords=("axes fraction", "data"), va="bottom", fontsize=8,
                                color="gray")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (tokens)")
            ax.set_ylabel(unit)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8, loc="best")
        fig.suptitle(f"{case}  {title}  (median over shapes at each M; range shaded)", fontsize=10)
        fig.tight_layout()
        name = case.replace(":", "_") + ".png"
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        written.append(name)
    name = _speedup_plot(plt, by_case, out_dir, title)
    if name:
        written.append(name)
    return written, None


def _speedup_plot(plt, by_case: dict, out_dir: str, title: str) -> str | None:
    fig, ax = plt.subplots(figsize=(8, 4.8))
    drew = False
    for case, shapes in by_case.items():
        per_m = defaultdict(list)
        for impls in shapes.values():
            t, b = impls.get("tileq"), best_baseline(impls)
            if t is not None and t.timed and b is not None:
                per_m[t.m].append(b.time_ms / t.time_ms)
        if per_m:
            ms = sorted(per_m)
            ax.plot(ms, [statistics.median(per_m[m]) for m in ms], marker="o", label=case)
            drew = True
    if not drew:
        plt.close(fig)
        return None
    ax.axhline(1.0, color="black", lw=1)
    ax.axhspan(1 / 1.15, 1 / 0.85, color="gray", alpha=0.15, label="within ±15%")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speedup vs best baseline (median over shapes)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title(f"tileq vs the best baseline  {title}", fontsize=10)
    fig.tight_layout()
    name = "speedup.png"
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    plt.close(fig)
    return name
