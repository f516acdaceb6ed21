"""The Triton kernel on prepacked int4 weights (layout i4p1, ``layout.py``).

It computes C^T = W X^T tile by tile: the weight is the wgmma's A operand, converted in
registers, and the activations X [M, K] (16-bit, or fp8 converted exactly to bf16) are the B
operand from shared memory, so a small M sits on wgmma's N side (swap-AB). A program owns 64
weight rows per warpgroup (BN) and BM tokens; each 512-wide K tile is four 128-wide dots, one
per group of 128 (one wgmma chain and one wait each). The words are loaded as an int32 [BN, 64]
tile whose element pairs (c, c + 1) land in one thread (the dot-operand layout, kWidth 2); one
inline-asm call per pair makes the registers of all eight 64-wide slices (see layout.py), joined
two by two into the 128-wide operands. Weight scales, per group (group_k a multiple of 128) or
per channel, are applied to each 128-wide partial sum (promotion); the rest follows the epilogue
order of docs/schemes.md section 1: ``acc -> * x_scale (tokens) -> (* a per-tensor w_scale) -> + bias -> cast``.

SPLIT_K > 1 writes fp32 partials [SPLIT_K, N, M] into ``ws_ptr``, summed in split order
(``split_k.py``): by the reduction kernel afterwards (transposed into C), or with FIXUP by the
kernel itself, the tile counters in ``sem_ptr``: one launch. Under the interpreter the conversion
runs as plain shifts and masks on the same words (Triton's interpreter has no inline PTX),
element for element the same.
"""

import triton
import triton.language as tl

from ..pdl import prefetch_l2, wait_upstream
from ..split_k import count_in, release, store_split_partial

# Two words (c even, c + 1) -> eight registers of two 16-bit values each: slice q (0..3) from
# word c, slice 4 + q from word c + 1; (w >> 4q) & 0x000F000F puts nibbles k and k + 1 in the
# two halves, OR-ing the magic exponent makes MAGIC + nibble, the subtraction leaves the value.
def _cvt_asm(magic: int, sub: str) -> str:
    """The conversion for one 16-bit type: ``magic`` its bits of 128.0 (bf16) / 1024.0 (fp16)."""
    lop = [f"lop3.b32 ${q}, {src}, 0x000F000F, 0x{magic:04X}{magic:04X}, 0xea;"
           for q, src in enumerate(("$8", "a1", "a2", "a3", "$9", "b1", "b2", "b3"))]
    subs = [f"{sub} ${q}, ${q}, m;" for q in range(8)]
    # one line: inductor writes a traced kernel's constexpr globals into its generated source as
    # single-quoted literals, where a newline would end the string
    return " ".join([
        "{", ".reg .b32 a1, a2, a3, b1, b2, b3, m;", f"mov.b32 m, 0x{magic + 8:04X}{magic + 8:04X};",
        "shr.u32 a1, $8, 4;", "shr.u32 a2, $8, 8;", "shr.u32 a3, $8, 12;",
        "shr.u32 b1, $9, 4;", "shr.u32 b2, $9, 8;", "shr.u32 b3, $9, 12;", *lop, *subs, "}"])


_CVT_BF16 = tl.constexpr(_cvt_asm(0x4300, "sub.bf16x2"))
_CVT_FP16 = tl.constexpr(_cvt_asm(0x6400, "sub.f16x2"))


