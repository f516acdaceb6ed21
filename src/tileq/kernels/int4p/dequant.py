"""Prefill on prepacked int4 weights: dequantize the weight to bf16/fp16 once per call, then run
the matrix product on cuBLAS; and the dequantize kernel itself, which ``fp8_prefill.py`` also
uses (the int4 values alone as fp8).

Writing the dequantized weight (2 bytes per value) and reading it back costs about as much as one
bf16 product at M of a few hundred tokens, and little at M in the thousands. The plan
(``tileq.dispatch.prepacked``: path ``dequant+cublas``) gives W4A16 prefill calls this path where the
Gluon prefill kernel (``prefill_launch.py``) does not take them, and the Gluon launch falls back to
it for operands TMA cannot read. The kernel moves 3.4 TB/s (int4 read + bf16 written) on an H200.
The dequantized weight lives only for the call (from torch's caching allocator): N x K x 2 bytes,
356 MB for a 34816 x 5120 weight.

Precision: each weight becomes v * scale rounded to the 16-bit type (the fused kernel keeps v
exact and scales each 128-wide partial sum in fp32), products accumulate in fp32 in cuBLAS,
the output is rounded to the 16-bit type before the activation scale, bias and cast.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from ..._runtime import bounded_put, interpreter_active
from ..direct import KernelCall, direct_launch_enabled
from ...prepacked import BLOCK_K

# Weight rows per program (one 512 block of K each) by output bytes per value: 32 KB of output.
_ROWS = {2: 32, 1: 64}
_WARPS = 8


@triton.jit
def _store(v, k0, rn64, n_ok, out_ptr, K, OUT: tl.constexpr):
    """out[rn, k0 : k0 + 64] = v [ROWS, 64] in the output type (rows past N and k past K masked)."""
    kk = k0 + tl.arange(0, 64)
    dst = out_ptr + rn64[:, None] * K + kk[None, :]
    mask = n_ok[:, None] & (kk < K)[None, :]
    if OUT == "fp16":
        tl.store(dst, v.to(tl.float16), mask=mask)
    elif OUT == "fp8":
        tl.store(dst, v.to(tl.float8e4nv), mask=mask)
    elif OUT == "bf8":
        tl.store(dst, v.to(tl.float8e5), mask=mask)
    else:
        tl.store(dst, v.to(tl.bfloat16), mask=mask)


@triton.jit
def _slice_fp32(w, whi, q: tl.constexpr, zero, scale, k0, rn64, n_ok, sw_ptr, stride_sw_g, stride_sw_n,
                out_ptr, K, W_SCALE: tl.constexpr, GROUP_K: tl.constexpr, ROWS: tl.constexpr,
                OUT: tl.constexpr):
    """The 64 values k0 + [0, 64) of one half of the block (k0 = 512 b + 256 h + 64 q) in fp32,
    times the scale: nibble q of the words w [ROWS, 32] (h's words, k = k0 + 2 p) and of
    whi = w >> 16 (nibble q + 4: k = k0 + 2 p + 1).

    The nibble at bits 4q, OR-ed into the mantissa of 2^(23 - 4q), makes the float 2^(23 - 4q) +
    nibble (one LOP3: the mask an immediate, the exponent in a register); one FADD leaves v
    exactly, one FMUL and one rounding to the output type, as v.float() * scale."""
    MAGIC: tl.constexpr = (150 - 4 * q) << 23
    SUB: tl.constexpr = float(2 ** (23 - 4 * q) + 8)
    # zero is 0 at run time but unknown to the compiler: the exponent stays in a register and
    # mask-and-OR is one LOP3 (two immediates would take two).
    magic = zero + MAGIC
    lo = ((w & (15 << (4 * q))) | magic).to(tl.float32, bitcast=True) - SUB
    hi = ((whi & (15 << (4 * q))) | magic).to(tl.float32, bitcast=True) - SUB
    v = tl.reshape(tl.join(lo, hi), (ROWS, 64))  # k0 + 2 p + r
    if W_SCALE == "group" and GROUP_K % 64 != 0:  # (not from linear_prepacked) a scale per element
        kk = k0 + tl.arange(0, 64)
        v = v * tl.load(sw_ptr + (kk // GROUP_K).to(tl.int64)[None, :] * stride_sw_g + rn64[:, None] * stride_sw_n,
                        mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
    elif W_SCALE != "none":
        v = v * scale
    _store(v, k0, rn64, n_ok, out_ptr, K, OUT)


@triton.jit
def _slice_fp16(w, q: tl.constexpr, zero, k0, rn64, n_ok, out_ptr, K, ROWS: tl.constexpr,
                OUT: tl.constexpr):
    """The 64 values k0 + [0, 64) (k0 = 512 b + 256 h + 64 q) unscaled, as fp16 pairs: each word
    holds k0 + 2 p at nibble q (bits 4q) and k0 + 2 p + 1 at nibble q + 4 (bits 16 + 4q), one
    fp16 pair after one LOP3 (nibbles into the mantissas of 2^10, or of 2^6 for the upper
    nibble of a byte), one packed subtraction, exact; fp8 takes them with one conversion per
    pair."""
    if q >= 2:
        w = w >> 8
    QQ: tl.constexpr = q % 2
    MAGIC: tl.constexpr = (25 - 4 * QQ) << 10
    SUB: tl.constexpr = float(2 ** (10 - 4 * QQ) + 8)
    t = (w & (0x000F000F << (4 * QQ))) | (zero + (MAGIC | (MAGIC << 16)))
    lo = t.to(tl.int16).to(tl.float16, bitcast=True) - SUB
    hi = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True) - SUB
    v = tl.reshape(tl.join(lo, hi), (ROWS, 64))
    _store(v, k0, rn64, n_ok, out_ptr, K, OUT)


@triton.jit
def _dequant_kernel(w_ptr, sw_ptr, out_ptr, N, K, stride_sw_g, stride_sw_n,
                    W_SCALE: tl.constexpr, GROUP_K: tl.constexpr, ROWS: tl.constexpr,
                    OUT: tl.constexpr):
    """out[n, k] = value(n, k) * scale (W_SCALE 'none': the value alone), one [ROWS, 512] block
    per program, k in natural order.

    Element k = 256 h + 64 q + 2 p + r of a 512 block (h, r in 0..1, q in 0..3, p in 0..31)
    sits in word c = 2 p + h at nibble s = q + 4 r (``tileq.prepacked``). The block's 64 words of each row
    are one contiguous (vectorized) load; the words of half h, [ROWS, 32] over p, give the 64
    values of k slice (h, q) from nibbles q and q + 4 with the same compile-time shift and mask
    for every element, joined over r into k order: eight contiguous [ROWS, 64] stores, each
    thread's values still in the registers its words came in (no shuffles, no shared memory)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    rn = pid_n * ROWS + tl.arange(0, ROWS)
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    KW = tl.cdiv(K, 512) * 64  # words per row (K padded to 512 with zeros)
    words = tl.load(w_ptr + rn64[:, None] * KW + (b.to(tl.int64) * 64 + tl.arange(0, 64))[None, :],
                    mask=n_ok[:, None], other=0)
    w0, w1 = tl.split(tl.reshape(words, (ROWS, 32, 2)))  # words 2 p + h: h = 0 and h = 1
    zero = K >> 31  # K > 0: an opaque 0 (see _slice_fp32)
    kb = b * 512
    scale = 1.0
    if W_SCALE == "vector":
        scale = tl.load(sw_ptr + rn64 * stride_sw_n, mask=n_ok, other=0.0)[:, None]
    elif W_SCALE == "scalar":
        scale = tl.load(sw_ptr)
    elif W_SCALE == "group" and GROUP_K % 64 == 0:  # (linear_prepacked: a multiple of 128)
        scale = tl.load(sw_ptr + (kb // GROUP_K).to(tl.int64) * stride_sw_g + rn64 * stride_sw_n,
                        mask=n_ok, other=0.0)[:, None]
    for h in tl.static_range(2):
        w = w0 if h == 0 else w1
        for q in tl.static_range(4):
            o = 256 * h + 64 * q
            if W_SCALE == "none" and OUT != "bf16":
                _slice_fp16(w, q, zero, kb + o, rn64, n_ok, out_ptr, K, ROWS, OUT)
            else:
                # A 64-wide slice is in one group: the next one where a group may start (o a
                # multiple of gcd(GROUP_K, 512)). Groups past K are not there (masked).
                if W_SCALE == "group" and GROUP_K % 64 == 0 and o > 0 and (GROUP_K % 128 != 0 or (
                        o % 128 == 0 and (GROUP_K % 256 != 0 or (o % 256 == 0 and GROUP_K % 512 != 0)))):
                    scale = tl.load(sw_ptr + ((kb + o) // GROUP_K).to(tl.int64) * stride_sw_g
                                    + rn64 * stride_sw_n, mask=n_ok & (kb + o < K), other=0.0)[:, None]
                _slice_fp32(w, w >> 16, q, zero, scale, kb + o, rn64, n_ok, sw_ptr, stride_sw_g, stride_sw_n,
                            out_ptr, K, W_SCALE, GROUP_K, ROWS, OUT)


def compile_sm90(dtype: torch.dtype, w_kind: str, group_k: int = 128, n: int = 5120, k: int = 5120):
    """The kernel for sm_90 with Triton's own toolchain (no GPU), specialized as the JIT
    specializes ``dequantize_prepacked``'s launch for aligned tensors of N x K with scales as
    ``linear_prepacked`` passes them (group scales [K / group_k, N] contiguous): integer arguments
    equal to 1 are constants, multiples of 16 marked so. For the build checks."""
    import triton
    from triton.backends.compiler import GPUTarget

    out = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float8_e4m3fn: "*fp8e4nv",
           torch.float8_e5m2: "*fp8e5"}[dtype]
    strides = {"group": (n, 1), "vector": (0, 1)}.get(w_kind, (0, 0))
    ints = dict(N=n, K=k, stride_sw_g=strides[0], stride_sw_n=strides[1])
    sig = {"w_ptr": "*i32", "sw_ptr": "constexpr" if w_kind == "none" else "*fp32", "out_ptr": out}
    sig.update({name: "constexpr" if v == 1 else "i32" for name, v in ints.items()})
    consts = {name: 1 for name, v in ints.items() if v == 1}
    consts.update(W_SCALE=w_kind, GROUP_K=group_k, ROWS=_ROWS[dtype.itemsize], OUT=_OUT[dtype])
    if w_kind == "none":
        consts["sw_ptr"] = None
    sig.update({name: "constexpr" for name in consts if name not in sig})
    order = list(sig)
    aligned = [name for name, ty in sig.items() if ty.startswith("*")]
    aligned += [name for name, v in ints.items() if v != 1 and v % 16 == 0]
    attrs = {(order.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = triton.compiler.ASTSource(fn=_dequant_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=_WARPS))


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
        rows = _ROWS[dtype.itemsize]
        grid = (-(-n // rows), -(-k // BLOCK_K))
        call = KernelCall(sys.modules[__name__], "_dequant_kernel", grid,
                          (n, k, sw_strides[0], sw_strides[1]),
                          dict(W_SCALE=w_kind, GROUP_K=group_k, ROWS=rows, OUT=_OUT[dtype], num_warps=_WARPS),
                          (torch.int32, None if w_scale is None else torch.float32, dtype))
        bounded_put(_CALLS, key, call, 1024)
    call((wdata, w_scale, out), wdata.device.type == "cuda" and not interpreted and direct_launch_enabled())
    return out


class DequantLaunch:
    """The prefill path for one call signature, called like ``launch.Int4pLaunch``:
    y = x @ dequant(W)^T on cuBLAS for x [M, K] (16-bit, or fp8 converted exactly to bf16),
    then * x_scale rows, + bias, cast (the epilogue order of docs/schemes.md section 1)."""

    name = "dequant+cublas"
    untraced, counters = None, 0  # (``direct``'s statements: a plain kernel and torch's product)

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
