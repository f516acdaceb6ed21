"""The markdown report: per case, tileq against the best applicable baseline.

"Best baseline" of a shape: the fastest fused / unfused / peer implementation of the same
quantized product that passed the gate (bf16 torch.matmul, the unquantized model, is reported
beside it). A speedup is baseline time / tileq time from the same run (> 1: tileq is faster);
"within ±15%" means tileq's time is 0.85x to 1.15x the baseline's.

Timed runs also get the medians per M range and model (the shape name's part before its first
'.'), against the best baseline and, for int8, against torch._int_mm alone; and, with tileq
forced onto one kernel or tiling (``--impls``, ``--gluon-tilings``, ``--int4-variants``), each
such variant against the plan's choice and the best baseline; with prepacked int4 cases (B ``i4p``),
their times against tileq's int8 and fp8 rowcol on the same shapes and bf16 cuBLAS.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from . import results as R
from .baselines import SAME_MATH_KINDS
from .gate import REL_TOL

WITHIN = 0.15
MAX_FAILURES_LISTED = 50
M_EDGES = (64, 512)  # M ranges of the per-range tables: <= 64 (decode), 65-512, > 512
VARIANT_KIND = "variant"  # variants.KIND (tileq forced onto one kernel or tiling)
RAW = "torch_int_mm"  # torch._int_mm alone (kind 'raw')
BF16 = "torch_bf16_matmul"
INT4_PEERS = (("rowcol:i8xi8:rcr", "tileq int8 rowcol"), ("rowcol:fp8xfp8:rcr", "tileq fp8 rowcol"))


def _fmt(v, spec=".3g", none="–") -> str:
    if v is None:
        return none
    return format(v, spec)


def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _pct(part: int, whole: int) -> str:
    return "–" if not whole else f"{part / whole:.0%}"


def group_by_case(rows: list[R.Result]) -> dict:
    """case -> shape key -> {impl: row}, in first-seen order."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        out[r.case][(r.suite, r.shape, r.m, r.n, r.k)][r.impl] = r
    return out


def best_baseline(impls: dict) -> R.Result | None:
    timed = [r for r in impls.values() if r.kind in SAME_MATH_KINDS and r.timed]
    return min(timed, key=lambda r: r.time_ms) if timed else None


def case_stats(shapes: dict) -> dict:
    speedups, vs_bf16, worst, best_names = [], [], [], Counter()
    statuses = Counter()
    rel_errs, sqnrs = [], []
    no_baseline = 0
    for key, impls in shapes.items():
        t = impls.get("tileq")
        if t is None:
            continue
        statuses[t.status] += 1
        if t.rel_err is not None and t.passed:
            rel_errs.append(t.rel_err)
        if t.sqnr_db is not None:
            sqnrs.append(t.sqnr_db)
        if not t.timed:
            continue
        b = best_baseline(impls)
        if b is None:
            no_baseline += 1
        else:
            s = b.time_ms / t.time_ms
            speedups.append(s)
            best_names[b.impl] += 1
            worst.append((s, key, t, b))
        bf = impls.get("torch_bf16_matmul")
        if bf is not None and bf.timed:
            vs_bf16.append(bf.time_ms / t.time_ms)
    within = sum(1 for s in speedups if 1 / (1 + WITHIN) <= s <= 1 / (1 - WITHIN))
    faster = sum(1 for s in speedups if s > 1 / (1 - WITHIN))
    slower = sum(1 for s in speedups if s < 1 / (1 + WITHIN))
    worst.sort(key=lambda w: w[0])
    return dict(
        shapes=sum(statuses.values()), statuses=statuses, speedups=speedups, vs_bf16=vs_bf16,
        within=within, faster=faster, slower=slower, no_baseline=no_baseline, worst=worst,
        best_names=best_names, rel_errs=rel_errs, sqnrs=sqnrs,
    )


def _coverage(shapes: dict) -> dict:
    """baseline -> Counter of (status, note) over the case's shapes (tileq excluded)."""
    cov: dict = defaultdict(Counter)
    for impls in shapes.values():
        for name, r in impls.items():
            if name == "tileq":
                continue
            if r.passed:
                what = "applies"
            elif r.status == R.NA:
                what = r.note
            else:  # each failure is listed under "Failures and errors"
                what = f"{r.status} (see Failures and errors)"
            cov[name][what] += 1
    return cov


