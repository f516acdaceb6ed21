"""sm_90 prefill kernel on prepacked int4 weights (layout i4p1), in Gluon: W4A16 at large M.

C[M, N] = epilogue(X[M, K] @ W[N, K]^T) for 16-bit activations X and an int4 weight W with group
(a multiple of 128 along K), per-channel or per-tensor scales; W4A8 calls come with their fp8
activations cast to bf16 (exact), or as they are for the fp8 build (CT 'fp8', below), and their
per-token or per-tensor scale (X_SCALE), applied first in the epilogue. It computes the
transposed product
C^T = W X^T tile by tile (swap-AB, as the decode kernel ``kernel.py`` does): the weight is the
wgmma's A operand, converted from int4 in registers, the activations the B operand from shared
memory. A tile is 128 weight rows x BT tokens:

- one producer warp (40 registers) loads, by TMA, the words of each 512-wide K block of the
  tile's 128 weight rows (two [128, 32] int32 boxes, 128-byte swizzled rows, a ring of WS slots)
  and the activations of each
  64-wide K slice ([BT, 64], 128-byte rows, a ring of XS slots);
- two consumer warpgroups own 64 weight rows each. Per K block a consumer reads its [64, 64]
  words from shared memory into registers in the A operand's layout of a [64, 64] wgmma (word
  pairs (c, c + 1) in one thread: ``tileq.prepacked``'s design); per 128-wide slice one inline-PTX call
  per word pair makes the two 64-wide value slices (2 shifts, 2 LOP3 with the magic exponent,
  2 packed subtractions), which are the A operands as they stand (no data moves: checked on
  the sm_90 build); an async wgmma chain against the two [64, BT] activation tiles, and while
  it runs the other consumer converts the next slice (with OVERLAP, tiles of up to 128 tokens,
  this consumer too: it waits with this slice's chain in flight, and only a 512 block's last
  slice waits for all). One fp32 accumulator over all of K: group
  scales multiply the converted values (one packed multiply, rounded to the 16-bit type once, as
  the dequantized weights of the dequantize + cuBLAS path are; a second accumulator for exact
  promotion does not fit the registers), per-channel and per-tensor scales wait for the
  epilogue (exact);
- the grid is persistent with a grouped tile order; the epilogue (token scale, weight scale, bias, cast) is
  stored transposed through shared memory by TMA, or with masked stores when C's rows are not
  16-byte aligned. Split over K (SPLIT) or with stream-K (STREAM_K, ``streamk.py``: whole tiles
  for all full waves but the last, then the other tiles' K blocks shared out evenly) a tile that
  a work item covers only in part is written as an fp32 partial, summed afterwards in order.

CT = 'fp8' (W4A8 fused, ``_consumer_fp8``): fp8 activations (e4m3 or e5m2) stay fp8 in shared
memory ([BT, 64] tiles, 64-byte rows) and the weight is converted to e4m3 (-8..7 are exact) in
registers, straight into the A operand of an fp8 wgmma (m64nBTk32, kWidth 4): a consumer reads
its words four at a time (c .. c + 3, one 16-byte shared load), and per 128-wide slice one
inline-PTX call per quad makes the two 64-wide value slices (per 4 weights: 2 x (shift, LOP3
with f16's magic exponent, packed subtraction, cvt to e4m3x2) and a pack). fp8 wgmma partial
sums are promoted into the fp32 accumulator every 128 of K, times the rows' group scales in
fp32 (exact: no 16-bit rounding of scaled weights); the activations' scale in the epilogue.

K past the logical K: the words are padded with zeros (the format), TMA zero-fills the
activations, so no masks are needed in the main loop.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..tiles import grouped_tile

HALF_W = gl.constexpr(64)  # weight rows per consumer warpgroup: the height of one wgmma
BLOCK_W = gl.constexpr(128)  # weight rows per tile (two consumers)
SLICES = gl.constexpr(4)  # 128-wide K slices per 512-wide block (one wgmma chain each)


def _words_layout(pairs: bool, cols: int):
    """A consumer's words [64 rows, cols] (cols 64: a 512-wide K block; 32: one of its halves) in
    the A operand's register layout of a [64, 64] wgmma on sm_90 with 4 warps, as a linear layout:
    ``pairs`` (16-bit build, kWidth 2) word pairs (c, c + 1) in consecutive registers of a thread,
    else (fp8 build, kWidth 4) quads c .. c + 3; so the conversion's outputs (element c = k) are
    the operands themselves."""
    if pairs:
        regs, lanes = [[0, 1], [8, 0], [0, 8], [0, 16], [0, 32]], [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    else:
        regs, lanes = [[0, 1], [0, 2], [8, 0], [0, 16], [0, 32]], [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    if cols == 32:
        regs = regs[:-1]  # (less c's bit 5)
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[[16, 0], [32, 0]],
                                      block_bases=[], shape=[64, cols])


WORDS_16 = gl.constexpr(_words_layout(True, 64))
HALF_16 = gl.constexpr(_words_layout(True, 32))
WORDS_8 = gl.constexpr(_words_layout(False, 64))
HALF_8 = gl.constexpr(_words_layout(False, 32))


def _slice_asm(word: int, q: int, magic: int, ty: str, scaled: bool) -> str:
    """One word of a pair ($2 = word c, $3 = word c + 1) -> the registers of value slices q and
    q + 1 ($0, $1): (w >> 4q) & 0x000F000F | magic puts nibbles k and k + 1 into the two halves
    as magic + nibble; the packed subtraction of magic + 8 leaves the value exactly; ``scaled``:
    times the row's scale ($4, the same 16-bit scale in both halves), rounded once."""
    src = f"${2 + word}"
    lines = ["{", ".reg .b32 t0, t1, m;", f"mov.b32 m, 0x{magic + 8:04X}{magic + 8:04X};"]
    for out, shift in ((0, 4 * q), (1, 4 * q + 4)):
        if shift:
            lines.append(f"shr.u32 t{out}, {src}, {shift};")
        else:
            lines.append(f"mov.b32 t{out}, {src};")
        lines.append(f"lop3.b32 ${out}, t{out}, 0x000F000F, 0x{magic:04X}{magic:04X}, 0xea;")
        lines.append(f"sub.{ty}x2 ${out}, ${out}, m;")
        if scaled:
            lines.append(f"mul.rn.{ty}x2 ${out}, ${out}, $4;")
    lines.append("}")
    return "\n".join(lines)


