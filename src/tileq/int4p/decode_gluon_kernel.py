"""An sm_90 decode kernel on prepacked int4 weights in Gluon, one warpgroup per program (GPU-tested,
not routed: slower than the Triton decode kernel, bench/results/h200/int4/gluon-decode/).

The Triton decode kernel (``kernel.py``) waits for every wgmma right after issuing it (Triton
3.6 does so for a register A operand), so a program's conversion and its tensor-core work never
overlap; it relies on two to four programs per SM to fill the gaps (46% of issue slots used at
M = 1, bench/PERF_NOTES.md). This kernel is the same computation, C^T = W X^T with 64 weight rows
and BT tokens per program (swap-AB) and the split over K as ranges of 512-wide blocks, written
with explicit waits:

- the program's own warps issue the TMA loads of a block (the words as two [64, 32] int32 boxes,
  the activations as eight [BT, 64] tiles) STAGES - 1 blocks ahead into a ring, one mbarrier per
  slot (no producer warp: several programs share an SM);
- per 128-wide slice the words (read from shared memory once per block, in the A operand's
  layout: ``prefill_kernel._load_words``) become two [64, 64] 16-bit operands
  (``prefill_kernel._slice_operands``, unscaled), two async wgmmas start a fresh fp32 partial sum, and
  while they run the previous slice's partial is waited for and promoted into the accumulator
  times its group scales in fp32 (exact, as the Triton kernel does; the scales loaded a block
  ahead: loaded at the promotion, each one waited for an L2 round trip); a block's last slice is
  waited for in the block (kept in flight across the K loop, the prefill kernel's wgmmas were
  serialized by ptxas);
- the epilogue is the prefill kernel's (``prefill_kernel._epilogue``: token and weight scales,
  bias, masked transposed stores; split over K, fp32 partials summed by the reduction kernel or,
  with FIXUP, by the tile's last program).
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

from .prefill_kernel import HALF_16, HALF_W, SLICES, WORDS_16, _epilogue, _load_words, _slice_operands


@gluon.jit
def _issue(w_desc, x_desc, w_bufs, x_bufs, ready, b, s, off_w, off_t):
    """The TMA loads of K block ``b`` into ring slot ``s``: its words (two [64, 32] boxes) and its
    activations (eight [BT, 64] tiles), all counted on ``ready[s]``."""
    mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes + 8 * x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(w_desc, [off_w, b * 64], ready.index(s), w_bufs.index(2 * s))
    tma.async_copy_global_to_shared(w_desc, [off_w, b * 64 + 32], ready.index(s), w_bufs.index(2 * s + 1))
    for j in gl.static_range(2 * SLICES):
        tma.async_copy_global_to_shared(x_desc, [off_t, b * 512 + 64 * j], ready.index(s), x_bufs.index(8 * s + j))


@gluon.jit
def _group_scales(sw_ptr, k, K, rows, row_ok, stride_sw_g, stride_sw_n, GROUP_K: gl.constexpr):
    """The rows' scales of the group holding K index ``k`` (zeros past K: that part is zero)."""
    return gl.load(sw_ptr + (k // GROUP_K) * stride_sw_g + rows * stride_sw_n, mask=row_ok & (k < K), other=0.0)


@gluon.jit
def _block_scales(sw_ptr, b, K, rows, row_ok, stride_sw_g, stride_sw_n, W_SCALE: gl.constexpr,
                  GROUP_K: gl.constexpr):
    """The group scales of K block ``b``'s four slices (loaded a block ahead of their use: next to
    their use every promotion waited for an L2 round trip), or zeros without group scales."""
    if W_SCALE == "group":
        return (_group_scales(sw_ptr, b * 512, K, rows, row_ok, stride_sw_g, stride_sw_n, GROUP_K),
                _group_scales(sw_ptr, b * 512 + 128, K, rows, row_ok, stride_sw_g, stride_sw_n, GROUP_K),
                _group_scales(sw_ptr, b * 512 + 256, K, rows, row_ok, stride_sw_g, stride_sw_n, GROUP_K),
                _group_scales(sw_ptr, b * 512 + 384, K, rows, row_ok, stride_sw_g, stride_sw_n, GROUP_K))
    z = gl.zeros_like(rows.to(gl.float32))
    return z, z, z, z


@gluon.jit
def _promote(acc, part, sw, W_SCALE: gl.constexpr):
    """acc + a slice's partial sum, times the rows' group scales ``sw`` in fp32 (other weight
    scales wait for the epilogue)."""
    if W_SCALE == "group":
        return acc + part * gl.expand_dims(sw, 1)
    return acc + part


@gluon.jit
def _i4p_decode_kernel(
    w_desc, x_desc, c_ptr, sw_ptr, bias_ptr, sx_ptr, ws_ptr, sem_ptr, M, N, K, ldc, stride_sw_g, stride_sw_n,
    stride_sx, CT: gl.constexpr, W_SCALE: gl.constexpr, X_SCALE: gl.constexpr, GROUP_K: gl.constexpr,
    HAS_BIAS: gl.constexpr, BT: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, ASM0: gl.constexpr,
    ASM1: gl.constexpr, ASM2: gl.constexpr, ASM3: gl.constexpr, FIXUP: gl.constexpr,
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)

    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * STAGES, HALF_W, 32], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [8 * STAGES, BT, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    if not FIXUP:
        sem_ptr = c_ptr  # (unused)
    if SPLIT == 1:
        ws_ptr = c_ptr

    pid = gl.program_id(0)
    ks = gl.program_id(1)
    num_m = gl.cdiv(M, BT)
    off_t = (pid % num_m) * BT  # the token tiles of one weight tile run side by side (L2)
    off_w = (pid // num_m) * HALF_W
    k_blocks = gl.cdiv(K, 512)
    per = gl.cdiv(k_blocks, SPLIT)
    kb0 = ks * per
    kb1 = gl.minimum(kb0 + per, k_blocks)
    rows = off_w + gl.arange(0, HALF_W, layout=rows_l)
    row_ok = rows < N

    for i in gl.static_range(STAGES - 1):  # the ring's first blocks
        if kb0 + i < kb1:
            _issue(w_desc, x_desc, w_bufs, x_bufs, ready, kb0 + i, i, off_w, off_t)
    acc = gl.zeros((HALF_W, BT), gl.float32, mma)
    scales = _block_scales(sw_ptr, kb0, K, rows, row_ok, stride_sw_g, stride_sw_n, W_SCALE, GROUP_K)
    for b in range(kb0, kb1):
        here = scales
        scales = _block_scales(sw_ptr, b + 1, K, rows, row_ok, stride_sw_g, stride_sw_n, W_SCALE, GROUP_K)
        c = b - kb0
        s = c % STAGES
        # Slot (c - 1) % STAGES is free: its words were read and its wgmmas waited for in the
        # previous block, by every warp once they pass this barrier.
        gl.thread_barrier()
        if b + STAGES - 1 < kb1:
            _issue(w_desc, x_desc, w_bufs, x_bufs, ready, b + STAGES - 1, (c + STAGES - 1) % STAGES, off_w, off_t)
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        w = _load_words(w_bufs, s, 0, HALF_16, WORDS_16)
        for i in gl.static_range(SLICES):
            a0, a1 = _slice_operands(w, w, i, ASM0, ASM1, ASM2, ASM3, CT, False, dot)
            x0 = x_bufs.index(8 * s + 2 * i).permute((1, 0))
            x1 = x_bufs.index(8 * s + 2 * i + 1).permute((1, 0))
            part = warpgroup_mma(a0, x0, gl.zeros((HALF_W, BT), gl.float32, mma), use_acc=False, is_async=True)
            part = warpgroup_mma(a1, x1, part, use_acc=True, is_async=True)
            if i > 0:  # the previous slice's sum, promoted while this slice's wgmmas run
                prev = warpgroup_mma_wait(num_outstanding=2, deps=(prev,))
                acc = _promote(acc, prev, here[i - 1], W_SCALE)
            prev = part
        prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
        acc = _promote(acc, prev, here[3], W_SCALE)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    _epilogue(acc, rows, row_ok, off_t, off_w, ks, kb0, kb1, k_blocks, c_ptr, c_ptr, c_ptr, ws_ptr, sem_ptr, sw_ptr,
              bias_ptr, sx_ptr, M, N, ldc, stride_sw_n, stride_sx, cols_l, 0, W_SCALE, X_SCALE, HAS_BIAS, False, BT,
              SPLIT, False, FIXUP)
