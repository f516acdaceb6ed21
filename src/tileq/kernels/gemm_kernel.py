"""The tile GEMM kernel: one Triton source specialized (constexpr) on the plan.

A and B tiles are loaded in their stored layout, int4 is unpacked in registers and converted
(exactly) to the partner's type, the product runs on the matrix units, group scales are
promoted inside the K loop, and the epilogue follows the epilogue order of docs/schemes.md section 1:
``acc_in + mainloop -> fp32 -> * a_scale rows -> * b_scale columns -> + bias -> cast``.

With SPLIT_K > 1 each program reduces a strided share of the K tiles and writes its fp32 partial
(already scaled: every stage after the sum is linear except bias, which split 0 adds) to a
workspace [SPLIT_K, M, N], summed in split order (bit-identical run to run, ``split_k.py``): by
the reduction kernel afterwards, or with FIXUP by the kernel itself (no second launch): the last
of a tile's SPLIT_K programs sums the partials and stores the tile to ``out_ptr``.

Modes are constexpr strings, never integers:
  A_TYPE / B_TYPE: storage type 'i8' 'fp8' 'bf8' 'i4' 'bf16' 'fp16'
  A_CT / B_CT:     the type each operand is converted to before the dot
  A_LAYOUT:        'r' (K contiguous) or 'c' (M contiguous); B_LAYOUT 'r' (N contig.) or 'c' (K)
  A_SCALE:         'none' 'scalar' 'vector' (rows) 'group' ([M, Gk]); B_SCALE likewise (columns,
                   [Gk, Gn])
  PDL:             programmatic dependent launch: the weight's first K tile is prefetched to L2,
                   then the kernel waits for the previous kernel before reading anything
                   (kernels/pdl.py)
"""

import triton
import triton.language as tl

from .pdl import prefetch_tile, wait_upstream
from .split_k import store_split_partial
from .tiles import grouped_tile