def render(rows: list[R.Result], *, title: str, env: dict, method: str, operands: str,
           ceilings=None, command: str = "", plots: list[str] | None = None,
           plot_note: str | None = None) -> str:
    timed_any = any(r.timed for r in rows)
    by_case = group_by_case(rows)
    out = [f"# {title}", ""]
    if command:
        out += [f"Command: `{command}`", ""]
    out += ["## Environment", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in env.items()]
    if ceilings is not None:
        if ceilings.copy_tbps:
            out.append(f"| measured copy bandwidth | {ceilings.copy_tbps:.2f} TB/s (read + write) |")
        for name, v in ceilings.peak_tflops.items():
            unit = "TOP/s" if name == "int8" else "TFLOP/s"
            out.append(f"| measured {name} peak (torch, 8192³) | {v:.0f} {unit} |")
        for note in ceilings.notes:
            out.append(f"| ceiling note | {note} |")
    out += ["", "## Method", "",
            f"- Operands: {operands}.",
            f"- Correctness gate before any timing: max |out − expected| / max|expected| < {REL_TOL:g}, "
            "as many non-zero outputs as expected, no NaN/inf; tileq writes into a NaN-poisoned "
            "`out=`. Expected = tileq's reference on the same quantized operands (bf16 matmul: the "
            "fp32 product of the same bf16 operands; `torch_int_mm`: the exact integer product).",
            f"- Timing: {method}.",
            "- tileq and every baseline run back to back shape by shape (interleaved). Ratios come "
            "from this run only; do not compare absolute times across runs.",
            "- Bytes counted: A + B + scales + C, each once. SQNR: against the fp32 product of the "
            "unquantized bf16 X and W.",
            ""]
    if not timed_any:
        out += ["**Timings need a GPU: this run checked correctness only (not measured).**", ""]
    out += _summary(by_case, timed_any)
    out += _dispatcher_check(by_case)
    if timed_any:
        out += _by_range(by_case)
        out += _int4(by_case)
        out += _variants(by_case)
    for case, shapes in by_case.items():
        out += _case_section(case, shapes, timed_any)
    failures = [r for r in rows if r.status in (R.FAIL, R.ERROR)]
    if failures:
        out += ["## Failures and errors", "", "| shape | case | impl | status | error | note |",
                "|---|---|---|---|---|---|"]
        for r in failures[:MAX_FAILURES_LISTED]:
            out.append(f"| {r.shape} M={r.m} N={r.n} K={r.k} | {r.case} | {r.impl} | {r.status} "
                       f"| {_fmt(r.rel_err)} | {r.note} |")
        if len(failures) > MAX_FAILURES_LISTED:
            out.append(f"\n{len(failures) - MAX_FAILURES_LISTED} more in results.csv.")
        out.append("")
    if plots or plot_note:
        out += ["## Plots", ""]
        if plot_note:
            out += [plot_note, ""]
        out += [f"![{p}]({p})" for p in plots or []]
        out.append("")
    return "\n".join(out)


def _dispatcher_check(by_case: dict) -> list[str]:
    """M <= 64: the dispatcher's choice (tileq) against the prefill pipeline forced."""
    lines = []
    for case, shapes in by_case.items():
        ratios = []
        for key, impls in shapes.items():
            t, p = impls.get("tileq"), impls.get("tileq_prefill")
            if t is not None and p is not None and t.timed and p.timed:
                ratios.append((p.time_ms / t.time_ms, key))
        if ratios:
            slower = [(r, k) for r, k in ratios if r < 1.0]
            worst = min(ratios)
            lines.append(f"| {case} | {len(ratios)} | {len(slower)} | {_x(worst[0])} at M={worst[1][2]} "
                         f"N={worst[1][3]} K={worst[1][4]} |")
    if not lines:
        return []
    return ["## Dispatcher check (M ≤ 64)", "",
            "Prefill pipeline forced / the dispatcher's choice, same run (> 1: the choice is faster).",
            "", "| case | shapes | choice slower than prefill | worst |", "|---|---|---|---|",
            *lines, ""]


def m_range(m: int, edges=M_EDGES) -> str:
    """The M range label of ``m`` ('1-64', '65-512', '> 512' for the default edges)."""
    lo = 1
    for edge in edges:
        if m <= edge:
            return f"{lo}-{edge}"
        lo = edge + 1
    return f"> {edges[-1]}" if edges else "all"


def _model(shape: str) -> str:
    return shape.split(".", 1)[0]


def _spread(vals: list[float], full: bool = True) -> str:
    if not vals:
        return "–"
    med = statistics.median(vals)
    if not full:
        return f"{_x(med)} (n={len(vals)})"
    return f"{_x(med)} ({min(vals):.2f}–{max(vals):.2f}, n={len(vals)})"


