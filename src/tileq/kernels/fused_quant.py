"""A rowcol 8-bit GEMM on 16-bit activations in one launch: per-token quantization inside the
GEMM kernel instead of an activation-quantization launch before it.

``FusedQuantLaunch`` runs the same kernel, config and grid as the ``GemmLaunch`` of the
quantized problem (``quantize_activation(x, 'row')`` then ``linear``), with the activation
operand read as bf16/fp16 x [M, K]: every program computes the scales of the tokens its tile
covers over the whole K (``gemm_kernel._token_scales``), quantizes each K tile in registers with
the activation-quantization kernel's own helpers and feeds the int8/fp8 dot; the epilogue takes
those scales as the row scales. q and s are bit for bit ``quantize_activation``'s, and the kernel
does everything after them as the two-launch path does, so the outputs are equal bit for bit.
Which calls take it is decided in ``tileq.dispatch.fused_quant``.
"""

from __future__ import annotations

import sys

import torch

from ..errors import DTypeError, UnsupportedError, expect
from . import buffers
from .direct import KernelCall, direct_launch_enabled
from .gemm_kernel import _gemm_kernel  # noqa: F401 (looked up on _THIS)
from .launch import GemmLaunch, specialization

_THIS = sys.modules[__name__]  # KernelCall looks the kernel up here at call time (tests stub it)
_X_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class FusedQuantLaunch:
    """``gemm``'s launch taking 16-bit activations x [M, K] (row stride ``x_row_stride``, unit
    stride along K) instead of their int8/fp8 quantization and its per-token scales.

    Call it as ``launch(x, w, w_scale, bias)`` with the weight storage, weight scale and bias the
    GEMM launch was built for (same dtypes, strides and layouts; scales and bias of other float
    dtypes are converted to fp32 as ``tileq.linear`` does); returns a new [M, N] output."""

    __slots__ = ("device", "direct", "m", "main", "n", "out_dtype", "reduce", "split_k", "swapped",
                 "ws_elems")

    def __init__(self, gemm: GemmLaunch, x_dtype: torch.dtype, x_row_stride: int):
        f = gemm.fusable
        if f is None:
            raise UnsupportedError(expect(
                "gemm", "the portable kernel's launch of a rowcol int8 x int8 or fp8 x fp8 problem "
                "with per-token activation scales, row-major activations and no acc", "another launch"))
        if x_dtype not in _X_TYPES:
            raise DTypeError(expect("x", "dtype bfloat16 or float16", x_dtype))
        consts = specialization(f.spec, f.cfg, f.interpreted, b_scale_unit_n=f.b_scale_unit_n,
                                pdl=f.pdl, fused_x=_X_TYPES[x_dtype])
        ints, dtypes = list(f.ints), list(f.dtypes)
        x_arg = 1 if gemm.swapped else 0  # the kernel operand holding the activations
        ints[3 + x_arg] = x_row_stride  # (km, kn, k, lda, ldb, ...)
        dtypes[x_arg] = x_dtype
        dtypes[3 + x_arg] = None  # their scale is computed in the kernel: no pointer
        self.main = KernelCall(_THIS, "_gemm_kernel", f.grid, tuple(ints), dict(f.options, **consts),
                               tuple(dtypes))
        self.reduce, self.swapped, self.split_k = gemm.reduce, gemm.swapped, gemm.split_k
        self.ws_elems = gemm.ws_shape[0] * gemm.ws_shape[1] * gemm.ws_shape[2]
        self.m, self.n, self.out_dtype, self.device = gemm.m, gemm.n, gemm.out_dtype, gemm.device
        self.direct = gemm.direct

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        if w_scale.dtype is not torch.float32:
            w_scale = w_scale.float()
        if bias is not None and bias.dtype is not torch.float32:
            bias = bias.float()
        out = torch.empty(self.m, self.n, dtype=self.out_dtype, device=self.device)
        direct = self.direct and direct_launch_enabled()
        target = out
        if self.split_k > 1:
            if direct:
                target = buffers._stream_workspace(self.device, self.ws_elems)
            else:
                target = buffers._workspace(self.device, self.ws_elems)
        if self.swapped:
            self.main((w, x, target, w_scale, None, bias, None), direct)
        else:
            self.main((x, w, target, None, w_scale, bias, None), direct)
        if self.reduce is not None:
            self.reduce((target, out), direct)
        return out