@triton.jit
def _slices(w_ptrs, CT: tl.constexpr, INTERPRETED: tl.constexpr):
    """The eight [64, 64] value slices of one K tile (slice i: k in [64 i, 64 i + 64))."""
    if INTERPRETED:
        # The same nibbles with plain operations: element (n, c) of slice q is nibble q of word
        # c (c even) or nibble 4 + q of word c - 1 (c odd); slice 4 + q reads word c + 1 / c.
        c = tl.arange(0, 64)
        odd = (c % 2)[None, :]
        lo = tl.load(w_ptrs - odd)
        hi = tl.load(w_ptrs + 1 - odd)
        sh = odd * 16
        v0 = (((lo >> sh) & 15) - 8).to(tl.float32)
        v1 = (((lo >> (sh + 4)) & 15) - 8).to(tl.float32)
        v2 = (((lo >> (sh + 8)) & 15) - 8).to(tl.float32)
        v3 = (((lo >> (sh + 12)) & 15) - 8).to(tl.float32)
        v4 = (((hi >> sh) & 15) - 8).to(tl.float32)
        v5 = (((hi >> (sh + 4)) & 15) - 8).to(tl.float32)
        v6 = (((hi >> (sh + 8)) & 15) - 8).to(tl.float32)
        v7 = (((hi >> (sh + 12)) & 15) - 8).to(tl.float32)
    else:
        w = tl.load(w_ptrs)
        if CT == "fp16":
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                _CVT_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.float16,) * 8,
                is_pure=True, pack=2)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                _CVT_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=2)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _x_slice(x_ptrs, k_ok, t_ok, i: tl.constexpr, CT: tl.constexpr, EVEN_K: tl.constexpr,
             INTERPRETED: tl.constexpr):
    """The activations of 128-wide slice i of the K tile as the B operand [128, BM]."""
    if EVEN_K:
        x = tl.load(x_ptrs + 128 * i, mask=t_ok[None, :], other=0.0)
    else:  # past K: zeros (the padded weights are zero, and 0 x garbage could be NaN)
        x = tl.load(x_ptrs + 128 * i, mask=k_ok[:, None] & t_ok[None, :], other=0.0)
    if INTERPRETED:
        return x.to(tl.float32)
    return x.to(tl.bfloat16 if CT == "bf16" else tl.float16)


