"""The q/k preparation of an attention layer in one kernel: from a merged q/k/v projection's output,
each q and k head's RMSNorm (Qwen3's ``q_norm`` / ``k_norm``; optional) and the rotary embedding,
written as transformers computes them (``apply_rotary_pos_emb`` with ``rotate_half``), and
optionally k and v written into a static KV cache as transformers' ``StaticLayer.update`` writes
them (its arange, two adds and two ``index_copy_`` launches become one ``add_``).

Eagerly, transformers spends about 25 small ATen launches per layer on this (two RMSNorms of
eight operations, the rotation's slices, concatenations, products and sums), each a few
microseconds of host time; here it is one launch. Every step rounds where transformers' does:
the norm as ``_rms_scaled`` (``act_quant_kernel``: fp32 statistics, 1 / sqrt rounded to nearest,
the normalized value rounded to x's dtype, then times the weight, rounded), the rotation as three
x-dtype operations (``x * cos``, ``rotate_half(x) * sin``, their sum, each rounded). Without the
norm the result equals transformers' bit for bit; with it, it may differ where torch's
approximate GPU ``rsqrt`` and the summation order move a rounding (an ulp of a normalized value,
carried through the rotation).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .act_quant import rms_normalize_ref
from .act_quant_kernel import _rms_scaled, _round_to, _to_f32
from .direct import KernelCall, direct_launch_enabled
from .pdl import wait_upstream

_THIS = sys.modules[__name__]  # KernelCall looks the kernel up here at call time
_X_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@triton.jit
def _mul(a, b, INTERPRETED: tl.constexpr):
    # mul.rn / add.rn are never contracted: with plain operators LLVM turns round(x * cos) +
    # round(r * sin) into one bf16 fma, rounding once where torch rounds three times (and
    # libdevice's __fmul_rn flushes subnormals here).
    if INTERPRETED:
        return a * b
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _add(a, b, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return a + b
    else:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _rotated(row, qw_ptr, kw_ptr, cos_row, sin_row, eps, is_q, D: tl.constexpr, NORM: tl.constexpr,
             X_TYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """One q or k head (``row``: its D values) normalized (NORM) and rotated, in fp32:
    x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]), each product and the
    sum rounded to x's dtype as torch rounds them (the sum's rounding is the caller's)."""
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, D)
    j = (i + HALF) % D  # the partner element rotate_half brings to position i
    x = tl.load(row + i)
    xp = tl.load(row + j)
    if NORM:
        xf = _to_f32(x, INTERPRETED)
        sumsq = tl.sum(xf * xf, 0)
        var = tl.math.div_rn(sumsq, D * 1.0)
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + tl.cast(eps, tl.float32)))
        # q heads take q_norm's weight, k heads k_norm's (both loaded: a pointer select per head
        # would need a branch per program; D values are one cache line pair).
        ok = tl.full([D], 1, tl.int1)
        xq = _rms_scaled(x, rstd, qw_ptr, i, ok, X_TYPE, INTERPRETED)
        xk = _rms_scaled(x, rstd, kw_ptr, i, ok, X_TYPE, INTERPRETED)
        pq = _rms_scaled(xp, rstd, qw_ptr, j, ok, X_TYPE, INTERPRETED)
        pk = _rms_scaled(xp, rstd, kw_ptr, j, ok, X_TYPE, INTERPRETED)
        x = tl.where(is_q, xq, xk)
        xp = tl.where(is_q, pq, pk)
    c = _to_f32(tl.load(cos_row + i), INTERPRETED)
    s = _to_f32(tl.load(sin_row + i), INTERPRETED)
    xf = _to_f32(x, INTERPRETED)
    pf = _to_f32(xp, INTERPRETED)
    pf = tl.where(i < HALF, -pf, pf)  # negation is exact
    a = _to_f32(_round_to(_mul(xf, c, INTERPRETED), X_TYPE, INTERPRETED), INTERPRETED)
    rot = _to_f32(_round_to(_mul(pf, s, INTERPRETED), X_TYPE, INTERPRETED), INTERPRETED)
    return _add(a, rot, INTERPRETED)


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, kc_ptr, vc_ptr, len_ptr,
    eps, T, HQ, HKV, L, stride_xb, stride_xt, stride_cb, stride_ct,
    D: tl.constexpr, NORM: tl.constexpr, CACHE: tl.constexpr, X_TYPE: tl.constexpr,
    INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (B * T, HQ + HKV), with CACHE (B * T, HQ + 2 * HKV): program (r, h) takes head h of
    token r = b * T + t of x (q heads, then k heads, then v heads). q heads are normalized (NORM),
    rotated (``_rotated``) and stored to q [B, T, HQ, D] (contiguous). k heads likewise, to k
    [B, T, HKV, D], or with CACHE into the static cache kc [B, HKV, L, D] at position
    p = length + t (``len_ptr``: the cache's length before this call, read on the device), where
    the v heads are copied too (vc, same layout). A position past the cache (p >= L) is written
    nowhere and makes that token's q NaN, so the attention's output shows it."""
    if PDL:
        wait_upstream()
    r = tl.program_id(0)
    h = tl.program_id(1)
    b = (r // T).to(tl.int64)
    t = (r % T).to(tl.int64)
    i = tl.arange(0, D)
    row = x_ptr + b * stride_xb + t * stride_xt + h * D
    cos_row = cos_ptr + b * stride_cb + t * stride_ct
    sin_row = sin_ptr + b * stride_cb + t * stride_ct
    q_out = q_ptr + (r.to(tl.int64) * HQ + h) * D + i
    is_q = h < HQ
    if CACHE:
        p = tl.load(len_ptr) + t
        fits = p < L
        if h >= HQ + HKV:
            kv = (b * HKV + (h - HQ - HKV)) * L + p
            tl.store(vc_ptr + kv * D + i, tl.load(row + i), mask=(i < D) & fits)
        else:
            out = _rotated(row, qw_ptr, kw_ptr, cos_row, sin_row, eps, is_q, D, NORM, X_TYPE, INTERPRETED)
            nan = tl.full([D], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
            out = _round_to(tl.where(fits, out, nan), X_TYPE, INTERPRETED)
            kv = (b * HKV + (h - HQ)) * L + p
            tl.store(q_out, out, mask=(i < D) & is_q)
            tl.store(kc_ptr + kv * D + i, out, mask=(i < D) & (h >= HQ) & fits)
    else:
        out = _round_to(_rotated(row, qw_ptr, kw_ptr, cos_row, sin_row, eps, is_q, D, NORM, X_TYPE, INTERPRETED),
                        X_TYPE, INTERPRETED)
        tl.store(q_out, out, mask=(i < D) & is_q)
        tl.store(k_ptr + (r.to(tl.int64) * HKV + (h - HQ)) * D + i, out, mask=(i < D) & (h >= HQ))


class QkNormRopeLaunch:
    """``tileq.qk_rope.qk_norm_rope`` for one call signature: allocates q (and k without a cache),
    launches once."""

    __slots__ = ("call", "direct", "q_shape", "k_shape", "dtype", "device", "cached")

    def __init__(self, *, batch: int, tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                 x_strides: tuple, cs_strides: tuple, dtype, device, norm: bool, eps: float,
                 interpreted: bool, pdl: bool, cache_len: int = 0):
        self.q_shape = (batch, tokens, q_heads, head_dim)
        self.k_shape = (batch, tokens, kv_heads, head_dim)
        self.dtype, self.device, self.cached = dtype, device, cache_len > 0
        pdl = dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)
        # One warp per 128 values: a head is a row of D (64-256) values.
        consts = dict(D=head_dim, NORM=norm, CACHE=self.cached, X_TYPE=_X_TYPES[dtype], INTERPRETED=interpreted,
                      num_warps=max(1, head_dim // 128), num_stages=1, **pdl)
        ints = (float(eps), tokens, q_heads, kv_heads, cache_len) + tuple(x_strides) + tuple(cs_strides)
        wdt = dtype if norm else None
        cdt = dtype if self.cached else None
        dtypes = (dtype, wdt, wdt, dtype, dtype, dtype, None if self.cached else dtype, cdt, cdt,
                  torch.int64 if self.cached else None)
        heads = q_heads + (2 if self.cached else 1) * kv_heads
        self.call = KernelCall(_THIS, "_qk_norm_rope_kernel", (batch * tokens, heads), ints, consts, dtypes)
        self.direct = device.type == "cuda" and not interpreted

    def __call__(self, qkv, q_weight, k_weight, cos, sin, cache=None):
        """(q, k) as [B, H, T, D] views; with ``cache`` = (keys, values, length): writes k and v into
        it, advances length by T and returns (q, keys, values)."""
        direct = self.direct and direct_launch_enabled()
        q = torch.empty(self.q_shape, dtype=self.dtype, device=self.device)
        if self.cached:
            keys, values, length = cache
            self.call((qkv, q_weight, k_weight, cos, sin, q, None, keys, values, length), direct)
            length.add_(self.q_shape[1])  # after the kernel read it (same stream)
            return q.transpose(1, 2), keys, values
        k = torch.empty(self.k_shape, dtype=self.dtype, device=self.device)
        self.call((qkv, q_weight, k_weight, cos, sin, q, k, None, None, None), direct)
        return q.transpose(1, 2), k.transpose(1, 2)


# ----------------------------------------------------------------------------- reference


def _kernel_layout(x):
    """[B, H, T, D] as the kernel returns it: a transposed view of a contiguous [B, T, H, D] (the
    custom ops' fake implementations promise these strides whichever executor runs)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def qk_norm_rope_ref(qkv, cos, sin, q_heads: int, kv_heads: int, q_weight=None, k_weight=None,
                     eps: float = 1e-6, cache=None):
    """The same (q, k) with torch operations, transformers' formulas (RMSNorm's rsqrt taken as
    1 / sqrt, rounded to nearest, as the kernel does): q [B, HQ, T, D], k [B, HKV, T, D]. With
    ``cache`` = (keys, values, length): k and v written at positions length + t as
    ``StaticLayer.update`` writes them (positions past the cache: nothing written, q NaN), length
    advanced, (q, keys, values) returned."""
    b, t, _ = qkv.shape
    d = cos.shape[-1]
    q = qkv[..., :q_heads * d].reshape(b, t, q_heads, d)
    k = qkv[..., q_heads * d:(q_heads + kv_heads) * d].reshape(b, t, kv_heads, d)

    def norm(x, w):
        return rms_normalize_ref(x.reshape(-1, d), None, w, eps)[0].view(x.shape)

    if q_weight is not None:
        q, k = norm(q, q_weight), norm(k, k_weight)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)

    q, k = _kernel_layout(q * c + rotate_half(q) * s), _kernel_layout(k * c + rotate_half(k) * s)
    if cache is None:
        return q, k
    keys, values, length = cache
    v = qkv[..., (q_heads + kv_heads) * d:(q_heads + 2 * kv_heads) * d].reshape(b, t, kv_heads, d).transpose(1, 2)
    pos = torch.arange(t, device=length.device) + length.reshape(())
    fits = pos < keys.shape[2]
    keys[:, :, pos[fits]] = k[:, :, fits]
    values[:, :, pos[fits]] = v[:, :, fits]
    q = _kernel_layout(q.masked_fill(~fits.view(1, 1, t, 1), float("nan")))
    length.add_(t)
    return q, keys, values