_MAGIC = {"bf16": (0x4300, "bf16"), "fp16": (0x6400, "f16")}


def _fp8_slice_asm(odd: int, q: int) -> str:
    """A quad of words ($2 .. $5 = words c .. c + 3, c a multiple of 4) -> the e4m3 registers of
    value slices q and q + 1 ($0, $1: four values each, k = c .. c + 3 of the slice). The even
    words (c, c + 2) hold the block's first 256 of K, the odd ones (c + 1, c + 3) the rest
    (``tileq.prepacked``): word c's nibbles q and 4 + q are k = c and c + 1, word c + 2's k = c + 2 and
    c + 3. (w >> 4q) & 0x000F000F | 0x64006400 makes two f16 1024 + nibble, the packed
    subtraction of 1032 leaves the values, cvt packs them as e4m3 (exact), the lower half in the
    lower byte; the two 16-bit halves make one register, k = c in its lowest byte."""
    wa, wb = (f"${2 + odd}", f"${4 + odd}")
    lines = ["{", ".reg .b32 t0, t1, m;", ".reg .b16 h0, h1;", "mov.b32 m, 0x64086408;"]
    for out, qq in ((0, q), (1, q + 1)):
        for t, src in ((0, wa), (1, wb)):
            if qq:
                lines.append(f"shr.u32 t{t}, {src}, {4 * qq};")
            else:
                lines.append(f"mov.b32 t{t}, {src};")
            lines.append(f"lop3.b32 t{t}, t{t}, 0x000F000F, 0x64006400, 0xea;")
            lines.append(f"sub.f16x2 t{t}, t{t}, m;")
            lines.append(f"cvt.rn.satfinite.e4m3x2.f16x2 h{t}, t{t};")
        lines.append(f"mov.b32 ${out}, {{h0, h1}};")
    lines.append("}")
    return "\n".join(lines)


