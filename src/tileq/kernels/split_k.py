"""Split-K: fp32 partial sums over K, summed in split order (bit-identical run to run).

A kernel that splits K writes each program's partial (already scaled, the bias in the first
split's) into a workspace, and the partials of a tile are summed in split order in one of two ways:

- by the kernel itself (``store_split_partial`` with SUM, one launch): each program counts itself
  in on its tile's counter once its partial is stored; the tile's last program sums the partials
  and stores the output tile, then puts the counter back to zero (zero between calls: the tile
  counters of ``buffers.tile_counters``). The portable kernel's and the int4 decode kernel's
  decode splits;
- afterwards by ``_split_reduce_kernel`` (a second launch), over a workspace laid out 'flat'
  ([SPLIT_K, rows, cols] in a kernel's orientation: the portable kernel's prefill splits, the int4
  kernels' splits) or 'tiles' (the Gluon kernel's split tiles: [tiles x SPLIT_K, BM, BN] blocks,
  split tile t being tile ``first_tile + t`` of its grouped order).

Either way ``_sum_splits`` adds the partials, so the two give the same bits. The int4 stream-K
paths sum partial tiles of a stream-K schedule, a different operation (a varying number of
programs per tile, each at its own slot): ``int4p/kernel.py``'s ``_streamk`` counts in with the
same protocol (``count_in``, ``release``), ``int4p/streamk.py`` sums the Gluon kernel's shared
tiles.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .direct import KernelCall
from .pdl import wait_upstream
from .tiles import grouped_tile

REDUCE_BLOCK = 1024  # 'flat': workspace elements per program
TILE_ROWS = 16  # 'tiles': rows of a tile per program (16 x 128 fp32 elements from each split block)


@triton.jit
def _sum_splits(ptrs, step, mask, SPLIT_K: tl.constexpr, CACHE: tl.constexpr):
    """The SPLIT_K partials at ``ptrs``, ``ptrs + step``, ... added in split order (fp32); masked
    elements read 0 (``mask`` None: every element is read)."""
    total = tl.zeros(ptrs.shape, dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        if mask is None:
            total += tl.load(ptrs + i * step, cache_modifier=CACHE)
        else:
            total += tl.load(ptrs + i * step, mask=mask, other=0.0, cache_modifier=CACHE)
    return total


@triton.jit
def count_in(sem_ptr, tile):
    """Count this program in on ``tile``'s counter; returns the programs counted before it. Every
    thread's partial is stored before one thread counts the program in (a CTA barrier, then a
    gpu-scope release); the count's acquire and Triton's broadcast of it (a barrier) order the
    loads of the program that sees itself last after the other programs' stores."""
    tl.debug_barrier()
    return tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")


@triton.jit
def release(sem_ptr, tile):
    """Put ``tile``'s counter back to zero, ready for the next call."""
    tl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def store_split_partial(y, ws_ptr, split, rows, cols, offs, mask, SPLIT_K: tl.constexpr, SUM: tl.constexpr,
                        sem_ptr, tile, out_ptr, out_major, out_minor, ldc):
    """Store a program's fp32 partial ``y`` (split ``split`` of SPLIT_K) into slab ``split`` of the
    workspace [SPLIT_K, rows, cols] at ``offs`` (within a slab, ``mask``). With SUM the tile's
    last program (counter ``tile``) sums the SPLIT_K partials in split order (through L2: other
    SMs wrote them) and stores them to ``out_ptr + out_major * ldc + out_minor``."""
    tl.store(ws_ptr + split.to(tl.int64) * rows * cols + offs, y, mask=mask)
    if SUM:
        if count_in(sem_ptr, tile) == SPLIT_K - 1:
            total = _sum_splits(ws_ptr + offs, rows * cols, mask, SPLIT_K, ".cg")
            tl.store(out_ptr + out_major * ldc + out_minor, total.to(out_ptr.dtype.element_ty), mask=mask)
            release(sem_ptr, tile)


