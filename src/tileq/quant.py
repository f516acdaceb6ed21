"""Host-side quantize / dequantize, int4 packing and scale preshuffling, in plain torch.

A scale is a dequantization multiplier (``x ≈ q * s``, docs/schemes.md section 1). Every function keeps
the device of its input and computes in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .dtypes import OperandType, PackedInt4, operand_type, parse_operand_type
from .errors import DTypeError, ScaleError, ShapeError, expect

# Largest magnitude used for symmetric scaling. The int8 grid drops -128 so that q and -q are both
# representable. int4 follows GPTQ's symmetric grid instead: scale = amax / 7.5 and q in [-8, 7]
# (the extreme of one sign lands on -8, of the other on 7: half a step of range more than +-7;
# on all-MiniLM-L6-v2 W4A16 with groups of 128 the embeddings' cosine to the fp32 model went from
# 0.937 to 0.943, and to 0.954 with the clip search below, measured 2026-12-01).
QMAX: dict[OperandType, float] = {
    OperandType.I8: 127.0,
    OperandType.I4: 7.0,
    OperandType.FP8: 448.0,  # largest finite float8_e4m3fn
    OperandType.BF8: 57344.0,  # largest finite float8_e5m2
}
INT4_SCALE_DIVISOR = 7.5

_EPS = 1e-12
_TINY = torch.finfo(torch.float32).tiny
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # docs/schemes.md: upcast to fp32


# ----------------------------------------------------------------------------- quantize


# int4 clip search: per block, the scale amax * r / 7.5 with the r in CLIP_RATIOS whose rounding
# error (sum of squares) is least. Clipping a block's rare extremes buys a finer step for the rest.
CLIP_RATIOS = tuple(1.0 - 0.01 * i for i in range(30))


def quantize(x, dtype, *, block=(None, None), eps=_EPS, pack_dim=None):
    """Quantize a 2-D float tensor per block; returns ``(q, scale)`` with ``x ≈ q * scale``.

    ``block=(br, bc)`` gives the block extent along each dim (None: the whole extent); ``scale``
    is fp32 of shape ``[ceil(R/br), ceil(C/bc)]`` (the last block may be partial). For int4, ``q``
    is a PackedInt4 packed along ``pack_dim`` (default: ``x``'s unit-stride dimension).
    """
    return _quantize(x, dtype, block, eps, pack_dim, "x")


def _quantize(x, dtype, block, eps, pack_dim, arg, clip_search=False):
    otype = _quant_type(dtype)
    _check_2d(x, arg)
    if not x.dtype.is_floating_point:
        raise DTypeError(expect(arg, "a floating-point tensor", x.dtype))
    block = _check_block(block)
    _check_eps(eps)
    if otype is OperandType.I4:
        pack_dim = _norm_dim(_unit_stride_dim(x) if pack_dim is None else pack_dim, "pack_dim")
        _check_even(x, pack_dim, arg)  # refuse before doing any work
    xf = x.float()
    _check_finite(xf, arg)
    qmax = QMAX[otype]
    divisor = INT4_SCALE_DIVISOR if otype is OperandType.I4 else qmax
    # An all-zero block gets eps, so the division below never makes 0/0 or inf. Divide by a
    # device tensor, not a Python number: CUDA turns division by a host scalar into a multiply
    # by its reciprocal, 1 ulp off the CPU result (seen on an H200, torch 2.11).
    amax = _block_amax(xf.abs(), block)
    scale = (amax / amax.new_tensor(divisor)).clamp_min(eps)
    if clip_search and otype is OperandType.I4:
        scale = _best_clip(xf, amax, block, eps)
    # Saturate before any cast: fp32 rounding can push x/scale a hair above qmax, and an
    # out-of-range cast is not safe: float8_e5m2 gives inf (62000 -> inf, torch 2.13), int8
    # wraps, and float8_e4m3fn (no inf) has given NaN in some torch versions.
    y = (xf / _expand(scale, block, xf.shape)).clamp(-divisor, divisor)
    if otype.is_float8:
        return y.to(otype.torch_dtype), scale
    q = torch.round(y)  # torch.round rounds half to even
    if otype is OperandType.I4:
        q = _int4_round(xf, _expand(scale, block, xf.shape))
        return pack_int4(q.to(torch.int8), dim=pack_dim), scale
    q = q.to(torch.int8)
    return q, scale


def _int4_round(xf: torch.Tensor, full_scale: torch.Tensor) -> torch.Tensor:
    return torch.round((xf / full_scale).clamp(-INT4_SCALE_DIVISOR, INT4_SCALE_DIVISOR)).clamp(-8, 7)


def _best_clip(xf: torch.Tensor, amax: torch.Tensor, block, eps) -> torch.Tensor:
    """Per block, the int4 scale among amax * CLIP_RATIOS / 7.5 with the least squared error."""
    best_scale, best_err = None, None
    for r in CLIP_RATIOS:
        scale = (amax * amax.new_tensor(r) / amax.new_tensor(INT4_SCALE_DIVISOR)).clamp_min(eps)
        full = _expand(scale, block, xf.shape)
        err = _block_sum((_int4_round(xf, full) * full - xf).square(), block)
        if best_err is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale = torch.where(better, scale, best_scale)
            best_err = torch.where(better, err, best_err)
    return best_scale


def _check_eps(eps) -> None:
    # A subnormal scale carries few significant bits: with eps = 1e-45, x = 2.7e-43 gives
    # x / scale = 190 for int8 (checked on torch 2.13). A normal eps keeps x / scale <= QMAX
    # up to fp32 rounding.
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not _TINY <= eps < math.inf:
        raise ScaleError(expect("eps", f"a finite number >= {_TINY} (smallest normal fp32)", eps))


def _quant_type(dtype) -> OperandType:
    if isinstance(dtype, torch.dtype):  # torch.int8 -> "int8", torch.float8_e4m3fn -> ...
        dtype = str(dtype).removeprefix("torch.")
    otype = parse_operand_type(dtype)
    if otype not in QMAX:
        raise DTypeError(expect("dtype", "a quantized type (int8, int4, fp8, bf8)", str(otype)))
    return otype


def _check_finite(xf: torch.Tensor, arg: str) -> None:
    if bool(torch.isfinite(xf).all()):
        return
    n_nan = int(torch.isnan(xf).sum())
    n_inf = int(torch.isinf(xf).sum())
    raise ScaleError(
        expect(arg, "finite values (in fp32) to quantize", f"{n_nan} NaN and {n_inf} inf values")
    )


def _unit_stride_dim(x: torch.Tensor) -> int:
    # docs/schemes.md: the int4 pair runs along the operand's unit-stride dimension. A size-1 dim says
    # nothing about the layout, so prefer a dimension that is both unit-stride and non-trivial.
    if x.stride(1) == 1 and x.shape[1] > 1:
        return 1
    if x.stride(0) == 1 and x.shape[0] > 1:
        return 0
    return 1


# ----------------------------------------------------------------------------- blocks


def _check_block(block) -> tuple:
    ok = isinstance(block, (tuple, list)) and len(block) == 2
    ok = ok and all(b is None or (_is_int(b) and b >= 1) for b in block)
    if not ok:
        raise ShapeError(expect("block", "(rows, cols), each a positive int or None", repr(block)))
    return tuple(None if b is None else int(b) for b in block)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _block_size(n: int, b) -> int:
    return max(n, 1) if b is None else b  # max(): an empty extent is still one (empty) block


def _grid(shape, block) -> tuple[int, int]:
    return tuple(1 if b is None else -(-n // b) for n, b in zip(shape, block))


def _block_amax(ax: torch.Tensor, block) -> torch.Tensor:
    """Per-block max of ``ax`` (>= 0): zero-pad to whole blocks, then reduce a 4-D view."""
    (R, C), (gr, gc) = ax.shape, _grid(ax.shape, block)
    br, bc = _block_size(R, block[0]), _block_size(C, block[1])
    ax = F.pad(ax, (0, gc * bc - C, 0, gr * br - R))  # zeros never raise a max of |x|
    return ax.reshape(gr, br, gc, bc).amax(dim=(1, 3))


def _block_sum(v: torch.Tensor, block) -> torch.Tensor:
    (R, C), (gr, gc) = v.shape, _grid(v.shape, block)
    br, bc = _block_size(R, block[0]), _block_size(C, block[1])
    v = F.pad(v, (0, gc * bc - C, 0, gr * br - R))
    return v.reshape(gr, br, gc, bc).sum(dim=(1, 3))


def _expand(scale: torch.Tensor, block, shape) -> torch.Tensor:
    """The per-element scale of a logical ``shape`` from the per-block ``scale``."""
    R, C = shape
    s = scale.repeat_interleave(_block_size(R, block[0]), dim=0)[:R]
    return s.repeat_interleave(_block_size(C, block[1]), dim=1)[:, :C]


# ----------------------------------------------------------------------------- GEMM-shaped wrappers


def _a_blocks(group_k) -> dict:
    return {"tensor": (None, None), "row": (1, None), "group": (1, _group(group_k, "group_k"))}


def _b_blocks(group_k, group_n) -> dict:
    return {
        "tensor": (None, None),
        "col": (None, 1),
        "group": (_group(group_k, "group_k"), _group(group_n, "group_n")),
    }


def _group(g, arg: str) -> int:
    if not _is_int(g) or g < 1:
        raise ShapeError(expect(arg, "a positive int", repr(g)))
    return g


def _quantize_as(x, dtype, granularity, blocks: dict, pack_dim, arg, clip_search=False):
    if not isinstance(granularity, str) or granularity not in blocks:
        valid = ", ".join(repr(g) for g in blocks)
        raise ScaleError(expect("granularity", f"one of {valid}", repr(granularity)))
    q, scale = _quantize(x, dtype, blocks[granularity], _EPS, pack_dim, arg, clip_search)
    # Contract shapes (docs/schemes.md section 1): scalar 0-d, per-row [M] / per-column [N], groups 2-D.
    if granularity == "tensor":
        return q, scale.reshape(())
    if granularity in ("row", "col"):
        return q, scale.reshape(-1)
    return q, scale


def quantize_a(a, dtype, *, granularity, group_k=128, pack_dim=None):
    """Quantize the logical A [M, K]: 'tensor' -> 0-d scale, 'row' -> [M], 'group' -> [M, Gk]."""
    return _quantize_as(a, dtype, granularity, _a_blocks(group_k), pack_dim, "a")


def quantize_b(b, dtype, *, granularity, group_k=128, group_n=128, pack_dim=None):
    """Quantize the logical B [K, N]: 'tensor' -> 0-d scale, 'col' -> [N], 'group' -> [Gk, Gn]."""
    return _quantize_as(b, dtype, granularity, _b_blocks(group_k, group_n), pack_dim, "b")


def quantize_weight(w, dtype, *, granularity, group_k=128, group_n=128, clip_search=False):
    """Quantize an nn.Linear weight w [N, K] for ``gemm(qa, qw.t(), sa, sw)``.

    Returns ``(qw, scale)``: ``qw`` in w's orientation [N, K] (int4 packed along K), ``scale`` in
    the B contract's shape for the logical B = w.t(): 0-d, [N] ('col') or [Gk, Gn] ('group').
    ``clip_search`` (int4 only): per block, pick the scale among amax * CLIP_RATIOS / 7.5 with
    the least squared rounding error (what ``QuantLinear.from_linear`` uses for int4 weights).
    """
    _check_2d(w, "w")
    if _quant_type(dtype) is OperandType.I4:
        _check_even(w, 1, "w")  # K, named in w's own orientation
    # Quantizing the logical B = w.t() gives the scale in B's shape with no second code path.
    q, scale = _quantize_as(w.t(), dtype, granularity, _b_blocks(group_k, group_n), 0, "w", clip_search)
    return (q.t() if isinstance(q, PackedInt4) else q.t().contiguous()), scale


# ----------------------------------------------------------------------------- dequantize


def dequantize(q, scale, *, block=(None, None)) -> torch.Tensor:
    """fp32 ``q * scale`` per block, the inverse of ``quantize`` (``q`` may be a PackedInt4)."""
    block = _check_block(block)
    values = _values(q)
    shape = tuple(values.shape)
    scale = _check_scale(scale)
    grid = _grid(shape, block)
    if grid == (1, 1) and scale.numel() == 1:
        scale = scale.reshape(1, 1)  # a scalar may be 0-d or any one-element tensor
    if tuple(scale.shape) != grid:
        raise ShapeError(
            expect("scale", f"shape {grid} for block {block} over shape {shape}", tuple(scale.shape))
        )
    return values.float() * _expand(scale, block, shape)


def dequantize_a(q, scale, *, group_k=128) -> torch.Tensor:
    """Dequantize the logical A [M, K] with a scalar, [M] / [M, 1] or [M, Gk] scale."""
    M, K = _logical_shape(q, "q")
    scale = _check_scale(scale)
    gk = _group(group_k, "group_k")
    Gk = -(-K // gk)
    if scale.numel() == 1:
        return dequantize(q, scale.reshape(1, 1))
    # A rank-1 a scale always scales rows: make it [M, 1] explicitly, never lean on broadcasting
    # (which would scale columns when M == N).
    if tuple(scale.shape) in ((M,), (M, 1)):
        return dequantize(q, scale.reshape(M, 1), block=(1, None))
    if tuple(scale.shape) == (M, Gk):
        return dequantize(q, scale, block=(1, gk))
    raise ShapeError(
        expect(
            "scale",
            f"a scalar, (M,), (M, 1) or (M, Gk) with M={M}, Gk={Gk} (K={K}, group_k={gk})",
            tuple(scale.shape),
        )
    )


def dequantize_b(q, scale, *, group_k=128, group_n=None) -> torch.Tensor:
    """Dequantize the logical B [K, N] with a scalar, [N] / [1, N] or [Gk, Gn] scale.

    ``group_n`` defaults to 1 when ``scale.shape[1] == N``, else 128 (docs/schemes.md: 1 or 128).
    """
    K, N = _logical_shape(q, "q")
    scale = _check_scale(scale)
    gk = _group(group_k, "group_k")
    if scale.numel() == 1:
        return dequantize(q, scale.reshape(1, 1))
    # A rank-1 b scale always scales columns: [1, N] explicitly.
    if tuple(scale.shape) in ((N,), (1, N)):
        return dequantize(q, scale.reshape(1, N), block=(None, 1))
    if group_n is None:
        group_n = 1 if scale.dim() == 2 and scale.shape[1] == N else 128
    gn = _group(group_n, "group_n")
    grid = (-(-K // gk), -(-N // gn))
    if tuple(scale.shape) == grid:
        return dequantize(q, scale, block=(gk, gn))
    raise ShapeError(
        expect(
            "scale",
            f"a scalar, (N,), (1, N) or (Gk, Gn) = {grid} with K={K}, N={N}, "
            f"group_k={gk}, group_n={gn}",
            tuple(scale.shape),
        )
    )


def _values(q) -> torch.Tensor:
    """The logical values of a quantized operand (unpacked for int4)."""
    if isinstance(q, PackedInt4):
        return unpack_int4(q)
    operand_type(q, "q")  # int8 / fp8 / bf8 (bf16 / fp16 pass through); refuses raw uint8
    _check_2d(q, "q")
    return q


def _logical_shape(q, arg: str) -> tuple[int, int]:
    if isinstance(q, PackedInt4):
        return q.shape
    _check_2d(q, arg)
    return tuple(q.shape)


def _check_scale(scale) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        raise DTypeError(expect("scale", "a torch.Tensor", type(scale).__name__))
    if scale.dtype not in _SCALE_DTYPES:
        raise DTypeError(expect("scale", "dtype float32, bfloat16 or float16", scale.dtype))
    return scale.float()


# ----------------------------------------------------------------------------- int4 packing


def pack_int4(x, dim=-1) -> PackedInt4:
    """Pack a 2-D integer tensor with values in [-8, 7], pairs along ``dim``.

    byte = ((x[2j] + 8) << 4) | (x[2j+1] + 8): element 2j in the high nibble (docs/schemes.md section 3).
    The packed data keeps x's orientation with ``dim`` halved and of unit stride.
    """
    _check_2d(x, "x")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise DTypeError(expect("x", "an integer tensor", x.dtype))
    d = _norm_dim(dim, "dim")
    _check_even(x, d, "x")
    if x.numel():
        lo, hi = int(x.min()), int(x.max())
        if lo < -8 or hi > 7:
            raise ScaleError(expect("x", "int4 values in [-8, 7]", f"min {lo}, max {hi}"))
    if d == 0:
        # Pack the transpose along its last dim: the bytes come out contiguous along dim 0.
        return PackedInt4(_pack_last(x.t()).t(), tuple(x.shape), 0)
    return PackedInt4(_pack_last(x), tuple(x.shape), 1)


def _pack_last(x: torch.Tensor) -> torch.Tensor:
    n = x.to(torch.int16) + 8  # nibbles 0..15
    return ((n[:, 0::2] << 4) | n[:, 1::2]).to(torch.uint8).contiguous()


def unpack_int4(p: PackedInt4) -> torch.Tensor:
    """int8 values of shape ``p.shape``; the exact inverse of ``pack_int4``."""
    if not isinstance(p, PackedInt4):
        raise DTypeError(expect("p", "a tileq.PackedInt4", type(p).__name__))
    if p.packed_dim == 0:
        return _unpack_last(p.data.t()).t()
    return _unpack_last(p.data)


def _unpack_last(b: torch.Tensor) -> torch.Tensor:
    b = b.to(torch.int16)  # elementwise, so any leading stride (a sliced buffer) works
    pairs = torch.stack(((b >> 4) - 8, (b & 0xF) - 8), dim=-1)  # high nibble is element 2j
    return pairs.reshape(b.shape[0], 2 * b.shape[1]).to(torch.int8)


# ----------------------------------------------------------------------------- scale layout


def preshuffle_scale(s: torch.Tensor) -> torch.Tensor:
    """A copy of an [M, Gk] scale stored K-group-major, strides (1, M): a K-tile's scales adjacent."""
    _check_2d(s, "s")
    return _restrided(s, (1, max(s.shape[0], 1)))


def unshuffle_scale(s: torch.Tensor) -> torch.Tensor:
    """A copy of an [M, Gk] scale stored row-major, strides (Gk, 1)."""
    _check_2d(s, "s")
    return _restrided(s, (max(s.shape[1], 1), 1))


def _restrided(s: torch.Tensor, strides) -> torch.Tensor:
    # Exact strides even when a dim is 1 ([M, 1].t().contiguous() would keep strides (1, 1)),
    # so a kernel can rely on stride(1) == M.
    out = torch.empty_strided(tuple(s.shape), strides, dtype=s.dtype, device=s.device)
    return out.copy_(s)


def is_preshuffled(s) -> bool:
    """True for an [M, Gk] scale stored K-group-major (M > 1; a single row has no order)."""
    return (
        isinstance(s, torch.Tensor)
        and s.dim() == 2
        and s.shape[0] > 1
        and s.stride(0) == 1
        and s.stride(1) >= s.shape[0]
    )


# ----------------------------------------------------------------------------- int32 accumulation


def int32_overflow_k_limit(a, b) -> int:
    """Largest K whose int32 sum of K products a*b cannot overflow (int8 x int8: 131071)."""
    ta, tb = parse_operand_type(a), parse_operand_type(b)
    for arg, t in (("a", ta), ("b", tb)):
        if not t.is_integer:
            raise DTypeError(expect(arg, "an integer operand type (i8 or i4)", str(t)))
    return (2**31 - 1) // (int(ta.max_abs) * int(tb.max_abs))


# ----------------------------------------------------------------------------- small checks


def _check_2d(x, arg: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(expect(arg, "a torch.Tensor", type(x).__name__))
    if x.dim() != 2:
        raise ShapeError(expect(arg, "a 2-D tensor", f"shape {tuple(x.shape)}"))


def _norm_dim(dim, arg: str) -> int:
    if _is_int(dim) and dim in (0, 1, -1, -2):
        return dim % 2
    raise ShapeError(expect(arg, "0, 1, -1 or -2", repr(dim)))


def _check_even(x: torch.Tensor, dim: int, arg: str) -> None:
    if x.shape[dim] % 2:
        raise ShapeError(
            expect(
                arg,
                f"an even extent along dim {dim} (int4 packs pairs)",
                f"shape {tuple(x.shape)}",
            )
        )


__all__ = [
    "QMAX",
    "quantize",
    "quantize_a",
    "quantize_b",
    "quantize_weight",
    "dequantize",
    "dequantize_a",
    "dequantize_b",
    "pack_int4",
    "unpack_int4",
    "preshuffle_scale",
    "unshuffle_scale",
    "is_preshuffled",
    "int32_overflow_k_limit",
]