def _range_table(title: str, note: str, ratios: dict) -> list[str]:
    """ratios: case -> [(m range, model, ratio)]; one row per (case, M range), the medians over
    all shapes and per model."""
    models = list(dict.fromkeys(model for vals in ratios.values() for _, model, _ in vals))
    if not ratios:
        return []
    out = [f"## {title}", "", note, "",
           "| case | M | all shapes | " + " | ".join(models) + " |",
           "|---|---|---|" + "---|" * len(models)]
    for case, vals in ratios.items():
        for rng in dict.fromkeys(r for r, _, _ in sorted(vals, key=lambda v: _range_order(v[0]))):
            here = [(model, v) for r, model, v in vals if r == rng]
            cells = [_spread([v for mo, v in here if mo == model], full=False) for model in models]
            out.append(f"| {case} | {rng} | {_spread([v for _, v in here])} | " + " | ".join(cells) + " |")
    return out + [""]


def _range_order(label: str) -> int:
    return 1 << 62 if label.startswith(">") else int(label.split("-")[0])


def _by_range(by_case: dict) -> list[str]:
    """tileq against the best baseline, and int8 against torch._int_mm alone, per M range and model."""
    vs_best, vs_raw = {}, {}
    for case, shapes in by_case.items():
        for key, impls in shapes.items():
            t = impls.get("tileq")
            if t is None or not t.timed:
                continue
            where = (m_range(key[2]), _model(key[1]))
            b = best_baseline(impls)
            if b is not None:
                vs_best.setdefault(case, []).append((*where, b.time_ms / t.time_ms))
            raw = impls.get(RAW)
            if raw is not None and raw.timed:
                vs_raw.setdefault(case, []).append((*where, raw.time_ms / t.time_ms))
    out = _range_table("By M range and model: tileq vs the best baseline",
                       "Speedup (best baseline time / tileq time): median (min–max, shapes) over all "
                       "shapes, median (shapes) per model (the shape name up to its first '.').", vs_best)
    out += _range_table("By M range and model: tileq vs torch._int_mm alone",
                        "int8: torch._int_mm's time (the int32 product alone, no scales: a lower bound "
                        "of any unfused int8 GEMM) / tileq's, as above.", vs_raw)
    return out


def _int4(by_case: dict) -> list[str]:
    """Prepacked int4 cases (B 'i4p'): tileq's int8 and fp8 rowcol on the same shapes of the run, and
    bf16 cuBLAS, against the int4 time, per M range and model."""
    ratios: dict = {label: {} for _, label in INT4_PEERS}
    ratios["bf16 cuBLAS"] = {}
    for case, shapes in by_case.items():
        if ":" not in case or not case.split(":")[1].endswith("xi4p"):
            continue
        for key, impls in shapes.items():
            t = impls.get("tileq")
            if t is None or not t.timed:
                continue
            where = (m_range(key[2]), _model(key[1]))
            peers = [(label, by_case.get(peer, {}).get(key, {}).get("tileq")) for peer, label in INT4_PEERS]
            for label, r in peers + [("bf16 cuBLAS", impls.get(BF16))]:
                if r is not None and r.timed:
                    ratios[label].setdefault(case, []).append((*where, r.time_ms / t.time_ms))
    out = []
    for label, vals in ratios.items():
        out += _range_table(f"Prepacked int4 against {label}",
                            f"{label}'s time / the prepacked int4 time on the same shape in this run (> 1: int4 "
                            "is faster); median (min–max, shapes), median (shapes) per model.", vals)
    return out


def _variants(by_case: dict) -> list[str]:
    """Each forced variant (kind 'variant') against tileq (the plan's choice) and the best baseline."""
    lines = []
    for case, shapes in by_case.items():
        acc: dict = {}  # (m range, variant) -> ([vs plan], [vs best baseline])
        for key, impls in shapes.items():
            t = impls.get("tileq")
            b = best_baseline(impls)
            for name, r in impls.items():
                if r.kind != VARIANT_KIND or not r.timed:
                    continue
                vs_plan, vs_best = acc.setdefault((m_range(key[2]), name), ([], []))
                if t is not None and t.timed:
                    vs_plan.append(t.time_ms / r.time_ms)
                if b is not None:
                    vs_best.append(b.time_ms / r.time_ms)
        for (rng, name), (vs_plan, vs_best) in sorted(acc.items(), key=lambda kv: _range_order(kv[0][0])):
            lines.append(f"| {case} | {rng} | {name} | {max(len(vs_plan), len(vs_best))} | "
                         f"{_spread(vs_plan)} | {_spread(vs_best)} |")
    if not lines:
        return []
    return ["## tileq forced onto one kernel or tiling", "",
            "`--impls` / `--gluon-tilings` / `--int4-variants` rows: tileq (the plan's choice) time / the "
            "variant's (> 1: the forced variant is faster than what the plan runs), and the best baseline's "
            "time / the variant's; median (min–max, shapes). `tileq replay --rule gluon-tiles` checks the "
            "wave model's choice of tiling on these rows, `--rule int4-*` the int4 rules.", "",
            "| case | M | variant | shapes | vs tileq (the plan) | vs best baseline |",
            "|---|---|---|---|---|---|", *lines, ""]


