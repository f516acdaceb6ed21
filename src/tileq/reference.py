"""The torch reference: the formulas of docs/schemes.md section 1, executed literally. Ground truth of every test.

Products are formed in float64, which is exact for int8 and int4 operands (|sum| < 2**53) and
well above fp32 accuracy for float ones. Each K-group's sum is then rounded to fp32, scaled in
fp32 and accumulated in fp32, and the epilogue runs in the epilogue order of docs/schemes.md section 1:
``acc_in + mainloop -> fp32 -> * a_scale rows -> * b_scale columns -> + bias -> cast``.
Works on CPU and CUDA tensors alike.
"""

from __future__ import annotations

import torch

from .dtypes import PackedInt4
from .problem import Problem, ScaleKind


def dense_float64(x) -> torch.Tensor:
    """The logical matrix of an operand as float64 (packed int4 unpacked)."""
    if isinstance(x, PackedInt4):
        from .quant import unpack_int4

        return unpack_int4(x).to(torch.float64)
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.to(torch.float32).to(torch.float64)
    return x.to(torch.float64)


def expand_b_group_scale(b_scale: torch.Tensor, n: int, group_n: int) -> torch.Tensor:
    """[Gk, Gn] -> [Gk, N]: column n takes group n // group_n."""
    return b_scale.repeat_interleave(group_n, dim=1)[:, :n]


def mainloop_ref(problem: Problem) -> torch.Tensor:
    """``acc_in + mainloop`` before the epilogue: int32 for integer non-group problems, else fp32."""
    spec = problem.spec
    a = dense_float64(problem.a)
    b = dense_float64(problem.b)
    if not spec.scheme.grouped:
        raw = a @ b  # exact for integer operands
        if spec.acc_dtype == torch.int32:
            total = raw.to(torch.int64)
            if problem.acc is not None:
                total = total + problem.acc.to(torch.int64)
            return total.to(torch.int32)
        acc = raw.to(torch.float32)
        return acc + problem.acc if problem.acc is not None else acc

    acc = torch.zeros(spec.m, spec.n, dtype=torch.float32, device=problem.device)
    if problem.acc is not None:
        acc += problem.acc
    sa = problem.a_scale if spec.a_scale_kind is ScaleKind.GROUP else None
    sb = None
    if spec.b_scale_kind is ScaleKind.GROUP:
        sb = expand_b_group_scale(problem.b_scale, spec.n, spec.group_n)
    for g in range(spec.gk):
        ks = slice(g * spec.group_k, min((g + 1) * spec.group_k, spec.k))
        part = (a[:, ks] @ b[ks, :]).to(torch.float32)
        if sa is not None:
            part = part * sa[:, g : g + 1]
        if sb is not None:
            part = part * sb[g : g + 1, :]
        acc += part
    return acc


def epilogue_ref(problem: Problem, acc: torch.Tensor) -> torch.Tensor:
    """fp32 -> row scale -> column scale -> bias -> cast, skipping scales promoted in the loop."""
    spec = problem.spec
    y = acc.to(torch.float32)
    if spec.a_scale_kind in (ScaleKind.SCALAR, ScaleKind.VECTOR):
        y = y * problem.a_scale  # 0-d or [M, 1]: rows
    if spec.b_scale_kind in (ScaleKind.SCALAR, ScaleKind.VECTOR):
        y = y * problem.b_scale  # 0-d or [1, N]: columns
    if problem.bias is not None:
        y = y + problem.bias
    return y.to(spec.out_dtype)


def gemm_ref(problem: Problem) -> torch.Tensor:
    """Run a validated Problem through the reference; writes into ``problem.out`` when given."""
    spec = problem.spec
    if spec.m == 0 or spec.n == 0:
        result = torch.empty(spec.m, spec.n, dtype=spec.out_dtype, device=problem.device)
    else:
        result = epilogue_ref(problem, mainloop_ref(problem))
    if problem.out is not None:
        problem.out.copy_(result)
        return problem.out
    return result
