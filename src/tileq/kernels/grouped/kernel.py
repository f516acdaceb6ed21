"""The grouped tile kernel: every expert's quantized GEMM in one launch, dequantization fused.

A program computes one tile of one expert: ``BM`` rows of that expert by ``BN`` output columns.
Which expert and rows is found on the device, never on the host:

- FORM 'masked' (x [E, C, K], counts [E]): program ``pid`` is row tile ``pid % cdiv(C, BM)`` of
  expert ``pid // cdiv(C, BM)``; a tile starting at or past counts[e] exits at once.
- FORM 'contiguous' (x [T, K], offsets [E + 1]): the grid has cdiv(T, BM) + min(E, T) row tiles,
  an upper bound of sum_e cdiv(rows_e, BM). Each program loads the offsets, counts each expert's tiles,
  and finds its expert by a prefix sum; the surplus programs exit at once.

Offsets and counts are clamped to the tensors' extents, so wrong values never read or write out
of bounds. The main loop and the epilogue follow docs/schemes.md section 1 (the portable
kernel's helpers do the int4 unpacking, conversions and dots): group scales promoted per K tile
inside its K group, then ``* x_scale rows -> * w_scale columns -> * row_scale -> cast``.

Tiles are numbered along grid axis 0 in groups of GROUP_M row tiles (``_tile_of``): the
programs running at once share a few row tiles and every column tile, so x rows and weight tiles
are read from HBM about once (L2 reuse) at prefill sizes.

SWAPPED computes the tile transposed (w rows x tokens: the weight on the matrix instruction's
64-row side, a decode tile's few tokens on its narrow side, int4 fed from registers without a
transpose); the accumulator is transposed back before the epilogue.

Constexpr strings: X_TYPE / W_TYPE storage ('i8' 'fp8' 'bf8' 'bf16' 'fp16'; W also 'i4'),
X_CT / W_CT the matrix instruction's types, X_SCALE 'none' 'vector' 'group', W_SCALE 'vector'
'group'.
"""

import triton
import triton.language as tl

from ..gemm_kernel import _convert, _dot, _mask, _unpack_int4