def _summary(by_case: dict, timed_any: bool) -> list[str]:
    out = ["## Summary", ""]
    if timed_any:
        out += ["| case | shapes | tileq passed | median speedup vs best baseline | within ±15% | "
                "faster | slower | no baseline | median speedup vs bf16 matmul |",
                "|---|---|---|---|---|---|---|---|---|"]
    else:
        out += ["| case | shapes | tileq passed | failed | N/A | max rel. error | median SQNR (dB) |",
                "|---|---|---|---|---|---|---|"]
    for case, shapes in by_case.items():
        st = case_stats(shapes)
        passed = sum(st["statuses"][s] for s in R.PASSED)
        n = len(st["speedups"])
        if timed_any:
            out.append(
                f"| {case} | {st['shapes']} | {passed} | "
                f"{_x(statistics.median(st['speedups']) if n else None)} | "
                f"{_pct(st['within'], n)} | {_pct(st['faster'], n)} | {_pct(st['slower'], n)} | "
                f"{st['no_baseline']} | {_x(statistics.median(st['vs_bf16']) if st['vs_bf16'] else None)} |"
            )
        else:
            failed = st["statuses"][R.FAIL] + st["statuses"][R.ERROR]
            out.append(
                f"| {case} | {st['shapes']} | {passed} | {failed} | "
                f"{st['statuses'][R.NA]} | {_fmt(max(st['rel_errs']) if st['rel_errs'] else None)} | "
                f"{_fmt(statistics.median(st['sqnrs']) if st['sqnrs'] else None, '.1f')} |"
            )
    out.append("")
    return out


def _case_section(case: str, shapes: dict, timed_any: bool, worst_n: int = 5) -> list[str]:
    st = case_stats(shapes)
    out = [f"## {case}", ""]
    statuses = ", ".join(f"{k}: {v}" for k, v in st["statuses"].most_common())
    out.append(f"- tileq over {st['shapes']} shapes: {statuses}.")
    if st["rel_errs"]:
        out.append(f"- max relative error vs the reference: {max(st['rel_errs']):.3g}; "
                   f"SQNR vs the bf16 product: median {statistics.median(st['sqnrs']):.1f} dB, "
                   f"min {min(st['sqnrs']):.1f} dB." if st["sqnrs"] else
                   f"- max relative error vs the reference: {max(st['rel_errs']):.3g}.")
    if timed_any and st["speedups"]:
        n = len(st["speedups"])
        best = ", ".join(f"{k} ({v})" for k, v in st["best_names"].most_common())
        out.append(f"- speedup vs the best baseline: median {_x(statistics.median(st['speedups']))}, "
                   f"range {_x(min(st['speedups']))} to {_x(max(st['speedups']))}; within ±15%: "
                   f"{_pct(st['within'], n)}, faster: {_pct(st['faster'], n)}, slower: "
                   f"{_pct(st['slower'], n)} of {n} shapes. Best baseline: {best}.")
    if timed_any and st["no_baseline"]:
        out.append(f"- {st['no_baseline']} timed shapes have no applicable same-math baseline.")
    out += ["", "Baseline coverage (shapes):", "", "| baseline | shapes | status / reason |",
            "|---|---|---|"]
    for name, counts in _coverage(shapes).items():
        for what, cnt in counts.most_common():
            out.append(f"| {name} | {cnt} | {what} |")
    if timed_any and st["worst"]:
        out += ["", f"Worst {min(worst_n, len(st['worst']))} shapes (tileq vs best baseline):", "",
                "| shape | M | N | K | tileq ms | baseline | baseline ms | speedup |",
                "|---|---|---|---|---|---|---|---|"]
        for s, key, t, b in st["worst"][:worst_n]:
            out.append(f"| {key[1]} | {key[2]} | {key[3]} | {key[4]} | {t.time_ms:.4g} | {b.impl} | "
                       f"{b.time_ms:.4g} | {_x(s)} |")
    out.append("")
    return out
