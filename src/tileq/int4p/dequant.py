"""Prefill on prepacked int4 weights: dequantize the weight to bf16/fp16 once per call, then run
the matrix product on cuBLAS.

At prefill sizes the fused kernel (``kernel.py``) converts every weight once per 16-32 tokens
and runs at about a third of bf16 cuBLAS's speed (bench/results/h200/int4.md). Writing the
dequantized weight (2 bytes per value) and reading it back costs about as much as one bf16
product at M of a few hundred tokens, and nothing at M in the thousands, so above
``DEQUANT_MIN_M`` tokens ``linear_prepacked`` takes this path (named ``dequant+cublas`` in
``describe_prepacked``). The dequantized weight lives only for the call (from torch's caching
allocator): N x K x 2 bytes, 356 MB for a 34816 x 5120 weight.

Precision: each weight becomes v * scale rounded to the 16-bit type (the fused kernel keeps v
exact and scales each 128-wide partial sum in fp32), products accumulate in fp32 in cuBLAS,
the output is rounded to the 16-bit type before the activation scale, bias and cast.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .._runtime import bounded_put, interpreter_active
from ..kernels.direct import KernelCall, direct_launch_enabled
from .layout import BLOCK_K

DEQUANT_MIN_M = 256
_ROWS = 16  # weight rows per program


@triton.jit
def _dequant_kernel(w_ptr, sw_ptr, out_ptr, N, K, stride_sw_g, stride_sw_n,
                    W_SCALE: tl.constexpr, GROUP_K: tl.constexpr, ROWS: tl.constexpr,
                    OUT: tl.constexpr):
    """out[n, k] = value(n, k) * scale (W_SCALE 'none': the value alone), one [ROWS, 512] block
    per program, k in natural order.

    Element k of a 512 block sits in word c = 2 ((k % 64) // 2) + k // 256 at nibble
    s = (k % 256) // 64 + 4 (k % 2) (layout.py's table, inverted). Each word is gathered by the
    eight threads that need it (L1 hits); the stores are contiguous."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    rn = pid_n * ROWS + tl.arange(0, ROWS)
    kl = tl.arange(0, 512)
    c = 2 * ((kl % 64) // 2) + kl // 256
    s = (kl % 256) // 64 + 4 * (kl % 2)
    n_ok = rn < N
    k = b * 512 + kl
    k_ok = k < K
    KW = tl.cdiv(K, 512) * 64
    rn64 = rn.to(tl.int64)
    words = tl.load(w_ptr + rn64[:, None] * KW + (b * 64 + c)[None, :], mask=n_ok[:, None], other=0)
    v = (((words >> (4 * s)[None, :]) & 15) - 8).to(tl.float32)
    if W_SCALE == "group":
        sw = tl.load(sw_ptr + (k // GROUP_K)[None, :] * stride_sw_g + rn[:, None] * stride_sw_n,
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        v = v * sw
    elif W_SCALE == "vector":
        v = v * tl.load(sw_ptr + rn * stride_sw_n, mask=n_ok, other=0.0)[:, None]
    elif W_SCALE == "scalar":
        v = v * tl.load(sw_ptr)
    dst = out_ptr + rn64[:, None] * K + k[None, :]
    mask = n_ok[:, None] & k_ok[None, :]
    if OUT == "fp16":
        tl.store(dst, v.to(tl.float16), mask=mask)
    elif OUT == "fp8":
        tl.store(dst, v.to(tl.float8e4nv), mask=mask)
    elif OUT == "bf8":
        tl.store(dst, v.to(tl.float8e5), mask=mask)
    else:
        tl.store(dst, v.to(tl.bfloat16), mask=mask)


_CALLS: dict = {}


_OUT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "bf8"}


def dequantize_prepacked(wdata: torch.Tensor, n: int, k: int, w_scale: torch.Tensor | None, w_kind: str,
                         sw_strides, group_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight [N, K] in ``dtype`` (bf16 or fp16), value times its scale, from a
    PrepackedInt4's words ``wdata`` (logical shape n x k); w_scale fp32 as ``linear_prepacked``
    normalized it (``w_kind`` 'group' | 'vector' | 'scalar', its strides). ``w_kind`` 'none'
    (``w_scale`` None) writes the values alone, which fp8 ``dtype`` (e4m3 or e5m2) holds exactly
    (-8..7)."""
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if dtype not in _OUT or (w_kind == "none") != (w_scale is None) or (fp8 and w_kind != "none"):
        # (fp8 holds the values exactly, not value x scale)
        raise ValueError(f"dequantize_prepacked: dtype {dtype} with w_kind {w_kind!r}")
    out = torch.empty(n, k, dtype=dtype, device=wdata.device)
    if n == 0 or k == 0:
        return out
    interpreted = interpreter_active()
    key = (n, k, w_kind, tuple(sw_strides), group_k, dtype, wdata.device, interpreted)
    call = _CALLS.get(key)
    if call is None:
        grid = (-(-n // _ROWS), -(-k // BLOCK_K))
        call = KernelCall(sys.modules[__name__], "_dequant_kernel", grid,
                          (n, k, sw_strides[0], sw_strides[1]),
                          dict(W_SCALE=w_kind, GROUP_K=group_k, ROWS=_ROWS, OUT=_OUT[dtype], num_warps=8),
                          (torch.int32, None if w_scale is None else torch.float32, dtype))
        bounded_put(_CALLS, key, call, 1024)
    call((wdata, w_scale, out), wdata.device.type == "cuda" and not interpreted and direct_launch_enabled())
    return out


class DequantLaunch:
    """The prefill path for one call signature, called like ``launch.Int4pLaunch``:
    y = x @ dequant(W)^T on cuBLAS for x [M, K] (16-bit, or fp8 converted exactly to bf16),
    then * x_scale rows, + bias, cast (DESIGN.md's epilogue order)."""

    name = "dequant+cublas"

    def __init__(self, n, k, w_kind, x_kind, sw_strides, group_k, out_dtype, x_dtype):
        self.n, self.k, self.w_kind, self.x_kind = n, k, w_kind, x_kind
        self.sw_strides, self.group_k, self.out_dtype = sw_strides, group_k, out_dtype
        self.ct = x_dtype if x_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16

    def __call__(self, x2, wdata, sx, sw, bias, out=None) -> torch.Tensor:
        wd = dequantize_prepacked(wdata, self.n, self.k, sw, self.w_kind, self.sw_strides, self.group_k, self.ct)
        y = torch.matmul(x2.to(self.ct), wd.t())
        del wd
        if self.x_kind != "none" or bias is not None or self.out_dtype != self.ct:
            y = y.float()
            if self.x_kind == "vector":
                y *= sx.reshape(-1, 1)
            elif self.x_kind == "scalar":
                y *= sx.reshape(())
            if bias is not None:
                y += bias
        if out is not None:
            out.copy_(y)
            return out
        return y.to(self.out_dtype)