def asm_for(ct: str, i: int, scaled: bool):
    """Slice i of a 512 block (k in [128 i, 128 i + 128)) = value slices 2i, 2i + 1: i = 0, 1 from
    the even word's nibbles (q = 0, 2), i = 2, 3 from the odd word's (``tileq.prepacked``)."""
    if ct == "fp8":
        return _fp8_slice_asm(i // 2, 2 * (i % 2))
    magic, ty = _MAGIC[ct]
    return _slice_asm(i // 2, 2 * (i % 2), magic, ty, scaled)


@gluon.jit
def _operands(w, s, ASM: gl.constexpr, CT: gl.constexpr, SCALED: gl.constexpr, dot: gl.constexpr):
    """The two [64, 64] A operands (k in [0, 64) and [64, 128)) of one 128-wide slice, from the
    consumer's [64, 64] words (and with ``SCALED`` the rows' 16-bit scales, broadcast to the
    words' shape). The words' layout is the [64, 64] dot-operand layout itself, and the
    conversion is elementwise over word pairs: no data moves (``assert_trivial``)."""
    if CT == "bf16":
        if SCALED:
            lo, hi = gl.inline_asm_elementwise(ASM, "=r,=r,r,r,r", [w, s], dtype=(gl.bfloat16, gl.bfloat16),
                                               is_pure=True, pack=2)
        else:
            lo, hi = gl.inline_asm_elementwise(ASM, "=r,=r,r,r", [w], dtype=(gl.bfloat16, gl.bfloat16),
                                               is_pure=True, pack=2)
    else:
        if SCALED:
            lo, hi = gl.inline_asm_elementwise(ASM, "=r,=r,r,r,r", [w, s], dtype=(gl.float16, gl.float16),
                                               is_pure=True, pack=2)
        else:
            lo, hi = gl.inline_asm_elementwise(ASM, "=r,=r,r,r", [w], dtype=(gl.float16, gl.float16),
                                               is_pure=True, pack=2)
    return (gl.convert_layout(lo, dot, assert_trivial=True),
            gl.convert_layout(hi, dot, assert_trivial=True))


@gluon.jit
def _slice_operands(w, s, i: gl.constexpr, ASM0: gl.constexpr, ASM1: gl.constexpr, ASM2: gl.constexpr,
                    ASM3: gl.constexpr, CT: gl.constexpr, SCALED: gl.constexpr, dot: gl.constexpr):
    """``_operands`` of slice ``i`` of a 512 block, whose conversions are ASM0 .. ASM3."""
    if i == 0:
        a0, a1 = _operands(w, s, ASM0, CT, SCALED, dot)
    elif i == 1:
        a0, a1 = _operands(w, s, ASM1, CT, SCALED, dot)
    elif i == 2:
        a0, a1 = _operands(w, s, ASM2, CT, SCALED, dot)
    else:
        a0, a1 = _operands(w, s, ASM3, CT, SCALED, dot)
    return a0, a1


@gluon.jit
def _dp_tiles(tiles, programs):
    """Stream-K's data-parallel part (``streamk.dp_tiles``): whole tiles, program p taking p,
    p + programs, ...: all full waves but the last, so the other tiles (the last full wave and
    the partial one) are shared out by K blocks."""
    return gl.maximum(tiles // programs - 1 + (tiles % programs == 0).to(gl.int32), 0) * programs


@gluon.jit
def _item(item, num_pid_m, num_pid_n, k_blocks, per, GROUP_M: gl.constexpr, SPLIT: gl.constexpr,
          STREAM_K: gl.constexpr):
    """Work item -> (pid_m, pid_n, partial slab, first and end K block). With SPLIT > 1 each tile
    is SPLIT consecutive items over ranges of ceil(k_blocks / SPLIT) K blocks (the last ones may
    be short or empty), the slab the split index. With STREAM_K (``_walk``) the first items are
    the program's data-parallel tiles (all K blocks), the rest the tiles its ``per`` units of the
    stream-K part touch, the slab its rank among the programs sharing the tile."""
    if STREAM_K:
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        tiles = num_pid_m * num_pid_n
        dp = _dp_tiles(tiles, programs)
        if item < dp // programs:
            tile = pid + item * programs
            ks = 0
            kb0 = 0
            kb1 = k_blocks
        else:
            u0 = pid * per
            u1 = gl.minimum(u0 + per, (tiles - dp) * k_blocks)
            t = u0 // k_blocks + item - dp // programs  # (within the stream-K part)
            t0 = t * k_blocks
            tile = dp + t
            ks = pid - t0 // per
            kb0 = gl.maximum(u0 - t0, 0)
            kb1 = gl.minimum(u1 - t0, k_blocks)
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        return pid_m, pid_n, ks, kb0, kb1
    tile_id = item // SPLIT
    ks = item % SPLIT
    pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
    per_split = gl.cdiv(k_blocks, SPLIT)
    kb0 = ks * per_split
    kb1 = gl.minimum(kb0 + per_split, k_blocks)
    return pid_m, pid_n, ks, kb0, kb1


@gluon.jit
def _walk(M, N, K, per, BT: gl.constexpr, SPLIT: gl.constexpr, STREAM_K: gl.constexpr):
    """(token tiles, weight-row tiles, 512-wide K blocks, first item, end item, item step) of the
    persistent walk that every partition follows: items pid, pid + programs, ... (tiles, or
    tiles x SPLIT K ranges); with STREAM_K (streamk.py) items 0, 1, ...: the program's
    data-parallel tiles, then the tiles that its units [pid * per, (pid + 1) * per) of the
    stream-K part's (tile, K block) sequence touch."""
    num_pid_m = gl.cdiv(M, BT)
    num_pid_n = gl.cdiv(N, BLOCK_W)
    k_blocks = gl.cdiv(K, 512)
    if STREAM_K:
        programs = gl.num_programs(0)
        tiles = num_pid_m * num_pid_n
        dp = _dp_tiles(tiles, programs)
        u0 = gl.program_id(0) * per
        u1 = gl.minimum(u0 + per, (tiles - dp) * k_blocks)
        shared = (gl.cdiv(u1, k_blocks) - u0 // k_blocks) * (u1 > u0).to(gl.int32)  # (none past the units)
        return num_pid_m, num_pid_n, k_blocks, 0, dp // programs + shared, 1
    return num_pid_m, num_pid_n, k_blocks, gl.program_id(0), num_pid_m * num_pid_n * SPLIT, gl.num_programs(0)


@gluon.jit
def _producer(w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, M, N, K, per,
              BT: gl.constexpr, GROUP_M: gl.constexpr, WS: gl.constexpr, XS: gl.constexpr,
              SPLIT: gl.constexpr, STREAM_K: gl.constexpr):
    num_pid_m, num_pid_n, k_blocks, first, last, step = _walk(M, N, K, per, BT, SPLIT, STREAM_K)
    w_bytes: gl.constexpr = w_desc.block_type.nbytes
    x_bytes: gl.constexpr = x_desc.block_type.nbytes
    wi = 0
    xi = 0
    for item in range(first, last, step):
        pid_m, pid_n, ks, kb0, kb1 = _item(item, num_pid_m, num_pid_n, k_blocks, per, GROUP_M, SPLIT, STREAM_K)
        off_t = pid_m * BT
        off_w = pid_n * BLOCK_W
        for b in range(kb0, kb1):
            s = wi % WS
            # A fresh mbarrier is in phase 0: waiting on parity 1 returns at once (first pass).
            mbarrier.wait(w_empty.index(s), ((wi // WS) & 1) ^ 1)
            mbarrier.expect(w_ready.index(s), 2 * w_bytes)
            # Two [128, 32] boxes (128-byte rows, swizzled: the consumers' loads are free of bank
            # conflicts) for the block's 64 words per row.
            tma.async_copy_global_to_shared(w_desc, [off_w, b * 64], w_ready.index(s), w_bufs.index(2 * s))
            tma.async_copy_global_to_shared(w_desc, [off_w, b * 64 + 32], w_ready.index(s),
                                            w_bufs.index(2 * s + 1))
            wi += 1
            for j in gl.static_range(2 * SLICES):  # 64-wide activation tiles (128-byte rows)
                s = xi % XS
                mbarrier.wait(x_empty.index(s), ((xi // XS) & 1) ^ 1)
                mbarrier.expect(x_ready.index(s), x_bytes)
                tma.async_copy_global_to_shared(x_desc, [off_t, b * 512 + 64 * j], x_ready.index(s),
                                                x_bufs.index(s))
                xi += 1


@gluon.jit
def _store_partial(y, ws_ptr, slab, rows, row_ok, off_t, M, N, cols_l: gl.constexpr, BT: gl.constexpr):
    """An fp32 partial tile into slab ``slab`` of a [slabs, M, N] workspace (C's orientation)."""
    toks = off_t + gl.arange(0, BT, layout=cols_l)
    ptrs = ws_ptr + slab.to(gl.int64) * M * N + toks.to(gl.int64)[None, :] * N + rows[:, None]
    gl.store(ptrs, y, mask=row_ok[:, None] & (toks < M)[None, :])


@gluon.jit
def _store_tile(out, rows, row_ok, off_t, off_w, c_bufs, c_desc, c_ptr, M, N, ldc, cols_l: gl.constexpr,
                HALF: gl.constexpr, TMA_STORE: gl.constexpr, BT: gl.constexpr):
    """A finished tile [64 weight rows, BT tokens] stored transposed into C [M, N]."""
    if TMA_STORE:
        c_smem = c_bufs.index(HALF)
        tma.store_wait(pendings=0)  # the previous tile's store has read the buffer
        c_smem.store(gl.permute(out, (1, 0)))  # [BT, 64]: C's orientation
        fence_async_shared()
        if off_w < N:  # (the second consumer's rows may lie wholly past N)
            tma.async_copy_shared_to_global(c_desc, [off_t, off_w], c_smem)
    else:
        toks = off_t + gl.arange(0, BT, layout=cols_l)
        c_ptrs = c_ptr + toks.to(gl.int64)[None, :] * ldc + rows[:, None]
        gl.store(c_ptrs, out, mask=row_ok[:, None] & (toks < M)[None, :])


@gluon.jit
def _epilogue(acc, rows, row_ok, off_t, off_w, ks, kb0, kb1, k_blocks, c_bufs, c_desc, c_ptr, ws_ptr,
              sw_ptr, bias_ptr, sx_ptr, M, N, ldc, stride_sw_n, stride_sx, cols_l: gl.constexpr, HALF: gl.constexpr,
              W_SCALE: gl.constexpr, X_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr,
              BT: gl.constexpr, SPLIT: gl.constexpr, STREAM_K: gl.constexpr):
    """A consumer's tile: acc [64 weight rows, BT tokens] -> * token scale -> * weight scale
    (per-channel or per-tensor; group scales were applied in the main loop) -> + bias -> cast ->
    stored transposed (C is [M, N]); over part of K (split, or a stream-K tile this program
    shares), an fp32 partial, the bias in the one from the first K block."""
    y = acc
    if X_SCALE == "vector":  # (W4A8: the activations' per-token scales; split over K, each partial)
        toks_s = off_t + gl.arange(0, BT, layout=cols_l)
        y = y * gl.load(sx_ptr + toks_s * stride_sx, mask=toks_s < M, other=0.0)[None, :]
    elif X_SCALE == "scalar":
        y = y * gl.load(sx_ptr)
    if W_SCALE == "vector":
        y = y * gl.load(sw_ptr + rows * stride_sw_n, mask=row_ok, other=0.0)[:, None]
    elif W_SCALE == "scalar":
        y = y * gl.load(sw_ptr)
    if HAS_BIAS:
        y = y + gl.load(bias_ptr + rows, mask=row_ok & (kb0 == 0), other=0.0)[:, None]
    if SPLIT > 1:
        # Slab ks of the [SPLIT, M, N] workspace (c_ptr), summed in order by
        # split_k.py's reduction; an empty K range writes its zeros (and bias).
        _store_partial(y, c_ptr, ks, rows, row_ok, off_t, M, N, cols_l, BT)
    elif STREAM_K:
        if (kb0 > 0) | (kb1 < k_blocks):
            # Slab ks of ws_ptr; streamk.py's fix-up sums the tile's slabs in order.
            _store_partial(y, ws_ptr, ks, rows, row_ok, off_t, M, N, cols_l, BT)
        else:
            _store_tile(y.to(c_ptr.dtype.element_ty), rows, row_ok, off_t, off_w, c_bufs, c_desc, c_ptr, M, N, ldc,
                        cols_l, HALF, TMA_STORE, BT)
    else:
        _store_tile(y.to(c_ptr.dtype.element_ty), rows, row_ok, off_t, off_w, c_bufs, c_desc, c_ptr, M, N, ldc,
                    cols_l, HALF, TMA_STORE, BT)


@gluon.jit
def _item_rows(item, num_pid_m, num_pid_n, k_blocks, per, N, HALF: gl.constexpr, BT: gl.constexpr,
               GROUP_M: gl.constexpr, SPLIT: gl.constexpr, STREAM_K: gl.constexpr, rows_l: gl.constexpr):
    """A consumer's work item: (ks, kb0, kb1, off_t, off_w, rows, row_ok): its K range, its first
    token and weight row, and its warpgroup's 64 weight rows (``rows_l``) with their bound."""
    pid_m, pid_n, ks, kb0, kb1 = _item(item, num_pid_m, num_pid_n, k_blocks, per, GROUP_M, SPLIT, STREAM_K)
    off_t = pid_m * BT
    off_w = pid_n * BLOCK_W + HALF * HALF_W
    rows = off_w + gl.arange(0, HALF_W, layout=rows_l)
    return ks, kb0, kb1, off_t, off_w, rows, rows < N


@gluon.jit
def _load_words(w_bufs, s, HALF: gl.constexpr, half_l: gl.constexpr, words_l: gl.constexpr):
    """The warpgroup's [64, 64] words of ring slot ``s`` (two [128, 32] halves of a 512-wide K
    block) in ``words_l``: [64, 32] x 2 -> [64, 64] with c = 32 j + c': the join's register bit
    becomes c's bit 5, which ``words_l`` keeps in registers too (a renaming, asserted trivial)."""
    lo = w_bufs.index(2 * s).slice(HALF * HALF_W, HALF_W, dim=0).load(half_l)
    hi = w_bufs.index(2 * s + 1).slice(HALF * HALF_W, HALF_W, dim=0).load(half_l)
    w = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), (HALF_W, 64))
    return gl.convert_layout(w, words_l, assert_trivial=True)


@gluon.jit
def _wait_x(x_bufs, x_ready, xi, XS: gl.constexpr):
    """(s0, s1, x0, x1): the next two activation slots of the ring once loaded, as [64, BT] views
    of the K-major [BT, 64] tiles (one 128-wide slice of K)."""
    s0 = xi % XS
    s1 = (xi + 1) % XS
    mbarrier.wait(x_ready.index(s0), (xi // XS) & 1)
    mbarrier.wait(x_ready.index(s1), ((xi + 1) // XS) & 1)
    return s0, s1, x_bufs.index(s0).permute((1, 0)), x_bufs.index(s1).permute((1, 0))


@gluon.jit
def _consumer(w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, c_bufs, c_desc, c_ptr, ws_ptr, sw_ptr,
              bias_ptr, sx_ptr, M, N, K, ldc, stride_sw_g, stride_sw_n, stride_sx, per,
              HALF: gl.constexpr, CT: gl.constexpr, W_SCALE: gl.constexpr, X_SCALE: gl.constexpr,
              GROUP_K: gl.constexpr,
              HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr, BT: gl.constexpr,
              GROUP_M: gl.constexpr, WS: gl.constexpr, XS: gl.constexpr,
              ASM0: gl.constexpr, ASM1: gl.constexpr, ASM2: gl.constexpr, ASM3: gl.constexpr,
              SPLIT: gl.constexpr, STREAM_K: gl.constexpr, OVERLAP: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BT, 16])
    dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    words_l: gl.constexpr = WORDS_16  # word pairs (c, c + 1) per thread
    half_l: gl.constexpr = HALF_16
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    GROUPED: gl.constexpr = W_SCALE == "group"
    num_pid_m, num_pid_n, k_blocks, first, last, step = _walk(M, N, K, per, BT, SPLIT, STREAM_K)
    wi = 0
    xi = 0
    for item in range(first, last, step):
        ks, kb0, kb1, off_t, off_w, rows, row_ok = _item_rows(item, num_pid_m, num_pid_n, k_blocks, per, N, HALF,
                                                              BT, GROUP_M, SPLIT, STREAM_K, rows_l)
        w_rows = off_w + gl.arange(0, HALF_W, layout=gl.SliceLayout(1, words_l))
        w_rows_ok = w_rows < N
        acc = gl.zeros((HALF_W, BT), gl.float32, mma)
        if GROUPED:
            # The scales of the item's first slice; in the loop those of the next slice are
            # loaded while this slice's wgmma runs (an L2 round trip per slice would stall the
            # conversion).
            sw_next = gl.load(sw_ptr + ((kb0 * 512) // GROUP_K) * stride_sw_g + w_rows * stride_sw_n,
                              mask=w_rows_ok & (kb0 < kb1), other=0.0)
        for b in range(kb0, kb1):
            s = wi % WS
            mbarrier.wait(w_ready.index(s), (wi // WS) & 1)
            w = _load_words(w_bufs, s, HALF, half_l, words_l)
            mbarrier.arrive(w_empty.index(s), count=1)  # the words are in registers now
            wi += 1
            for i in gl.static_range(SLICES):
                if GROUPED:
                    # The group's scale of each weight row, as the 16-bit type, broadcast along
                    # the words (the conversion multiplies each value by it: one rounding, as a
                    # dequantized weight has).
                    s2 = gl.expand_dims(sw_next.to(x_bufs.dtype), 1).broadcast_to([HALF_W, 64])
                    k1 = b * 512 + 128 * (i + 1)  # the next slice (of this block or the next)
                    sw_next = gl.load(sw_ptr + (k1 // GROUP_K) * stride_sw_g + w_rows * stride_sw_n,
                                      mask=w_rows_ok & (k1 < K), other=0.0)
                else:
                    s2 = w
                a0, a1 = _slice_operands(w, s2, i, ASM0, ASM1, ASM2, ASM3, CT, GROUPED, dot)
                s0, s1, x0, x1 = _wait_x(x_bufs, x_ready, xi, XS)
                acc = warpgroup_mma(a0, x0, acc, use_acc=True, is_async=True)
                acc = warpgroup_mma(a1, x1, acc, use_acc=True, is_async=True)
                if OVERLAP and i < SLICES - 1:
                    # This slice's two wgmmas stay in flight while the next slice converts; the
                    # previous slice's are done, and their activation slots go back. (Left in
                    # flight across the K loop's iterations too, ptxas serialized every wgmma
                    # for lack of registers: the block's last slice waits.)
                    acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
                    if i > 0:
                        mbarrier.arrive(x_empty.index((xi - 2) % XS), count=1)
                        mbarrier.arrive(x_empty.index((xi - 1) % XS), count=1)
                elif OVERLAP:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(x_empty.index((xi - 2) % XS), count=1)
                    mbarrier.arrive(x_empty.index((xi - 1) % XS), count=1)
                    mbarrier.arrive(x_empty.index(s0), count=1)
                    mbarrier.arrive(x_empty.index(s1), count=1)
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(x_empty.index(s0), count=1)
                    mbarrier.arrive(x_empty.index(s1), count=1)
                xi += 2
        _epilogue(acc, rows, row_ok, off_t, off_w, ks, kb0, kb1, k_blocks, c_bufs, c_desc, c_ptr, ws_ptr,
                  sw_ptr, bias_ptr, sx_ptr, M, N, ldc, stride_sw_n, stride_sx, cols_l, HALF, W_SCALE, X_SCALE,
                  HAS_BIAS, TMA_STORE, BT, SPLIT, STREAM_K)
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def _operands_fp8(w, ASM: gl.constexpr, dot: gl.constexpr):
    """The two [64, 64] e4m3 A operands (value slices k in [0, 64) and [64, 128)) of one 128-wide
    slice from the consumer's [64, 64] words, a quad of words per call: the words' layout is the
    [64, 64] fp8 dot-operand layout itself (kWidth 4), so nothing moves (``assert_trivial``)."""
    lo, hi = gl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r", [w], dtype=(gl.float8e4nv, gl.float8e4nv),
                                       is_pure=True, pack=4)
    return (gl.convert_layout(lo, dot, assert_trivial=True),
            gl.convert_layout(hi, dot, assert_trivial=True))


@gluon.jit
def _consumer_fp8(w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, c_bufs, c_desc, c_ptr, ws_ptr,
                  sw_ptr,
                  bias_ptr, sx_ptr, M, N, K, ldc, stride_sw_g, stride_sw_n, stride_sx, per,
                  HALF: gl.constexpr, W_SCALE: gl.constexpr, X_SCALE: gl.constexpr, GROUP_K: gl.constexpr,
                  HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr, BT: gl.constexpr,
                  GROUP_M: gl.constexpr, WS: gl.constexpr, XS: gl.constexpr,
                  ASM0: gl.constexpr, ASM1: gl.constexpr, ASM2: gl.constexpr, ASM3: gl.constexpr,
                  SPLIT: gl.constexpr, STREAM_K: gl.constexpr):
    """``_consumer`` for fp8 activations (W4A8 fused): e4m3 weights in registers, fp8 wgmma
    partial sums promoted into fp32 every 128 of K (times the group scales)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BT, 32])
    dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    words_l: gl.constexpr = WORDS_8  # word quads c .. c + 3 per thread (four e4m3 per register)
    half_l: gl.constexpr = HALF_8
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    GROUPED: gl.constexpr = W_SCALE == "group"
    num_pid_m, num_pid_n, k_blocks, first, last, step = _walk(M, N, K, per, BT, SPLIT, STREAM_K)
    wi = 0
    xi = 0
    for item in range(first, last, step):
        ks, kb0, kb1, off_t, off_w, rows, row_ok = _item_rows(item, num_pid_m, num_pid_n, k_blocks, per, N, HALF,
                                                              BT, GROUP_M, SPLIT, STREAM_K, rows_l)
        acc = gl.zeros((HALF_W, BT), gl.float32, mma)
        for b in range(kb0, kb1):
            s = wi % WS
            mbarrier.wait(w_ready.index(s), (wi // WS) & 1)
            for i in gl.static_range(SLICES):
                # The words, reloaded from shared memory for each slice (only its two words of a
                # quad stay live): 32 registers held through the block's four slices spilled.
                w = _load_words(w_bufs, s, HALF, half_l, words_l)
                if i == 0:
                    a0, a1 = _operands_fp8(w, ASM0, dot)
                elif i == 1:
                    a0, a1 = _operands_fp8(w, ASM1, dot)
                elif i == 2:
                    a0, a1 = _operands_fp8(w, ASM2, dot)
                else:
                    a0, a1 = _operands_fp8(w, ASM3, dot)
                s0, s1, x0, x1 = _wait_x(x_bufs, x_ready, xi, XS)
                # This slice's sum alone (use_acc=False first), in the fp8 wgmma's reduced
                # precision over 128 of K at most, then promoted.
                part = warpgroup_mma(a0, x0, gl.zeros((HALF_W, BT), gl.float32, mma), use_acc=False,
                                     is_async=True)
                part = warpgroup_mma(a1, x1, part, use_acc=True, is_async=True)
                if GROUPED:  # (the slice's row scales, loaded while its wgmma runs)
                    k1 = b * 512 + 128 * i
                    sw = gl.load(sw_ptr + (k1 // GROUP_K) * stride_sw_g + rows * stride_sw_n,
                                 mask=row_ok & (k1 < K), other=0.0)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                mbarrier.arrive(x_empty.index(s0), count=1)
                mbarrier.arrive(x_empty.index(s1), count=1)
                xi += 2
                if i == SLICES - 1:
                    mbarrier.arrive(w_empty.index(s), count=1)  # the block's words are used
                    wi += 1
                # Promotion on the CUDA cores, while the other consumer's wgmma runs: one FFMA
                # per element as inline PTX (times 1.0 without group scales). Written as acc +=
                # part * sw or acc += part, ptxas ran short of registers, serialized every
                # wgmma and spilled 424-568 B with group scales, 16-96 B without (sm_90 build).
                if GROUPED:
                    swb = gl.expand_dims(sw, 1).broadcast_to([HALF_W, BT])
                else:
                    swb = gl.full([HALF_W, BT], 1.0, gl.float32, mma)
                acc = gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [part, swb, acc],
                                                dtype=gl.float32, is_pure=True, pack=1)
        _epilogue(acc, rows, row_ok, off_t, off_w, ks, kb0, kb1, k_blocks, c_bufs, c_desc, c_ptr, ws_ptr,
                  sw_ptr, bias_ptr, sx_ptr, M, N, ldc, stride_sw_n, stride_sx, cols_l, HALF, W_SCALE, X_SCALE,
                  HAS_BIAS, TMA_STORE, BT, SPLIT, STREAM_K)
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def _i4p_prefill_kernel(
    w_desc, x_desc, c_desc, c_ptr, sw_ptr, bias_ptr, sx_ptr, ws_ptr, M, N, K, ldc, stride_sw_g, stride_sw_n,
    stride_sx, per, CT: gl.constexpr, W_SCALE: gl.constexpr, GROUP_K: gl.constexpr, HAS_BIAS: gl.constexpr,
    TMA_STORE: gl.constexpr, BT: gl.constexpr, GROUP_M: gl.constexpr, WS: gl.constexpr,
    XS: gl.constexpr, ASM0: gl.constexpr, ASM1: gl.constexpr, ASM2: gl.constexpr,
    ASM3: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    SPLIT: gl.constexpr = 1, X_SCALE: gl.constexpr = "none", STREAM_K: gl.constexpr = False,
    OVERLAP: gl.constexpr = False,
):
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * WS, BLOCK_W, 32], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [XS, BT, 64], x_desc.layout)
    if TMA_STORE:
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, BT, HALF_W], c_desc.layout)
    else:
        # Partition arguments cannot be None: the unused slots carry the output pointer.
        c_bufs = c_ptr
        c_desc = c_ptr
    if not STREAM_K:
        ws_ptr = c_ptr
    w_ready = gl.allocate_shared_memory(gl.int64, [WS, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [WS, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(WS):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=2)  # one arrival per consumer
    for i in gl.static_range(XS):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(x_empty.index(i), count=2)
    fence_async_shared()

    if CT == "fp8":
        gl.warp_specialize([
            (_consumer_fp8, (w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, c_bufs, c_desc, c_ptr, ws_ptr,
                             sw_ptr, bias_ptr, sx_ptr, M, N, K, ldc, stride_sw_g, stride_sw_n, stride_sx,
                             per, 0, W_SCALE, X_SCALE, GROUP_K, HAS_BIAS, TMA_STORE, BT, GROUP_M, WS, XS, ASM0, ASM1,
                             ASM2, ASM3, SPLIT, STREAM_K)),
            (_consumer_fp8, (w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, c_bufs, c_desc, c_ptr, ws_ptr,
                             sw_ptr, bias_ptr, sx_ptr, M, N, K, ldc, stride_sw_g, stride_sw_n, stride_sx,
                             per, 1, W_SCALE, X_SCALE, GROUP_K, HAS_BIAS, TMA_STORE, BT, GROUP_M, WS, XS, ASM0, ASM1,
                             ASM2, ASM3, SPLIT, STREAM_K)),
            (_producer, (w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, M, N, K, per, BT,
                         GROUP_M, WS, XS, SPLIT, STREAM_K)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, c_bufs, c_desc, c_ptr, ws_ptr,
                         sw_ptr, bias_ptr, sx_ptr, M, N, K, ldc, stride_sw_g, stride_sw_n, stride_sx, per, 0,
                         CT, W_SCALE, X_SCALE, GROUP_K, HAS_BIAS, TMA_STORE, BT, GROUP_M, WS, XS, ASM0, ASM1, ASM2,
                         ASM3, SPLIT, STREAM_K, OVERLAP)),
            (_consumer, (w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, c_bufs, c_desc, c_ptr, ws_ptr,
                         sw_ptr, bias_ptr, sx_ptr, M, N, K, ldc, stride_sw_g, stride_sw_n, stride_sx, per, 1,
                         CT, W_SCALE, X_SCALE, GROUP_K, HAS_BIAS, TMA_STORE, BT, GROUP_M, WS, XS, ASM0, ASM1, ASM2,
                         ASM3, SPLIT, STREAM_K, OVERLAP)),
            (_producer, (w_desc, x_desc, w_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, M, N, K, per, BT,
                         GROUP_M, WS, XS, SPLIT, STREAM_K)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
