"""Decode attention (one query token per sequence) over a KV cache, split over the keys
("flash-decoding"), in two launches.

At one query token, attention has little parallel work for a GPU if each program takes a whole
cache row (batch x heads programs on 132 SMs), while the work itself is reading K and V once.
Here the keys are cut into contiguous ranges, one program per (batch, kv head, range), the number
of ranges from ``dispatch/attention.py``:

1. ``_decode_attention_kernel`` loads the G = Hq / Hkv query heads that share its kv head once (a
   tile of ``BLOCK_G`` >= 16 rows, the least ``tl.dot`` takes; padded rows are zeros, never
   stored), streams its range of K and V in blocks of ``BLOCK_N`` positions (masked loads: a
   position past the cache or whose mask is False is never read), and keeps an online softmax in
   fp32 (base 2: log2(e) folded into the scale). It writes its partial result unnormalized: the
   running max m, the sum l of exp2(s - m) and acc = sum exp2(s - m) v, per query head.
2. ``_decode_attention_combine_kernel``, one program per (batch, query head), rescales the ranges'
   partials to their common max and writes acc / l in q's dtype to the output [B, 1, Hq, D]
   (what transformers' ``sdpa_attention_forward`` returns).

A query head with no attended key at all (its mask row all False, or no keys) gets zeros, as
torch's ``scaled_dot_product_attention`` gives for a fully masked bool row (torch 2.13). Q @ K and
P @ V run on tensor cores in q's dtype with fp32 accumulation; P is rounded to that dtype for its
product with V (as FlashAttention does), everything else is fp32.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .act_quant_kernel import _round_to, _to_f32
from .direct import KernelCall, direct_launch_enabled
from .pdl import wait_upstream

_THIS = sys.modules[__name__]  # KernelCall looks the kernels up here at call time

MIN_DOT_ROWS = 16  # tl.dot's smallest M: the query heads of one kv head are padded to it
HEAD_DIMS = (64, 128, 256)  # a query tile [BLOCK_G, D] and the fp32 accumulator stay in registers
# Query heads per kv head: tiles of up to 32 rows run mma.sync with the shared-memory layout
# dispatch/attention.py assumes (64 rows take wgmma, whose layout takes more).
MAX_GROUP = 32
# The combine kernel reads this many ranges' partials per step ([16, D] fp32: 16 values per
# thread at D = 128 with 4 warps), however many ranges there are.
COMBINE_BLOCK_S = 16
_LOG2E = 1.4426950408889634
_X_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def group_tile(group: int) -> int:
    """BLOCK_G: the query heads of one kv head padded to a power of two of at least MIN_DOT_ROWS."""
    return max(MIN_DOT_ROWS, triton.next_power_of_2(group))


@triton.jit
def _dot(a, b, INTERPRETED: tl.constexpr):
    """a @ b in fp32 from 16-bit operands."""
    if INTERPRETED:
        # Triton 3.6's interpreter multiplies bf16 operands' raw bits (numpy has no bf16): fp32
        # operands holding the same values give the exact products the GPU's mma forms.
        return tl.dot(_to_f32(a, INTERPRETED), _to_f32(b, INTERPRETED), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, ws_ptr,
    qk_scale, L, SPAN, HKV, STATS,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_mb, stride_ml,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    X_TYPE: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (B * HKV, S): program (r, s) takes kv head h = r % HKV of sequence b = r // HKV, its
    query heads h * G .. h * G + G - 1 (transformers' ``repeat_kv`` order), and key positions
    [s * SPAN, min((s + 1) * SPAN, L)) (SPAN a multiple of BLOCK_N; a range past L is empty).
    ``qk_scale`` is the softmax scale times log2(e). Writes, per query head row = b * HQ + head,
    acc to ws[(row * S + s) * D ...] and (m, l) to ws[STATS + (row * S + s) * 2 ...]."""
    if PDL:
        wait_upstream()
    r = tl.program_id(0)
    s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = (r // HKV).to(tl.int64)
    h = (r % HKV).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    real = g < G
    heads = h * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=real[:, None], other=0.0)
    scale = tl.cast(qk_scale, tl.float32)  # (a traced launch passes a Python float as fp64)
    k_row = k_ptr + b * stride_kb + h * stride_kh
    v_row = v_ptr + b * stride_vb + h * stride_vh
    start = s * SPAN
    end = tl.minimum(start + SPAN, L)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < end
        if HAS_MASK:
            attend = tl.load(mask_ptr + b * stride_mb + n.to(tl.int64) * stride_ml, mask=live, other=0)
            live = live & (attend != 0)
        pos = n.to(tl.int64)[:, None]
        k = tl.load(k_row + pos * stride_kl + d[None, :], mask=live[:, None], other=0.0)
        sc = _dot(q, tl.trans(k), INTERPRETED) * scale
        sc = tl.where(live[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        # A row with nothing attended yet keeps m = -inf: shift by 0 there (exp2(-inf) = 0), never
        # by -inf (-inf - -inf is NaN).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - shift)
        p = tl.math.exp2(sc - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_row + pos * stride_vl + d[None, :], mask=live[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(_round_to(p, X_TYPE, INTERPRETED), v, INTERPRETED)
        m_i = m_new
    row = b * (HKV * G) + heads
    part = row * n_splits + s
    tl.store(ws_ptr + part[:, None] * D + d[None, :], acc, mask=real[:, None])
    tl.store(ws_ptr + STATS + part * 2, m_i, mask=real)
    tl.store(ws_ptr + STATS + part * 2 + 1, l_i, mask=real)


@triton.jit
def _decode_attention_combine_kernel(ws_ptr, o_ptr, S, STATS, D: tl.constexpr, BLOCK_S: tl.constexpr,
                                     X_TYPE: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (B * HQ,): program row sums the S ranges' partials of query head row (b * HQ + head)
    into o[row * D ...] (the output [B, 1, HQ, D] contiguous): sum_s w_s acc_s / sum_s w_s l_s,
    w_s = exp2(m_s - max m); zeros where no range attended any key (every m_s = -inf)."""
    if PDL:
        wait_upstream()
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    stats = ws_ptr + STATS + row * S * 2
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        top = tl.maximum(top, tl.load(stats + s * 2, mask=s < S, other=float("-inf")))
    m = tl.max(top, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = s < S
        w = tl.math.exp2(tl.load(stats + s * 2, mask=ok, other=float("-inf")) - shift)
        total += w * tl.load(stats + s * 2 + 1, mask=ok, other=0.0)
        part = tl.load(ws_ptr + (row * S + s)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    denom = tl.sum(total, 0)
    out = tl.where(denom > 0, acc / tl.where(denom > 0, denom, 1.0), 0.0)
    tl.store(o_ptr + row * D + d, _round_to(out, X_TYPE, INTERPRETED))


class DecodeAttentionLaunch:
    """``tileq.attention.decode_attention`` for one call signature: allocates the output and the
    split workspace, launches the split kernel and the combine kernel."""

    __slots__ = ("split", "combine", "direct", "out_shape", "ws_numel", "dtype", "device")

    def __init__(self, *, batch: int, q_heads: int, kv_heads: int, head_dim: int, length: int,
                 q_strides: tuple, k_strides: tuple, v_strides: tuple, mask_strides: tuple | None,
                 scaling: float, dtype, device, interpreted: bool, block_n: int, splits: int, num_warps: int,
                 num_stages: int, pdl: bool):
        group = q_heads // kv_heads
        self.out_shape = (batch, 1, q_heads, head_dim)
        self.dtype, self.device = dtype, device
        rows = batch * q_heads
        stats = rows * splits * head_dim  # the (m, l) pairs follow the accumulators in one workspace
        self.ws_numel = stats + rows * splits * 2
        pdl = dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)
        has_mask = mask_strides is not None
        types = dict(X_TYPE=_X_TYPES[dtype], INTERPRETED=interpreted)
        consts = dict(G=group, BLOCK_G=group_tile(group), D=head_dim, BLOCK_N=block_n, HAS_MASK=has_mask, **types,
                      num_warps=num_warps, num_stages=num_stages, **pdl)
        ints = ((float(scaling) * _LOG2E, length, _span(length, splits, block_n), kv_heads, stats)
                + tuple(q_strides) + tuple(k_strides) + tuple(v_strides)
                + (tuple(mask_strides) if has_mask else (0, 0)))
        dtypes = (dtype, dtype, dtype, torch.bool if has_mask else None, torch.float32)
        self.split = KernelCall(_THIS, "_decode_attention_kernel", (batch * kv_heads, splits), ints, consts, dtypes)
        block_s = min(COMBINE_BLOCK_S, triton.next_power_of_2(splits))
        self.combine = KernelCall(_THIS, "_decode_attention_combine_kernel", (rows,), (splits, stats),
                                  dict(D=head_dim, BLOCK_S=block_s, **types, num_warps=4, num_stages=1, **pdl),
                                  (torch.float32, dtype))
        self.direct = device.type == "cuda" and not interpreted

    def __call__(self, q, keys, values, mask):
        direct = self.direct and direct_launch_enabled()
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        ws = torch.empty(self.ws_numel, dtype=torch.float32, device=self.device)
        self.split((q, keys, values, mask, ws), direct)
        self.combine((ws, out), direct)
        return out


def _span(length: int, splits: int, block_n: int) -> int:
    """Key positions per range: the blocks shared out evenly, whole blocks per range."""
    blocks = -(-length // block_n)
    return max(1, -(-blocks // splits)) * block_n


# ----------------------------------------------------------------------------- reference


def decode_attention_ref(q, keys, values, mask, scaling: float):
    """The same attention with torch operations in float32: q [B, HQ, 1, D], keys / values
    [B, HKV, L, D] (query head j reads kv head j // (HQ / HKV)), mask None or bool
    [B or 1, 1, 1, L] (True: attend). Returns [B, 1, HQ, D] in q's dtype; a query head with no
    attended key gets zeros. Keys and values at positions not attended contribute nothing, whatever
    they hold (the kernel never reads them)."""
    b, hq, _, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    qf = q.float().reshape(b, hkv, hq // hkv, d)
    if mask is None:
        attend = torch.ones(b, length, dtype=torch.bool, device=q.device)
    else:
        attend = mask.reshape(mask.shape[0], length).expand(b, length)
    kf = keys.float().masked_fill(~attend[:, None, :, None], 0.0)
    vf = values.float().masked_fill(~attend[:, None, :, None], 0.0)
    scores = torch.einsum("bhgd,bhld->bhgl", qf, kf) * scaling
    scores = scores.masked_fill(~attend[:, None, None, :], float("-inf"))
    any_key = attend.any(-1)[:, None, None, None]
    p = torch.where(any_key, torch.softmax(torch.where(any_key, scores, 0.0), -1), 0.0)
    out = torch.einsum("bhgl,bhld->bhgd", p, vf)
    return out.reshape(b, 1, hq, d).to(q.dtype)
