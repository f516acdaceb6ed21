"""Public operations: ``gemm``, ``linear``, ``a8w8_matmul_dequant`` and ``explain``.

Each call validates once (``problem.build_problem``), makes a plan (``plan.make_plan``: which
executor, pipeline, kernel and config) and runs it. Optional parameters are keyword-only.
"""

from __future__ import annotations

import torch

from . import plan as _plan
from .dtypes import PackedInt4
from .errors import DTypeError, ShapeError, expect
from .problem import Problem, Scheme, build_problem


def _run(problem: Problem, backend, deterministic, pipeline) -> torch.Tensor:
    p = _plan.make_plan(problem.spec, problem.device, backend=backend, deterministic=deterministic,
                        pipeline=pipeline)
    return _plan.execute(p, problem)


def gemm(
    a,
    b,
    a_scale=None,
    b_scale=None,
    *,
    scheme,
    out_dtype: torch.dtype = torch.bfloat16,
    bias=None,
    acc=None,
    group_k: int = 128,
    group_n: int | None = None,
    out=None,
    backend: str | None = None,
    deterministic: bool | None = None,
    pipeline: str | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """C = dequant(A) @ dequant(B) with the dequantization fused, per DESIGN.md section 1.

    a: logical [M, K] (tensor or PackedInt4); b: logical [K, N]. ``scheme`` is required
    ('tensor', 'rowcol', 'aquant', 'bquant', 'abquant'): it is never guessed from shapes.
    ``backend``: 'auto' (default, or $TILEQ_BACKEND): Triton kernels for CUDA tensors, the
    reference for CPU ones; 'triton' (the interpreter on CPU tensors); 'reference'.
    ``pipeline``: None lets the planner choose from the logical M (decode for M <= 64);
    'prefill' or 'decode' forces one (benchmarks, experiments).
    ``fast_accum``: fp8/bf8 pairs only; skip the fp32 promotion after every K tile (faster,
    error growing with K: up to 1.6% of max|C| at K = 17408 on an H200), like torch._scaled_mm's
    use_fast_accum. Default: precise.
    """
    problem = build_problem(
        a, b, a_scale, b_scale, scheme=scheme, out_dtype=out_dtype, bias=bias, acc=acc,
        group_k=group_k, group_n=group_n, out=out, fast_accum=fast_accum,
    )
    return _run(problem, backend, deterministic, pipeline)


def explain(
    a,
    b,
    a_scale=None,
    b_scale=None,
    *,
    scheme,
    out_dtype: torch.dtype = torch.bfloat16,
    bias=None,
    acc=None,
    group_k: int = 128,
    group_n: int | None = None,
    out=None,
    backend: str | None = None,
    deterministic: bool | None = None,
    pipeline: str | None = None,
    fast_accum: bool = False,
) -> str:
    """The plan ``gemm`` would run for these arguments, as text (nothing is launched)."""
    problem = build_problem(
        a, b, a_scale, b_scale, scheme=scheme, out_dtype=out_dtype, bias=bias, acc=acc,
        group_k=group_k, group_n=group_n, out=out, fast_accum=fast_accum,
    )
    p = _plan.make_plan(problem.spec, problem.device, backend=backend, deterministic=deterministic,
                        pipeline=pipeline)
    return p.describe()


def linear(
    x,
    w,
    x_scale=None,
    w_scale=None,
    *,
    scheme,
    out_dtype: torch.dtype = torch.bfloat16,
    bias=None,
    group_k: int = 128,
    group_n: int | None = None,
    out=None,
    backend: str | None = None,
    deterministic: bool | None = None,
    pipeline: str | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """y = x @ w.t() (nn.Linear convention): x [..., K], w [N, K] (tensor or PackedInt4).

    Leading dimensions of x are flattened into M and restored on the output. x_scale follows
    the flattened rows ([M], [M, 1], [M, Gk], or [..., 1] / [..., Gk] matching x's leading dims).
    """
    if isinstance(x, PackedInt4):
        lead, k = (), x.shape[1]
        x2 = x
    else:
        if not isinstance(x, torch.Tensor):
            raise DTypeError(expect("x", "a torch.Tensor or tileq.PackedInt4", type(x).__name__))
        if x.dim() < 1:
            raise ShapeError(expect("x", "a tensor of shape [..., K]", tuple(x.shape)))
        lead, k = tuple(x.shape[:-1]), x.shape[-1]
        x2 = x.reshape(-1, k) if x.dim() != 2 else x
    m = x2.shape[0]
    if isinstance(x_scale, torch.Tensor) and x_scale.dim() > 2 and len(lead) > 1:
        if tuple(x_scale.shape[:-1]) != lead:
            raise ShapeError(
                expect("x_scale", f"leading dimensions {lead} matching x", tuple(x_scale.shape))
            )
        x_scale = x_scale.reshape(m, x_scale.shape[-1])
    if not isinstance(w, (torch.Tensor, PackedInt4)) or len(tuple(w.shape)) != 2:
        got = tuple(w.shape) if hasattr(w, "shape") else type(w).__name__
        raise ShapeError(expect("w", "a 2-D [N, K] weight", got))
    if out is not None and isinstance(out, torch.Tensor) and out.dim() != 2:
        out2 = out.view(m, -1)
    else:
        out2 = out
    y = gemm(
        x2, w.t(), x_scale, w_scale, scheme=scheme, out_dtype=out_dtype, bias=bias,
        group_k=group_k, group_n=group_n, out=out2, backend=backend, deterministic=deterministic,
        pipeline=pipeline, fast_accum=fast_accum,
    )
    if out is not None:
        return out
    return y.reshape(*lead, y.shape[-1])


def a8w8_matmul_dequant(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    act_scale,
    weight_scale,
    *,
    out_dtype: torch.dtype,
    a_trans: bool = False,
    b_trans: bool = False,
    acc: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The seed op: int8 x int8 rowcol with the dequantization fused.

    lhs is [M, K] ([K, M] when ``a_trans``), rhs is [K, N] ([N, K] when ``b_trans``).
    act_scale: [M], [M, 1] or scalar; weight_scale: [N], [1, N] or scalar; acc: int32 [M, N]
    added to the integer product before dequantization. GEMV versus GEMM is decided from the
    logical M (after ``a_trans``), by the planner.
    """
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(expect(name, "a torch.Tensor", type(t).__name__))
        if t.dtype != torch.int8:
            raise DTypeError(expect(name, "dtype torch.int8", t.dtype))
        if t.dim() != 2:
            raise ShapeError(expect(name, "a 2-D tensor", f"{t.dim()}-D"))
    a = lhs.t() if a_trans else lhs
    b = rhs.t() if b_trans else rhs
    return gemm(
        a, b, act_scale, weight_scale, scheme=Scheme.ROWCOL, out_dtype=out_dtype, acc=acc,
        backend=backend,
    )