@triton.jit
def _dot(v, x, acc, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        # Triton 3.6's interpreter has no bf16 dot; fp32 holds the same values exactly.
        if acc is None:
            return tl.dot(v, x, input_precision="ieee", out_dtype=tl.float32)
        return tl.dot(v, x, acc, input_precision="ieee", out_dtype=tl.float32)
    if acc is None:
        return tl.dot(v, x, out_dtype=tl.float32)
    return tl.dot(v, x, acc, out_dtype=tl.float32)


@triton.jit
def _pair(a, b):
    """Two [R, 64] slices -> one [R, 128] operand, k = c + 64 j. In registers the join adds a
    register bit that becomes k's bit 6, which the dot-operand layout also keeps in registers:
    no data moves (checked on the sm_90 build: no shared-memory round trip)."""
    t = tl.join(a, b)  # [R, 64, 2]
    t = tl.permute(t, (0, 2, 1))  # [R, 2, 64]
    return tl.reshape(t, (a.shape[0], 128))


@triton.jit
def _group_scale(sw_ptr, k, K, GROUP_K: tl.constexpr, stride_sw_g, stride_sw_n, rn, n_ok):
    """The rows' scales of the group holding K index k (zeros past K: that part is zero)."""
    return tl.load(sw_ptr + (k // GROUP_K) * stride_sw_g + rn * stride_sw_n, mask=n_ok & (k < K), other=0.0)


@triton.jit
def _accumulate(acc, part, sw_ptr, sw_row, k, K, W_SCALE: tl.constexpr, GROUP_K: tl.constexpr,
                stride_sw_g, stride_sw_n, rn, n_ok, SCALE_AHEAD: tl.constexpr):
    """acc += part * the rows' scales: the group's (loaded here, or with SCALE_AHEAD the
    prefetched ``sw_row``; k past K: the part is zero), or the per-channel ones (``sw_row``,
    loaded once). Scaling per 128 of K also keeps Triton from chaining the next dot onto this
    one, which would hold its converted operands across the wait (238-255 registers against
    168). A per-tensor scale waits for the epilogue."""
    if W_SCALE == "group" and not SCALE_AHEAD:
        sw = _group_scale(sw_ptr, k, K, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok)
        return acc + part * sw[:, None]
    elif W_SCALE == "group" or W_SCALE == "vector":
        return acc + part * sw_row[:, None]
    return acc + part


@triton.jit
def _slice_dot(v, x, INTERPRETED: tl.constexpr):
    """One 128-wide dot from zero (``_accumulate`` scales and adds it)."""
    return _dot(v, x, None, INTERPRETED)


@triton.jit
def _tile_sum(w_ptr, x_ptr, sw_ptr, rn, rt, n_ok, t_ok, b0, k_end, N, K, ldx, stride_sw_g, stride_sw_n,
              CT: tl.constexpr, W_SCALE: tl.constexpr, GROUP_K: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
              STEP: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr, SCALE_AHEAD: tl.constexpr):
    """The [BN, BM] tile's fp32 sum over the 512-wide K blocks b0, b0 + STEP, ... that start below
    ``k_end``, the group or per-channel weight scales applied per 128 of K."""
    KW = tl.cdiv(K, 512) * 64  # words per weight row
    rc = tl.arange(0, 64)
    rk = tl.arange(0, 128)
    # Weight rows past N read row N - 1 instead of being masked (their results are never
    # stored; unmasked loads are plain async copies). Tokens past M stay masked: at M = 1 a
    # clamped 16-token tile would read the row 16 times (as many bytes as the weights).
    rn_ld = tl.minimum(rn, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rn_ld[:, None] * KW + (b0 * 64 + rc)[None, :]
    x_ptrs = x_ptr + rt.to(tl.int64)[None, :] * ldx + (b0 * 512 + rk)[:, None]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if W_SCALE == "vector":
        sw_row = tl.load(sw_ptr + rn_ld * stride_sw_n)
    else:
        sw_row = tl.zeros((BN,), dtype=tl.float32)
    s0 = sw_row
    s1 = sw_row
    s2 = sw_row
    s3 = sw_row
    # SCALE_AHEAD: the four group scales of a K tile loaded at the top of the iteration before
    # the one that uses them. Loaded next to their use (SCALE_AHEAD off), the eight loads of a K tile
    # are issued during its last wgmma chain and its promotions wait for them: an L2 round trip
    # per K tile (sm_90 SASS). The decode rule's choice under a 168-register cap (1.06x per config
    # on an H200, dispatch.int4._scales_ahead); the 128-register cap spills more with it (80 B
    # against 16), so capped configs load them next to their use.
    if W_SCALE == "group" and SCALE_AHEAD:
        s0 = _group_scale(sw_ptr, b0 * 512, K, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok)
        s1 = _group_scale(sw_ptr, b0 * 512 + 128, K, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok)
        s2 = _group_scale(sw_ptr, b0 * 512 + 256, K, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok)
        s3 = _group_scale(sw_ptr, b0 * 512 + 384, K, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok)
    for k0 in range(b0 * 512, k_end, 512 * STEP):
        if W_SCALE == "group" and SCALE_AHEAD:
            k_next = k0 + 512 * STEP
            n0 = _group_scale(sw_ptr, k_next, K, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok)
            n1 = _group_scale(sw_ptr, k_next + 128, K, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok)
            n2 = _group_scale(sw_ptr, k_next + 256, K, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok)
            n3 = _group_scale(sw_ptr, k_next + 384, K, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok)
        v0, v1, v2, v3, v4, v5, v6, v7 = _slices(w_ptrs, CT, INTERPRETED)
        # Four 128-wide dots, one per group of 128 (one wgmma chain and one wait each).
        x = _x_slice(x_ptrs, k0 + rk < K, t_ok, 0, CT, EVEN_K, INTERPRETED)
        p = _slice_dot(_pair(v0, v1), x, INTERPRETED)
        acc = _accumulate(acc, p, sw_ptr, s0, k0, K, W_SCALE, GROUP_K, stride_sw_g, stride_sw_n, rn, n_ok,
                          SCALE_AHEAD)
        x = _x_slice(x_ptrs, k0 + 128 + rk < K, t_ok, 1, CT, EVEN_K, INTERPRETED)
        p = _slice_dot(_pair(v2, v3), x, INTERPRETED)
        acc = _accumulate(acc, p, sw_ptr, s1, k0 + 128, K, W_SCALE, GROUP_K, stride_sw_g, stride_sw_n, rn,
                          n_ok, SCALE_AHEAD)
        x = _x_slice(x_ptrs, k0 + 256 + rk < K, t_ok, 2, CT, EVEN_K, INTERPRETED)
        p = _slice_dot(_pair(v4, v5), x, INTERPRETED)
        acc = _accumulate(acc, p, sw_ptr, s2, k0 + 256, K, W_SCALE, GROUP_K, stride_sw_g, stride_sw_n, rn,
                          n_ok, SCALE_AHEAD)
        x = _x_slice(x_ptrs, k0 + 384 + rk < K, t_ok, 3, CT, EVEN_K, INTERPRETED)
        p = _slice_dot(_pair(v6, v7), x, INTERPRETED)
        acc = _accumulate(acc, p, sw_ptr, s3, k0 + 384, K, W_SCALE, GROUP_K, stride_sw_g, stride_sw_n, rn,
                          n_ok, SCALE_AHEAD)
        if W_SCALE == "group" and SCALE_AHEAD:
            s0 = n0
            s1 = n1
            s2 = n2
            s3 = n3
        w_ptrs += 64 * STEP
        x_ptrs += 512 * STEP
    return acc


@triton.jit
def _scaled(acc, sx_ptr, sw_ptr, bias_ptr, rn, rt, n_ok, t_ok, stride_sx, with_bias, X_SCALE: tl.constexpr,
            W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The epilogue up to the cast (tile is [weight rows, tokens]): token scales, a per-tensor
    weight scale, the bias where ``with_bias`` (the part of a split holding K's first block)."""
    y = acc
    if X_SCALE == "scalar":
        y = y * tl.load(sx_ptr)
    elif X_SCALE == "vector":
        sx = tl.load(sx_ptr + rt * stride_sx, mask=t_ok, other=0.0)
        y = y * sx[None, :]
    if W_SCALE == "scalar":
        y = y * tl.load(sw_ptr)
    if HAS_BIAS:
        if with_bias:
            b = tl.load(bias_ptr + rn, mask=n_ok, other=0.0)
            y = y + b[:, None]
    return y


@triton.jit
def _i4p_kernel(
    w_ptr, x_ptr, c_ptr, sw_ptr, sx_ptr, bias_ptr, ws_ptr, sem_ptr,
    M, N, K, ldx, ldc, stride_sw_g, stride_sw_n, stride_sx,
    CT: tl.constexpr, W_SCALE: tl.constexpr, X_SCALE: tl.constexpr, GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    INTERPRETED: tl.constexpr, BN: tl.constexpr = 64, SCALE_AHEAD: tl.constexpr = False,
    FIXUP: tl.constexpr = False, STREAMK: tl.constexpr = False, PDL: tl.constexpr = False,
):
    # BN: weight rows per program, 64 per warpgroup (wgmma M); the token tile BM is shared.
    if PDL:
        # Programmatic dependent launch: the program's first 512-wide K block of weight words
        # goes to L2 while the previous kernel finishes; nothing is read or written before the
        # wait (the activations, the split workspace and its tile counters are upstream's).
        num_m = tl.cdiv(M, BM)
        if STREAMK:
            kb = tl.cdiv(K, 512)
            u0 = tl.program_id(0) * (tl.cdiv(N, BN) * num_m * kb) // tl.num_programs(0)
            n0 = (u0 // kb) // num_m * BN
            b0 = u0 % kb
        else:
            n0 = tl.program_id(0) // num_m * BN
            b0 = tl.program_id(1)
        row_bytes = tl.cdiv(K, 512) * 256  # 64 int32 words per 512 of K
        prefetch_l2(w_ptr, n0, BN, N, row_bytes, b0 * 256, 256, row_bytes)
        wait_upstream()
    if STREAMK:
        _streamk(w_ptr, x_ptr, c_ptr, sw_ptr, sx_ptr, bias_ptr, ws_ptr, sem_ptr, M, N, K, ldx, ldc, stride_sw_g,
                 stride_sw_n, stride_sx, CT, W_SCALE, X_SCALE, GROUP_K, HAS_BIAS, BM, EVEN_K, INTERPRETED, BN,
                 SCALE_AHEAD)
    else:
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_m = tl.cdiv(M, BM)
        pid_m = pid % num_m  # the token tiles of one weight tile run side by side: its words are
        pid_n = pid // num_m  # read from HBM once and from L2 by the others
        rn = pid_n * BN + tl.arange(0, BN)
        rt = pid_m * BM + tl.arange(0, BM)
        n_ok = rn < N
        t_ok = rt < M
        rn64 = rn.to(tl.int64)
        acc = _tile_sum(w_ptr, x_ptr, sw_ptr, rn, rt, n_ok, t_ok, pid_k, K, N, K, ldx, stride_sw_g, stride_sw_n,
                        CT, W_SCALE, GROUP_K, BN, BM, SPLIT_K, EVEN_K, INTERPRETED, SCALE_AHEAD)
        y = _scaled(acc, sx_ptr, sw_ptr, bias_ptr, rn, rt, n_ok, t_ok, stride_sx, SPLIT_K == 1 or pid_k == 0,
                    X_SCALE, W_SCALE, HAS_BIAS)
        mask = n_ok[:, None] & t_ok[None, :]
        if SPLIT_K == 1:
            tl.store(c_ptr + rt.to(tl.int64)[None, :] * ldc + rn64[:, None], y.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            # Workspace [SPLIT_K, N, M] fp32 (the kernel's orientation); C is [M, N].
            slab = rn64[:, None] * M + rt[None, :]
            store_split_partial(y, ws_ptr, pid_k, N, M, slab, mask, SPLIT_K, FIXUP, sem_ptr, pid, c_ptr,
                                rt.to(tl.int64)[None, :], rn64[:, None], ldc)


@triton.jit
def _first_program(u, units, programs):
    """The program whose stream-K range holds unit ``u`` (ranges [p U / P, (p + 1) U / P))."""
    return ((u + 1) * programs + units - 1) // units - 1


@triton.jit
def _streamk(w_ptr, x_ptr, c_ptr, sw_ptr, sx_ptr, bias_ptr, ws_ptr, sem_ptr, M, N, K, ldx, ldc, stride_sw_g,
             stride_sw_n, stride_sx, CT: tl.constexpr, W_SCALE: tl.constexpr, X_SCALE: tl.constexpr,
             GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, EVEN_K: tl.constexpr,
             INTERPRETED: tl.constexpr, BN: tl.constexpr, SCALE_AHEAD: tl.constexpr):
    """Stream-K: the call's (tile, 512-wide K block) units, tile by tile, split into one contiguous
    range per program (a grid of as many programs as the SMs hold at once), so that every SM
    streams the same number of K blocks whatever the tile count. A tile whose blocks one program
    covers is stored as usual; a tile shared by programs gets an fp32 partial from each, in slot
    2 p (the program's first tile) or 2 p + 1 (its last) of the workspace, and the last of them
    to count itself in on the tile's counter (``sem_ptr``, zero between calls) sums the partials
    in program order (deterministic), stores the tile and puts the counter back to zero."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_m = tl.cdiv(M, BM)
    kb = tl.cdiv(K, 512)
    units = tl.cdiv(N, BN) * num_m * kb
    u0 = pid * units // programs
    u1 = (pid + 1) * units // programs
    t0 = u0 // kb
    for t in range(t0, (u1 - 1) // kb + 1):
        b0 = tl.maximum(u0 - t * kb, 0)
        b1 = tl.minimum(u1 - t * kb, kb)
        pid_m = t % num_m
        pid_n = t // num_m
        rn = pid_n * BN + tl.arange(0, BN)
        rt = pid_m * BM + tl.arange(0, BM)
        n_ok = rn < N
        t_ok = rt < M
        acc = _tile_sum(w_ptr, x_ptr, sw_ptr, rn, rt, n_ok, t_ok, b0, tl.minimum(b1 * 512, K), N, K, ldx,
                        stride_sw_g, stride_sw_n, CT, W_SCALE, GROUP_K, BN, BM, 1, EVEN_K, INTERPRETED, SCALE_AHEAD)
        y = _scaled(acc, sx_ptr, sw_ptr, bias_ptr, rn, rt, n_ok, t_ok, stride_sx, b0 == 0, X_SCALE, W_SCALE,
                    HAS_BIAS)
        mask = n_ok[:, None] & t_ok[None, :]
        c_ptrs = c_ptr + rt.to(tl.int64)[None, :] * ldc + rn.to(tl.int64)[:, None]
        if (b0 == 0) & (b1 == kb):
            tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            own = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]  # a slot's [BN, BM] values
            slot = 2 * pid + (u0 < t * kb).to(tl.int32)
            tl.store(ws_ptr + slot.to(tl.int64) * (BN * BM) + own, y)
            arrived = count_in(sem_ptr, t)  # (the split's protocol, split_k.py)
            first = _first_program(t * kb, units, programs)
            last = _first_program(t * kb + kb - 1, units, programs)
            if arrived == last - first:
                total = tl.zeros((BN, BM), dtype=tl.float32)
                for q in range(first, last + 1):  # (L2 only: other SMs wrote them)
                    q_slot = 2 * q + (q * units // programs < t * kb).to(tl.int32)
                    total += tl.load(ws_ptr + q_slot.to(tl.int64) * (BN * BM) + own, cache_modifier=".cg")
                tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)
                release(sem_ptr, t)