@triton.jit
def _split_reduce_kernel(ws_ptr, c_ptr, M, N, ldc, total, first_tile, SPLIT_K: tl.constexpr, LAYOUT: tl.constexpr,
                         BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                         TRANS: tl.constexpr, PDL: tl.constexpr):
    """Sum the SPLIT_K fp32 partials of a workspace in split order, cast, into C (row stride ldc;
    TRANS: the partials are C^T's, stored transposed). LAYOUT 'flat': [SPLIT_K, M, N] of
    ``total`` = M x N values, BLOCK of them per program (M unused). 'tiles': the Gluon kernel's
    [tiles x SPLIT_K, BM, BN] blocks; program (t, j) sums rows [j BLOCK, (j + 1) BLOCK) of split
    tile t (``total`` unused). PDL: launched with programmatic dependent launch, it waits for the
    kernel that wrote the partials."""
    if PDL:
        wait_upstream()
    if LAYOUT == "flat":
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < total
        s = _sum_splits(ws_ptr + offs, total, ok, SPLIT_K, "")
        row = offs // N
        col = offs % N
        if TRANS:
            tl.store(c_ptr + col * ldc + row, s.to(c_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(c_ptr + row * ldc + col, s.to(c_ptr.dtype.element_ty), mask=ok)
    else:
        t = tl.program_id(0)
        lr = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        lc = tl.arange(0, BN)
        pid_m, pid_n = grouped_tile(first_tile + t, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
        block = ws_ptr + (t * SPLIT_K).to(tl.int64) * (BM * BN) + lr[:, None] * BN + lc[None, :]
        s = _sum_splits(block, BM * BN, None, SPLIT_K, "")
        rows = pid_m * BM + lr
        cols = pid_n * BN + lc
        if TRANS:
            ptrs = c_ptr + cols.to(tl.int64)[None, :] * ldc + rows[:, None]
        else:
            ptrs = c_ptr + rows.to(tl.int64)[:, None] * ldc + cols[None, :]
        tl.store(ptrs, s.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _options(pdl: bool) -> dict:
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)


def flat_reduce_call(rows: int, cols: int, ldc: int, split: int, out_dtype: torch.dtype, transposed: bool, *,
                     pdl: bool = False) -> KernelCall:
    """The reduction of a [split, rows, cols] fp32 workspace (a kernel's orientation) into an
    output of row stride ``ldc`` (``transposed``: stored transposed); ``pdl``: launched with
    programmatic dependent launch."""
    total = rows * cols
    kwargs = dict(SPLIT_K=split, LAYOUT="flat", BLOCK=REDUCE_BLOCK, BM=1, BN=1, GROUP_M=1, TRANS=transposed,
                  num_warps=4, **_options(pdl))
    return KernelCall(_THIS, "_split_reduce_kernel", (_cdiv(total, REDUCE_BLOCK),), (0, cols, ldc, total, 0),
                      kwargs, (torch.float32, out_dtype))


def tiles_reduce_call(split_tiles: int, rows: int, cols: int, ldc: int, first_tile: int, split: int, bm: int,
                      bn: int, group_m: int, out_dtype: torch.dtype, transposed: bool) -> KernelCall:
    """The reduction of ``split_tiles`` split tiles of a rows x cols output (tiles ``first_tile``
    on in the grouped order of ``group_m``), each SPLIT_K [bm, bn] fp32 blocks."""
    kwargs = dict(SPLIT_K=split, LAYOUT="tiles", BLOCK=TILE_ROWS, BM=bm, BN=bn, GROUP_M=group_m, TRANS=transposed,
                  num_warps=4, PDL=False)
    return KernelCall(_THIS, "_split_reduce_kernel", (split_tiles, bm // TILE_ROWS), (rows, cols, ldc, 0, first_tile),
                      kwargs, (torch.float32, out_dtype))


_THIS = sys.modules[__name__]  # KernelCall looks the kernel up here at call time (tests stub it)
