"""Sum the split tiles' fp32 partials of the Gluon kernel (``ws_gemm.py``, SPLIT_K > 1) into C.

The Gluon kernel computes the tiles of its full waves whole and splits the tiles of the last,
partial wave over K (``_items``): split tile t (the tile ``n_full + t`` in the kernel's
grouped order) leaves SPLIT_K partials, already scaled (the bias in the first), in the
workspace's [BM, BN] blocks t * SPLIT_K .. t * SPLIT_K + SPLIT_K - 1. One program sums BLOCK_R
rows of one tile's blocks in split order (deterministic), casts and stores them with masks
(TRANS_C: the kernel computed C^T's tiles, M and N are C^T's, and the rows go to C's columns).

A Triton (tl) kernel, so the CPU tests run it through the interpreter; the tile order is the
portable kernel's ``grouped_tile``, which the Gluon kernel calls too.
"""

import triton
import triton.language as tl

from ..gemm_kernel import grouped_tile

# Rows of a tile per program: 16 x 128 fp32 elements from each split block.
BLOCK_R = 16


@triton.jit
def _split_tiles_reduce_kernel(ws_ptr, c_ptr, M, N, ldc, n_full, SPLIT_K: tl.constexpr, BM: tl.constexpr,
                               BN: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_R: tl.constexpr,
                               TRANS_C: tl.constexpr = False):
    t = tl.program_id(0)  # the split tile
    r0 = tl.program_id(1) * BLOCK_R  # its first row here
    pid_m, pid_n = grouped_tile(n_full + t, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    lr = r0 + tl.arange(0, BLOCK_R)
    lc = tl.arange(0, BN)
    block = ws_ptr + (t * SPLIT_K).to(tl.int64) * (BM * BN) + lr[:, None] * BN + lc[None, :]
    acc = tl.zeros((BLOCK_R, BN), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(block + s * (BM * BN))
    rows = pid_m * BM + lr
    cols = pid_n * BN + lc
    if TRANS_C:
        ptrs = c_ptr + cols.to(tl.int64)[None, :] * ldc + rows[:, None]
    else:
        ptrs = c_ptr + rows.to(tl.int64)[:, None] * ldc + cols[None, :]
    tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])