@triton.jit
def _nibbles_to(n, CT: tl.constexpr, INTERPRETED: tl.constexpr):
    """uint8 nibbles 0..15 -> the value nibble - 8 in the compute type, exactly.

    No int->float conversion instruction (I2F runs at a fraction of the FMA rate on sm_90):
    OR-ing a nibble into the mantissa of 1024.0 (fp16 0x6400) or 128.0 (bf16 0x4300) gives
    1024 + n or 128 + n exactly; one subtraction leaves n - 8. e5m2 is the top byte of fp16, so
    bf8 needs only a shift; e4m3 takes the packed fp16 -> e4m3 conversion.
    """
    if CT == "i8":
        v = n.to(tl.int8) - 8
    elif CT == "bf16" and not INTERPRETED:
        v = (n.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0
    elif CT == "bf16":
        # Triton 3.6's interpreter mishandles bf16 arithmetic; _convert/_dot widen it to fp32.
        v = n.to(tl.float32) - 8.0
    else:
        h = (n.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        if CT == "fp16":
            v = h
        elif CT == "bf8":
            v = (h.to(tl.uint16, bitcast=True) >> 8).to(tl.uint8).to(tl.float8e5, bitcast=True)
        else:
            v = h.to(tl.float8e4nv)
    return v


@triton.jit
def _unpack_int4(x, CT: tl.constexpr, INTERPRETED: tl.constexpr):
    """uint8 [R, C] -> [R, 2C] of the compute type: element 2j is the high nibble."""
    hi = _nibbles_to(x >> 4, CT, INTERPRETED)
    lo = _nibbles_to(x & 15, CT, INTERPRETED)
    return tl.reshape(tl.join(hi, lo), (x.shape[0], 2 * x.shape[1]))


@triton.jit
def _convert(x, CT: tl.constexpr, INTERPRETED: tl.constexpr):
    """Convert a loaded tile to the compute type; every conversion used here is exact."""
    if INTERPRETED and CT == "bf16":
        # Triton 3.6's interpreter turns int8 -> bf16 into NaN; via fp32 it is right.
        x = x.to(tl.float32)
    if CT == "fp8":
        if x.dtype != tl.float8e4nv:
            x = x.to(tl.float16).to(tl.float8e4nv)
    elif CT == "bf8":
        if x.dtype != tl.float8e5:
            x = x.to(tl.float16).to(tl.float8e5)
    elif CT == "bf16":
        x = x.to(tl.bfloat16)
    elif CT == "fp16":
        x = x.to(tl.float16)
    return x


@triton.jit
def _dot(a, b, acc, OUT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr, CT: tl.constexpr,
         FAST_ACCUM: tl.constexpr = False):
    """a @ b (+ acc) on the matrix units."""
    if INTERPRETED and CT == "bf16":
        # Triton 3.6's interpreter computes bf16 dots wrongly (numpy has no bf16); fp32 inputs
        # holding the same bf16 values give the exact products the GPU's bf16 mma forms.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if acc is None:
            return tl.dot(a, b, input_precision="ieee", out_dtype=OUT_DTYPE)
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=OUT_DTYPE)
    if acc is None:
        return tl.dot(a, b, out_dtype=OUT_DTYPE)
    if a.dtype.is_fp8() and b.dtype.is_fp8() and not FAST_ACCUM:
        # sm_90's fp8 wgmma accumulates with reduced precision; Triton's default lets that run
        # over the whole K loop (up to 1.6% of max|C| at K = 17408 on an H200). Promoting
        # into the fp32 accumulator after every K tile keeps it at bf16 rounding, as cuBLASLt
        # does without fast accumulation and as the grouped schemes do per tile.
        return tl.dot(a, b, acc, out_dtype=OUT_DTYPE, max_num_imprecise_acc=a.shape[1])
    return tl.dot(a, b, acc, out_dtype=OUT_DTYPE)


@triton.jit
def _mask(rows_ok, k_ok, EVEN_K: tl.constexpr):
    """Mask of a [rows, K] tile: rows only when every K tile is full."""
    if EVEN_K:
        mask = rows_ok[:, None]
    else:
        mask = rows_ok[:, None] & k_ok[None, :]
    return mask


@triton.jit
def _mask_t(k_ok, cols_ok, EVEN_K: tl.constexpr):
    """Mask of a [K, cols] tile."""
    if EVEN_K:
        mask = cols_ok[None, :]
    else:
        mask = k_ok[:, None] & cols_ok[None, :]
    return mask


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, acc_ptr, out_ptr, sem_ptr,
    M, N, K,
    lda, ldb, ldc, ld_acc,
    stride_sa_m, stride_sa_g, stride_sb_g, stride_sb_n,
    A_TYPE: tl.constexpr, B_TYPE: tl.constexpr, A_CT: tl.constexpr, B_CT: tl.constexpr,
    A_LAYOUT: tl.constexpr, B_LAYOUT: tl.constexpr,
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, SA_PRESHUFFLED: tl.constexpr,
    GROUP_K: tl.constexpr, GROUP_N: tl.constexpr,
    INT_DOT: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRETED: tl.constexpr,
    FAST_ACCUM: tl.constexpr, SWAPPED: tl.constexpr, SA_ROW_GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, I4_WORDS: tl.constexpr, PDL: tl.constexpr = False, FIXUP: tl.constexpr = False,
):
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)

    # Base pointers of this program's first K tile; advanced by a fixed step per iteration.
    k_first = pid_k * BK
    k_step = BK * SPLIT_K
    if A_TYPE == "i4":
        if A_LAYOUT == "r":  # packed along K: bytes [BM, BK/2]
            rkh = k_first // 2 + tl.arange(0, BK // 2)
            a_ptrs = a_ptr + rm64[:, None] * lda + rkh[None, :]
            a_step = k_step // 2
        else:  # packed along M: bytes [BK, BM/2]
            rmh = pid_m * (BM // 2) + tl.arange(0, BM // 2)
            a_ptrs = a_ptr + (k_first + rk)[:, None].to(tl.int64) * lda + rmh[None, :]
            a_step = k_step * lda
    else:
        if A_LAYOUT == "r":
            a_ptrs = a_ptr + rm64[:, None] * lda + (k_first + rk)[None, :]
            a_step = k_step
        else:
            a_ptrs = a_ptr + (k_first + rk)[None, :].to(tl.int64) * lda + rm64[:, None]
            a_step = k_step * lda
    if B_TYPE == "i4":
        if B_LAYOUT == "r" and B_CT != "bf16" and B_CT != "fp16":
            # Packed along N feeding an 8-bit mma: read each byte once per nibble ([BK, BN]
            # addresses n // 2) instead of join+reshape, which Triton 3.6's dot-operand pass
            # rejects for 8-bit operands ("Illegal shared layout" in TritonGPUOptimizeDotOperands).
            rnh = rn // 2
            b_ptrs = b_ptr + (k_first + rk)[:, None].to(tl.int64) * ldb + rnh[None, :]
            b_step = k_step * ldb
        elif B_LAYOUT == "r":  # packed along N: bytes [BK, BN/2]
            rnh = pid_n * (BN // 2) + tl.arange(0, BN // 2)
            b_ptrs = b_ptr + (k_first + rk)[:, None].to(tl.int64) * ldb + rnh[None, :]
            b_step = k_step * ldb
        else:  # packed along K: bytes [BN, BK/2]
            rkh_b = k_first // 2 + tl.arange(0, BK // 2)
            b_ptrs = b_ptr + rn64[:, None] * ldb + rkh_b[None, :]
            b_step = k_step // 2
    else:
        if B_LAYOUT == "r":
            b_ptrs = b_ptr + (k_first + rk)[:, None].to(tl.int64) * ldb + rn64[None, :]
            b_step = k_step * ldb
        else:
            b_ptrs = b_ptr + rn64[None, :] * ldb + (k_first + rk)[:, None]
            b_step = k_step

    if I4_WORDS:
        # The int4 operand is packed along K and read as int16 words of four nibbles. With
        # little-endian bytes and the high nibble first, bits 4p..4p+3 of word j hold
        # k = 4j + (p ^ 1). So a K tile is four dots over BK/4, dot p taking the partner's
        # K-rows of residue p ^ 1 mod 4. No join/reshape interleave: the words reach the dot
        # layout with 16-bit shared loads instead of byte loads (measured 10-15% faster for
        # fp8 x int4 decode on an H200; bf16 x int4 was slower, so it keeps the byte path).
        rkw = k_first // 4 + tl.arange(0, BK // 4)
        rk4 = k_first + 4 * tl.arange(0, BK // 4)
        if A_TYPE == "i4":
            w_ptrs = a_ptr.to(tl.pointer_type(tl.int16)) + rm64[:, None] * (lda // 2) + rkw[None, :]
            if B_LAYOUT == "r":
                p_ptrs = b_ptr + rk4[:, None].to(tl.int64) * ldb + rn64[None, :]
                p_kstride = ldb
            else:
                p_ptrs = b_ptr + rn64[None, :] * ldb + rk4[:, None]
                p_kstride = 1
        else:
            w_ptrs = b_ptr.to(tl.pointer_type(tl.int16)) + rn64[:, None] * (ldb // 2) + rkw[None, :]
            if A_LAYOUT == "r":
                p_ptrs = a_ptr + rm64[:, None] * lda + rk4[None, :]
                p_kstride = 1
            else:
                p_ptrs = a_ptr + rk4[None, :].to(tl.int64) * lda + rm64[:, None]
                p_kstride = lda

    if PDL:
        # The weight (the kernel's A when swapped) does not depend on the previous kernel: its
        # first K tile is on its way to L2 while that kernel finishes.
        if SWAPPED:
            prefetch_tile(a_ptr, lda, A_TYPE, A_LAYOUT == "r", pid_m * BM, BM, M, k_first, BK, K)
        else:
            prefetch_tile(b_ptr, ldb, B_TYPE, B_LAYOUT == "c", pid_n * BN, BN, N, k_first, BK, K)
        wait_upstream()  # before the first read of the activations and the first store

    if INT_DOT and not GROUPED:
        acc = tl.zeros((BM, BN), dtype=tl.int32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)

    # EVEN_K: K is a multiple of BK, so every K tile is full and only rows/columns are masked.
    # The masked-out rows of an int4 tile then never reach a stored output, so they may read
    # 0 instead of 0x88 (a zero-filling async copy, no select after the load).
    if EVEN_K:
        I4_PAD: tl.constexpr = 0
    else:
        I4_PAD: tl.constexpr = 136  # 0x88 unpacks to two zeros
    for k0 in range(k_first, K, k_step):
        k_left = K - k0
        if EVEN_K:
            k_ok = rk < BK
            kh_ok = tl.arange(0, BK // 2) < BK // 2
        else:
            k_ok = rk < k_left
            kh_ok = tl.arange(0, BK // 2) < k_left // 2
        # ---- A tile [BM, BK] ----
        if I4_WORDS:
            # Masked words read 0x8888 (four zeros) in a partial K tile.
            kw_ok = tl.arange(0, BK // 4) < k_left // 4
            w = tl.load(w_ptrs, mask=_mask(m_ok if A_TYPE == "i4" else n_ok, kw_ok, EVEN_K),
                        other=0 if EVEN_K else -30584)
            k4_ok = rk4 - k_first < k_left
            if INT_DOT:
                wpart = tl.zeros((BM, BN), dtype=tl.int32)
            else:
                wpart = tl.zeros((BM, BN), dtype=tl.float32)
            for p in tl.static_range(4):
                if A_TYPE == "i4":
                    a_p = _nibbles_to((w >> (4 * p)) & 15, A_CT, INTERPRETED)
                    b_p = tl.load(p_ptrs + (p ^ 1) * p_kstride, mask=_mask_t(k4_ok, n_ok, EVEN_K),
                                  other=0.0 if B_TYPE != "i8" else 0)
                    b_p = _convert(b_p, B_CT, INTERPRETED)
                else:
                    b_p = tl.trans(_nibbles_to((w >> (4 * p)) & 15, B_CT, INTERPRETED))
                    a_p = tl.load(p_ptrs + (p ^ 1) * p_kstride, mask=_mask(m_ok, k4_ok, EVEN_K),
                                  other=0.0 if A_TYPE != "i8" else 0)
                    a_p = _convert(a_p, A_CT, INTERPRETED)
                wpart = _dot(a_p, b_p, wpart, wpart.dtype, INTERPRETED, A_CT, FAST_ACCUM)
            w_ptrs += k_step // 4
            p_ptrs += k_step * p_kstride
        elif A_TYPE == "i4":
            if A_LAYOUT == "r":
                a_raw = tl.load(a_ptrs, mask=_mask(m_ok, kh_ok, EVEN_K), other=I4_PAD)
                a = _unpack_int4(a_raw, A_CT, INTERPRETED)
            else:
                mh_ok = rmh < M // 2
                a_raw = tl.load(a_ptrs, mask=_mask_t(k_ok, mh_ok, EVEN_K), other=I4_PAD)
                a = tl.trans(_unpack_int4(a_raw, A_CT, INTERPRETED))
        elif A_TYPE == "fp8" or A_TYPE == "bf8" or A_TYPE == "bf16" or A_TYPE == "fp16":
            a = tl.load(a_ptrs, mask=_mask(m_ok, k_ok, EVEN_K), other=0.0)
        else:
            a = tl.load(a_ptrs, mask=_mask(m_ok, k_ok, EVEN_K), other=0)
        # ---- B tile [BK, BN] ----
        if I4_WORDS:
            pass  # loaded with A above
        elif B_TYPE == "i4":
            if B_LAYOUT == "r" and B_CT != "bf16" and B_CT != "fp16":
                b_raw = tl.load(b_ptrs, mask=_mask_t(k_ok, n_ok, EVEN_K), other=I4_PAD)
                shift = (1 - (rn % 2)) * 4  # even n: high nibble
                b = _nibbles_to((b_raw >> shift[None, :].to(tl.uint8)) & 15, B_CT, INTERPRETED)
            elif B_LAYOUT == "r":
                nh_ok = rnh < N // 2
                b_raw = tl.load(b_ptrs, mask=_mask_t(k_ok, nh_ok, EVEN_K), other=I4_PAD)
                b = _unpack_int4(b_raw, B_CT, INTERPRETED)
            else:
                b_raw = tl.load(b_ptrs, mask=_mask(n_ok, kh_ok, EVEN_K), other=I4_PAD)
                b = tl.trans(_unpack_int4(b_raw, B_CT, INTERPRETED))
        elif B_TYPE == "fp8" or B_TYPE == "bf8" or B_TYPE == "bf16" or B_TYPE == "fp16":
            b = tl.load(b_ptrs, mask=_mask_t(k_ok, n_ok, EVEN_K), other=0.0)
        else:
            b = tl.load(b_ptrs, mask=_mask_t(k_ok, n_ok, EVEN_K), other=0)
        if not I4_WORDS:
            a = _convert(a, A_CT, INTERPRETED)
            b = _convert(b, B_CT, INTERPRETED)

        if GROUPED:
            # Promotion: this K tile lies inside one K-group (BK divides GROUP_K), so its exact
            # (int32) or fp32 partial sum is scaled by that group's scales and added in fp32.
            if I4_WORDS:
                part = wpart.to(tl.float32)
            elif INT_DOT:
                part = _dot(a, b, None, tl.int32, INTERPRETED, A_CT).to(tl.float32)
            else:
                part = _dot(a, b, None, tl.float32, INTERPRETED, A_CT)
            g = k0 // GROUP_K
            if A_SCALE == "group":
                # SA_ROW_GROUP > 1 only when swapped: B's column groups became row groups.
                if SA_PRESHUFFLED:
                    sa = tl.load(sa_ptr + g * stride_sa_g + rm // SA_ROW_GROUP, mask=m_ok, other=0.0)
                else:
                    sa = tl.load(sa_ptr + (rm // SA_ROW_GROUP) * stride_sa_m + g, mask=m_ok, other=0.0)
                part = part * sa[:, None]
            if B_SCALE == "group":
                sb = tl.load(sb_ptr + g * stride_sb_g + (rn // GROUP_N) * stride_sb_n, mask=n_ok,
                             other=0.0)
                part = part * sb[None, :]
            acc += part
        elif I4_WORDS:
            acc += wpart
        else:
            acc = _dot(a, b, acc, acc.dtype, INTERPRETED, A_CT, FAST_ACCUM)
        a_ptrs += a_step
        b_ptrs += b_step

    # ---- epilogue ----
    # SWAPPED: this program computed a tile of C^T = B^T A^T (rows are C's columns), so C, acc_in
    # and the bias are addressed transposed; every other stage is unchanged.
    c_mask = m_ok[:, None] & n_ok[None, :]
    if HAS_ACC:
        if SPLIT_K == 1 or pid_k == 0:
            if SWAPPED:
                acc_in = tl.load(acc_ptr + rn64[None, :] * ld_acc + rm[:, None], mask=c_mask, other=0)
            else:
                acc_in = tl.load(acc_ptr + rm64[:, None] * ld_acc + rn[None, :], mask=c_mask, other=0)
            acc += acc_in
    y = acc.to(tl.float32)
    if A_SCALE == "scalar":
        y = y * tl.load(sa_ptr)
    elif A_SCALE == "vector":
        sa_row = tl.load(sa_ptr + rm * stride_sa_m, mask=m_ok, other=0.0)
        y = y * sa_row[:, None]
    if B_SCALE == "scalar":
        y = y * tl.load(sb_ptr)
    elif B_SCALE == "vector":
        sb_col = tl.load(sb_ptr + rn * stride_sb_n, mask=n_ok, other=0.0)
        y = y * sb_col[None, :]
    if HAS_BIAS:
        if SPLIT_K == 1 or pid_k == 0:
            if SWAPPED:
                bias_r = tl.load(bias_ptr + rm, mask=m_ok, other=0.0)
                y = y + bias_r[:, None]
            else:
                bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0)
                y = y + bias[None, :]
    if SPLIT_K == 1:
        if SWAPPED:
            c_ptrs = c_ptr + rn64[None, :] * ldc + rm[:, None]
        else:
            c_ptrs = c_ptr + rm64[:, None] * ldc + rn[None, :]
        tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        # Workspace [SPLIT_K, M, N] fp32, contiguous; ldc is N here (FIXUP: the output's).
        slab = rm64[:, None] * N + rn[None, :]
        if SWAPPED:  # (FIXUP: the output C^T's tile, transposed)
            o_major = rn64[None, :]
            o_minor = rm[:, None]
        else:
            o_major = rm64[:, None]
            o_minor = rn[None, :]
        store_split_partial(y, c_ptr, pid_k, M, N, slab, c_mask, SPLIT_K, FIXUP, sem_ptr, tl.program_id(0), out_ptr,
                            o_major, o_minor, ldc)