@triton.jit
def _tile_of(pid, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """(row tile, column tile) of linear tile ``pid``: groups of GROUP_M row tiles, the row tile
    fastest inside a group, so neighbouring programs share column tiles and row tiles."""
    width = GROUP_M * n_tiles
    first_m = (pid // width) * GROUP_M
    size = tl.minimum(m_tiles - first_m, GROUP_M)
    return first_m + (pid % width) % size, (pid % width) // size


@triton.jit
def _tile_rows(idx_ptr, pid, E, ROWS, FORM: tl.constexpr, BM: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row, end row) of row tile ``pid``; expert >= E or first >= end: no work.
    Rows are global (x's row index) in the contiguous form, within x[e] in the masked one."""
    if FORM == "masked":
        m_tiles = tl.cdiv(ROWS, BM)
        e = pid // m_tiles
        first = (pid % m_tiles) * BM
        end = tl.minimum(tl.load(idx_ptr + tl.minimum(e, E - 1)), ROWS)
    else:
        ei = tl.arange(0, E_POW2)
        live = ei < E
        lo = tl.minimum(tl.maximum(tl.load(idx_ptr + ei, mask=live, other=0), 0), ROWS)
        hi = tl.minimum(tl.maximum(tl.load(idx_ptr + ei + 1, mask=live, other=0), 0), ROWS)
        tiles = tl.where(live, tl.cdiv(tl.maximum(hi - lo, 0), BM), 0)
        ends = tl.cumsum(tiles, 0)  # row tiles of experts 0..e
        e = tl.sum((ends <= pid).to(tl.int32), 0)
        mine = ei == e
        first = tl.sum(tl.where(mine, lo + (pid - (ends - tiles)) * BM, 0), 0)
        end = tl.sum(tl.where(mine, hi, 0), 0)
    return e, first, end


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, y_ptr, sx_ptr, sw_ptr, rs_ptr, idx_ptr,
    E, ROWS, N, K,
    stride_xe, stride_xm, stride_we, stride_wn, stride_ye, stride_ym,
    stride_sxe, stride_sxm, stride_sxg, stride_swe, stride_swn, stride_swg, stride_rse, stride_rsm,
    FORM: tl.constexpr, E_POW2: tl.constexpr,
    X_TYPE: tl.constexpr, W_TYPE: tl.constexpr, X_CT: tl.constexpr, W_CT: tl.constexpr,
    X_SCALE: tl.constexpr, W_SCALE: tl.constexpr, GROUP_K: tl.constexpr, GROUP_N: tl.constexpr,
    INT_DOT: tl.constexpr, GROUPED: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAPPED: tl.constexpr,
    EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    if FORM == "masked":
        m_tiles = E * tl.cdiv(ROWS, BM)
    else:
        m_tiles = tl.cdiv(ROWS, BM) + tl.minimum(E, ROWS)  # the launcher's grid(), row tiles
    tile_m, tile_n = _tile_of(pid, m_tiles, tl.cdiv(N, BN), GROUP_M)
    e, first, end = _tile_rows(idx_ptr, tile_m, E, ROWS, FORM, BM, E_POW2)
    if e >= E or first >= end:
        return
    e64 = e.to(tl.int64)
    rm = first + tl.arange(0, BM)
    rn = tile_n * BN + tl.arange(0, BN)
    m_ok = rm < end
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    x_rows = x_ptr + e64 * stride_xe + rm64 * stride_xm
    w_rows = w_ptr + e64 * stride_we + rn64 * stride_wn
    if INT_DOT and not GROUPED:
        acc = tl.zeros((BN, BM) if SWAPPED else (BM, BN), dtype=tl.int32)
    else:
        acc = tl.zeros((BN, BM) if SWAPPED else (BM, BN), dtype=tl.float32)
    # 0x88 unpacks to two zeros: a partial K tile's masked int4 bytes add nothing.
    I4_PAD: tl.constexpr = 0 if EVEN_K else 136
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_rows[:, None] + rk[None, :], mask=_mask(m_ok, rk < K, EVEN_K),
                    other=0 if X_TYPE == "i8" else 0.0)
        if W_TYPE == "i4":
            rkh = k0 // 2 + tl.arange(0, BK // 2)
            w_raw = tl.load(w_rows[:, None] + rkh[None, :], mask=_mask(n_ok, rkh < K // 2, EVEN_K),
                            other=I4_PAD)
            w = _unpack_int4(w_raw, W_CT, INTERPRETED)
        else:
            w = tl.load(w_rows[:, None] + rk[None, :], mask=_mask(n_ok, rk < K, EVEN_K),
                        other=0 if W_TYPE == "i8" else 0.0)
            w = _convert(w, W_CT, INTERPRETED)
        x = _convert(x, X_CT, INTERPRETED)
        if GROUPED:
            # Promotion: this K tile lies inside one K group (BK divides GROUP_K).
            if SWAPPED:
                part = _dot(w, tl.trans(x), None, tl.int32 if INT_DOT else tl.float32, INTERPRETED, W_CT)
            else:
                part = _dot(x, tl.trans(w), None, tl.int32 if INT_DOT else tl.float32, INTERPRETED, X_CT)
            part = part.to(tl.float32)
            g = k0 // GROUP_K
            if X_SCALE == "group":
                sx = tl.load(sx_ptr + e64 * stride_sxe + rm64 * stride_sxm + g * stride_sxg, mask=m_ok, other=0.0)
                part = part * (sx[None, :] if SWAPPED else sx[:, None])
            sw = tl.load(sw_ptr + e64 * stride_swe + (rn // GROUP_N) * stride_swn + g * stride_swg, mask=n_ok,
                         other=0.0)
            part = part * (sw[:, None] if SWAPPED else sw[None, :])
            acc += part
        elif SWAPPED:
            acc = _dot(w, tl.trans(x), acc, acc.dtype, INTERPRETED, W_CT)
        else:
            acc = _dot(x, tl.trans(w), acc, acc.dtype, INTERPRETED, X_CT)

    # ---- epilogue: fp32 -> * x_scale rows -> * w_scale columns -> * row_scale -> cast ----
    y = acc.to(tl.float32)
    if SWAPPED:
        y = tl.trans(y)
    if X_SCALE == "vector":
        y = y * tl.load(sx_ptr + e64 * stride_sxe + rm64 * stride_sxm, mask=m_ok, other=0.0)[:, None]
    if W_SCALE == "vector":
        y = y * tl.load(sw_ptr + e64 * stride_swe + rn64 * stride_swn, mask=n_ok, other=0.0)[None, :]
    if HAS_ROW_SCALE:
        y = y * tl.load(rs_ptr + e64 * stride_rse + rm64 * stride_rsm, mask=m_ok, other=0.0)[:, None]
    y_ptrs = y_ptr + e64 * stride_ye + rm64[:, None] * stride_ym + rn64[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
