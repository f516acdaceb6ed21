"""Writing a sweep to its folder (results.csv, env.json, report.md, PNGs) and the console table."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys

from . import results as R
from .harness import Sweep
from .report import case_stats, group_by_case, render


def write_outputs(sweep: Sweep, out_dir: str, *, title: str, command: str = "",
                  plots: bool = True) -> dict:
    """Write everything under ``out_dir``; returns {'csv', 'report', 'plots', 'plot_note'}."""
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "results.csv")
    R.write_csv(sweep.rows, csv_path)
    meta = {"title": title, "command": command, "env": sweep.env, "method": sweep.method,
            "operands": sweep.operands, "elapsed_s": round(sweep.elapsed_s, 1),
            "ceilings": dataclasses.asdict(sweep.ceilings) if sweep.ceilings else None}
    with open(os.path.join(out_dir, "env.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    return {"csv": csv_path, **_report_and_plots(sweep.rows, meta, sweep.ceilings, out_dir, plots)}


def _report_and_plots(rows, meta: dict, ceilings, out_dir: str, plots: bool) -> dict:
    names, note = [], "Plots not requested (--no-plots)."
    if plots:
        from .plots import write_plots

        names, note = write_plots(rows, out_dir, ceilings, meta["title"])
    if note:
        print(f"note: {note}", file=sys.stderr)
    text = render(rows, title=meta["title"], env=meta["env"], method=meta["method"],
                  operands=meta["operands"], ceilings=ceilings, command=meta["command"],
                  plots=names, plot_note=note)
    report_path = os.path.join(out_dir, "report.md")
    with open(report_path, "w", encoding="utf-8") as f:
        f.write(text)
    return {"report": report_path, "plots": names, "plot_note": note}


def render_folder(out_dir: str, *, plots: bool = True) -> dict:
    """Re-write report.md and plots from a run's results.csv and env.json (no GPU needed)."""
    from .timing import Ceilings

    rows = R.read_csv(os.path.join(out_dir, "results.csv"))
    with open(os.path.join(out_dir, "env.json"), encoding="utf-8") as f:
        meta = json.load(f)
    ceilings = Ceilings(**meta["ceilings"]) if meta.get("ceilings") else None
    return _report_and_plots(rows, meta, ceilings, out_dir, plots)


def console_summary(rows: list[R.Result]) -> str:
    """A short per-case table for the terminal."""
    timed = any(r.timed for r in rows)
    lines = []
    head = f"{'case':<32} {'shapes':>6} {'passed':>6} {'failed':>6}"
    head += f" {'speedup vs best baseline':>25} {'vs bf16':>8}" if timed else f" {'max rel err':>11}"
    lines.append(head)
    for case, shapes in group_by_case(rows).items():
        st = case_stats(shapes)
        passed = sum(st["statuses"][s] for s in R.PASSED)
        failed = st["statuses"][R.FAIL] + st["statuses"][R.ERROR]
        line = f"{case:<32} {st['shapes']:>6} {passed:>6} {failed:>6}"
        if timed:
            sp = f"{statistics.median(st['speedups']):.2f}x" if st["speedups"] else "-"
            bf = f"{statistics.median(st['vs_bf16']):.2f}x" if st["vs_bf16"] else "-"
            line += f" {sp:>25} {bf:>8}"
        else:
            err = f"{max(st['rel_errs']):.3g}" if st["rel_errs"] else "-"
            line += f" {err:>11}"
        lines.append(line)
    return "\n".join(lines)
