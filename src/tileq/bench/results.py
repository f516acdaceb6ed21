"""Result rows: one per (suite, shape, case, implementation); CSV in and out; ``--compare``.

Statuses:
  ok                     passed the gate and timed
  not measured (no GPU)  passed the gate; no timing without CUDA
  FAIL                   failed the correctness gate (note says how); not timed
  error                  raised (note has the exception)
  N/A                    does not apply here (note says why)
  skipped                not run (time budget)
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, fields

OK = "ok"
NOT_MEASURED = "not measured (no GPU)"
FAIL = "FAIL"
ERROR = "error"
NA = "N/A"
SKIPPED = "skipped"

PASSED = (OK, NOT_MEASURED)


@dataclass
class Result:
    suite: str
    shape: str
    m: int
    n: int
    k: int
    case: str
    scheme: str
    dtypes: str
    layout: str
    impl: str
    kind: str
    status: str
    time_ms: float | None = None
    time_min_ms: float | None = None
    runs: int | None = None
    tflops: float | None = None
    tbps: float | None = None
    bytes: int | None = None
    rel_err: float | None = None
    sqnr_db: float | None = None
    kernel: str = ""
    note: str = ""

    @property
    def key(self) -> tuple:
        return (self.suite, self.shape, self.m, self.n, self.k, self.case, self.impl)

    @property
    def passed(self) -> bool:
        return self.status in PASSED

    @property
    def timed(self) -> bool:
        return self.status == OK and self.time_ms is not None


FIELDS = [f.name for f in fields(Result)]
_INTS = {"m", "n", "k", "runs", "bytes"}
_FLOATS = {"time_ms", "time_min_ms", "tflops", "tbps", "rel_err", "sqnr_db"}


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.6g}"
    return str(v)


def write_csv(rows: list[Result], path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for r in rows:
            d = asdict(r)
            w.writerow([_cell(d[name]) for name in FIELDS])


def read_csv(path) -> list[Result]:
    """Rows of a results.csv (written by this module); a file with other columns is refused."""
    from ..errors import ShapeError, expect

    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("suite", "shape", "m", "n", "k", "case", "impl", "status", "time_ms")
                   if c not in (reader.fieldnames or [])]
        if missing:
            raise ShapeError(expect(str(path), f"a tileq results.csv with columns {', '.join(FIELDS)}",
                                    f"missing {', '.join(missing)}"))
        rows = []
        for rec in reader:
            kw = {}
            for name in FIELDS:
                v = rec.get(name, "")
                if name in _INTS:
                    kw[name] = int(v) if v not in ("", None) else None
                elif name in _FLOATS:
                    kw[name] = float(v) if v not in ("", None) else None
                else:
                    kw[name] = v or ""
            rows.append(Result(**kw))
    return rows


# ----------------------------------------------------------------------------- compare


@dataclass
class Change:
    key: tuple
    old: float
    new: float
    change: float  # new / old - 1 (> 0: slower)
    metric: str


def _normalizers(rows: list[Result]) -> dict:
    """Per (suite, shape, m, n, k): the bf16 torch.matmul time of the same run."""
    return {r.key[:5]: r.time_ms for r in rows if r.impl == "torch_bf16_matmul" and r.timed}


def compare_runs(old: list[Result], new: list[Result], *, threshold: float = 0.05,
                 metric: str = "relative") -> tuple[list[Change], list[str]]:
    """tileq regressions of ``new`` against ``old``: (changes slower than threshold, notes).

    ``relative`` (default; docs/schemes.md: quote ratios from one run, never absolute times across
    runs): tileq's time divided by bf16 torch.matmul's time at the same shape in the same run.
    ``absolute``: tileq's times directly.
    """
    notes: list[str] = []
    old_by = {r.key: r for r in old if r.impl == "tileq" and r.timed}
    norm_old, norm_new = _normalizers(old), _normalizers(new)
    changes: list[Change] = []
    matched = 0
    for r in new:
        if r.impl != "tileq" or not r.timed or r.key not in old_by:
            continue
        o = old_by[r.key]
        if metric == "relative":
            base_o, base_n = norm_old.get(r.key[:5]), norm_new.get(r.key[:5])
            if not base_o or not base_n:
                notes.append(f"{r.shape} M={r.m} {r.case}: no bf16 torch.matmul time in both runs")
                continue
            old_v, new_v = o.time_ms / base_o, r.time_ms / base_n
        else:
            old_v, new_v = o.time_ms, r.time_ms
        matched += 1
        change = new_v / old_v - 1.0
        if change > threshold:
            changes.append(Change(r.key, old_v, new_v, change, metric))
    lost = [k for k, o in old_by.items() if not any(r.key == k and r.timed for r in new)]
    if lost:
        notes.append(f"{len(lost)} tileq rows timed in the old run are not timed in the new one")
    notes.insert(0, f"{matched} tileq rows compared ({metric} metric, threshold {threshold:.0%})")
    changes.sort(key=lambda c: -c.change)
    return changes, notes


def format_changes(changes: list[Change]) -> str:
    lines = []
    for c in changes:
        suite, shape, m, n, k, case, _ = c.key
        unit = "x bf16 time" if c.metric == "relative" else "ms"
        lines.append(f"  {c.change:+7.1%}  {case:<28} {shape} M={m} N={n} K={k}  "
                     f"{c.old:.4g} -> {c.new:.4g} {unit}")
    return "\n".join(lines)
