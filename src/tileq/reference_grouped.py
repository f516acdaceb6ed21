"""The torch reference of the grouped GEMM (``tileq.grouped_linear``): ground truth of its tests.

Per expert e it runs ``tileq.reference``'s formulas (float64 products, fp32 group sums and
epilogue, docs/schemes.md section 1) on that expert's rows, exactly as ``tileq.linear`` with
``backend="reference"`` would on them, then multiplies the optional per-row ``row_scale`` in fp32
and casts: ``mainloop -> * x_scale rows -> * w_scale columns -> * row_scale -> cast``.

Expert e's rows: ``offsets[e]:offsets[e+1]`` of x [T, K] (contiguous form) or rows
``0:counts[e]`` of x[e] (masked form, x [E, C, K]). Rows of the output that belong to no expert
are left as they are (unwritten in a fresh output). The reference reads offsets / counts on the
host (it synchronizes: it is a test and debugging executor, not a hot path) and checks their
values, which the kernel never does.

Arguments are those of ``tileq.grouped_linear`` after its validation: w [E, N, K] (int8, fp8,
bf8) or uint8 [E, N, K // 2] (int4 packed along K, docs/schemes.md section 3); w_scale [E, N]
(rowcol) or [E, Gn, Gk] (the weight's orientation: one row per N group); x_scale [rows],
[rows, 1] or [rows, Gk] with rows = T, or [E, C], [E, C, 1], [E, C, Gk] in the masked form.
"""

from __future__ import annotations

import itertools

import torch

from .dtypes import PackedInt4
from .errors import ShapeError, expect
from .problem import LINEAR_NAMES, build_problem
from .reference import epilogue_ref, mainloop_ref


def expert_rows(offsets=None, counts=None, rows: int = 0) -> list[tuple[int, int]]:
    """[(first, end)] per expert, read on the host and checked: offsets non-decreasing from 0 to
    at most ``rows`` (T), or counts in [0, rows] (C)."""
    if (offsets is None) == (counts is None):
        raise ShapeError(expect("offsets, counts", "exactly one of them", "both" if offsets is not None else "neither"))
    if offsets is not None:
        o = [int(v) for v in offsets.tolist()]
        if o[0] != 0 or any(b < a for a, b in itertools.pairwise(o)) or o[-1] > rows:
            raise ShapeError(expect("offsets", f"non-decreasing values from 0 to at most T={rows}", o))
        return list(itertools.pairwise(o))
    c = [int(v) for v in counts.tolist()]
    if any(v < 0 or v > rows for v in c):
        raise ShapeError(expect("counts", f"values in [0, C={rows}]", c))
    return [(0, v) for v in c]


def expert_weight(w: torch.Tensor, e: int, k: int):
    """Expert e's nn.Linear weight [N, K]: a tensor, or a PackedInt4 for uint8 int4 storage."""
    if w.dtype == torch.uint8:
        return PackedInt4(w[e], (w.shape[1], k), 1)
    return w[e]


def _expert_scale(s, e: int, masked: bool, lo: int, hi: int):
    """The slice of a per-row scale (x_scale, row_scale) that covers expert e's rows."""
    if s is None or s.dim() == 0:
        return s
    return s[e, lo:hi] if masked else s[lo:hi]


def grouped_linear_ref(x, w, x_scale=None, w_scale=None, *, scheme, offsets=None, counts=None,
                       out_dtype=torch.bfloat16, group_k: int = 128, group_n=None, row_scale=None,
                       out=None) -> torch.Tensor:
    """y_e = dequant(x_e) @ dequant(w[e]).t() (* row_scale) for every expert, in torch.

    Returns ``out`` (written at the experts' rows) or a fresh tensor ([T, N] or [E, C, N]) whose
    rows outside every expert are uninitialized, as the kernel leaves them.
    """
    masked = counts is not None
    k = x.shape[-1]
    n = w.shape[1]
    rows = x.shape[1] if masked else x.shape[0]
    spans = expert_rows(offsets, counts, rows)
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=out_dtype, device=x.device)
    for e, (lo, hi) in enumerate(spans):
        if hi <= lo:
            continue
        x_e = x[e, lo:hi] if masked else x[lo:hi]
        ws = w_scale[e]
        if ws is not None and ws.dim() == 2:
            ws = ws.t()  # [Gn, Gk] -> the b_scale contract's [Gk, Gn] of the logical B = w.t()
        problem = build_problem(
            x_e, expert_weight(w, e, k).t(), _expert_scale(x_scale, e, masked, lo, hi), ws,
            scheme=scheme, out_dtype=torch.float32, group_k=group_k, group_n=group_n,
            names=LINEAR_NAMES,
        )
        y = epilogue_ref(problem, mainloop_ref(problem))  # fp32: the cast comes after row_scale
        rs = _expert_scale(row_scale, e, masked, lo, hi)
        if rs is not None:
            y = y * rs.float()[:, None]
        if masked:
            out[e, lo:hi] = y.to(out_dtype)
        else:
            out[lo:hi] = y.to(out_dtype)
    return out
