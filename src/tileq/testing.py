"""Test helpers shipped with the package: random operands for any ProblemSpec, tolerances, checks.

Used by the test suite, ``tileq selftest``, the demo and the benchmark harness, so all of them
draw operands the same way: quantized values spread over the type's range (never zeros),
positive scales away from zero, and optional padded leading dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dtypes import OperandType, PackedInt4
from .problem import ProblemSpec, ScaleKind, ScaleLayout


@dataclass
class GemmArgs:
    a: object
    b: object
    a_scale: torch.Tensor | None
    b_scale: torch.Tensor | None
    kwargs: dict

    def call(self, fn, **extra):
        return fn(self.a, self.b, self.a_scale, self.b_scale, **{**self.kwargs, **extra})


def _values(t: OperandType, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Random values of type ``t`` (int4 as int8 in [-8, 7]) on the CPU."""
    dev = gen.device
    if t is OperandType.I8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8, device=dev)
    if t is OperandType.I4:
        return torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8, device=dev)
    x = torch.randn(shape, generator=gen, device=dev)
    if t is OperandType.FP8:
        return (x * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    if t is OperandType.BF8:
        return (x * 64).to(torch.float8_e5m2)
    return x.to(t.torch_dtype)


def make_matrix(t: OperandType, rows: int, cols: int, contiguous_dim: int, gen: torch.Generator,
                pad: int = 0, device="cpu"):
    """A logical [rows, cols] operand whose ``contiguous_dim`` has unit stride.

    ``pad`` widens the leading dimension (a sliced view of a wider buffer, as BLAS's lda).
    int4 is packed along the contiguous dim and returned as a PackedInt4.
    """
    if contiguous_dim == 1:
        buf = _values(t, (rows, cols + pad), gen)
        view = lambda x: x[:, : x.shape[1] - (pad if t is not OperandType.I4 else pad // 2)]
    else:
        buf = _values(t, (cols, rows + pad), gen).t()  # [rows + pad, cols], stride (1, rows+pad)
        view = lambda x: x[: x.shape[0] - (pad if t is not OperandType.I4 else pad // 2), :]
    if t is OperandType.I4:
        from .quant import pack_int4

        assert pad % 2 == 0, "int4 padding must be even"
        packed = pack_int4(buf, dim=contiguous_dim)
        data = view(packed.data).to(device)
        shape = (rows, cols)
        return PackedInt4(data, shape, contiguous_dim)
    return view(buf).to(device)


def _scale(shape, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device=gen.device) + 0.5


def make_args(spec: ProblemSpec, *, seed: int = 0, device="cpu", pad: int = 0,
              bias: bool | None = None, acc: bool | None = None) -> GemmArgs:
    """Random operands, scales, bias and acc for ``spec`` (shapes, layouts and scale kinds).

    Values are drawn on ``device`` (fast at LLM sizes on a GPU); the same seed gives the same
    values on the same kind of device.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    m, n, k = spec.m, spec.n, spec.k
    a = make_matrix(spec.a_type, m, k, 1 if spec.layout[0] == "r" else 0, gen, pad, device)
    b = make_matrix(spec.b_type, k, n, 1 if spec.layout[1] == "r" else 0, gen, pad, device)
    sa = sb = None
    if spec.a_scale_kind is ScaleKind.SCALAR:
        sa = _scale((), gen)
    elif spec.a_scale_kind is ScaleKind.VECTOR:
        sa = _scale((m,), gen)
    elif spec.a_scale_kind is ScaleKind.GROUP:
        sa = _scale((m, spec.gk), gen)
        if spec.a_scale_layout is ScaleLayout.PRESHUFFLED:
            sa = sa.t().contiguous().t()
    if spec.b_scale_kind is ScaleKind.SCALAR:
        sb = _scale((), gen)
    elif spec.b_scale_kind is ScaleKind.VECTOR:
        sb = _scale((n,), gen)
    elif spec.b_scale_kind is ScaleKind.GROUP:
        sb = _scale((spec.gk, spec.gn), gen)
    kwargs = dict(scheme=spec.scheme.value, out_dtype=spec.out_dtype, group_k=spec.group_k)
    if spec.fast_accum:
        kwargs["fast_accum"] = True
    if spec.b_scale_kind is ScaleKind.GROUP:
        kwargs["group_n"] = spec.group_n
    if bias if bias is not None else spec.has_bias:
        kwargs["bias"] = torch.randn(n, generator=gen, device=gen.device) * 4
    if acc if acc is not None else spec.has_acc:
        if spec.acc_dtype == torch.int32:
            kwargs["acc"] = torch.randint(-5000, 5000, (m, n), generator=gen, dtype=torch.int32,
                                          device=gen.device)
        else:
            kwargs["acc"] = torch.randn(m, n, generator=gen, device=gen.device) * 100
    to = lambda s: None if s is None else s.to(device)
    return GemmArgs(a, b, to(sa), to(sb), kwargs)


# Largest |kernel - reference| / max|reference| accepted, by output dtype. bf16 output is
# rounded at 2**-8 relative; fp8 dots on sm_90 accumulate with reduced precision inside a
# K tile, hence a little headroom over pure rounding for fp32 output.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-3}


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Error statistics of a result against the reference."""
    o, r = out.float(), ref.float()
    scale = r.abs().max().item() if r.numel() else 0.0
    diff = (o - r).abs()
    return {
        "max_abs": diff.max().item() if diff.numel() else 0.0,
        "max_rel": (diff.max().item() / scale) if scale > 0 else float("inf") if diff.numel() else 0.0,
        "ref_max": scale,
        "nonfinite": int((~torch.isfinite(o)).sum().item()),
        "nonzero_out": int((o != 0).sum().item()),
        "nonzero_ref": int((r != 0).sum().item()),
    }


def check_close(out: torch.Tensor, ref: torch.Tensor, out_dtype=None, tol: float | None = None) -> dict:
    """Raise AssertionError unless ``out`` matches ``ref`` within the dtype's tolerance.

    Also refuses NaN/inf, an all-zero result where the reference is not, and a reference too
    small for the tolerance to mean anything.
    """
    tol = tol if tol is not None else TOLERANCE[out_dtype or out.dtype]
    st = compare(out, ref)
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    if ref.numel() == 0:
        return st
    assert st["nonfinite"] == 0, f"{st['nonfinite']} non-finite outputs"
    assert st["ref_max"] > 0, "reference is all zeros: the check would prove nothing"
    assert st["nonzero_out"] > 0, "output is all zeros"
    assert st["max_rel"] <= tol, f"max error {st['max_rel']:.3g} of max|ref| exceeds {tol:g} ({st})"
    return st


class KernelRecorder:
    """Stands in for a Triton kernel in tests: records each launch's grid, arguments and keywords
    (``kernel[grid](*args, **kwargs)``) instead of running it; ``on_call(grid, args, kwargs)``,
    when set, runs in its place (e.g. to write known values into an output)."""

    def __init__(self):
        self.calls = []
        self.on_call = None

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            if self.on_call is not None:
                self.on_call(grid, args, kwargs)

        return launch_
