"""Stream-K for the Gluon int4 prefill kernel: every program gets the same number of K blocks.

The kernel's persistent grid otherwise walks whole tiles (or tiles split into equal K ranges): a
grid of 80 tiles leaves 52 of 132 SMs idle, 160 tiles take two waves of which the second is 28
tiles wide. Stream-K lays the (tile, 512-wide K block) units out in one sequence, tile by tile
in the kernel's grouped tile order, and gives program p the units [p * per, (p + 1) * per) with
per = ceil(units / SMs): all programs but the last do the same work. A tile whose K blocks one
program covers is finished by it (epilogue and store as usual); a tile shared by several programs
gets an fp32 partial from each (its scales applied, the bias in the one holding K block 0) in
slab r of a [slabs, M, N] workspace, r the program's rank among the tile's programs, and
``_fixup_kernel`` sums those slabs in rank order (deterministic: no atomics) and casts. At most
one shared tile starts in each program, so the partials' traffic is bounded by the programs'
count of tiles, not by the output's size (a split over K writes every tile once per range).

Everything the kernel and the fix-up need is two integers: ``per`` and the K blocks per tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ..kernels.gemm_kernel import grouped_tile

BLOCK_K = 512  # K per unit: one of the kernel's K blocks
FIXUP_TOKENS = 32  # token rows the fix-up sums at a time


@dataclass(frozen=True)
class Schedule:
    """The stream-K layout of one call: ``per`` units per program, ``programs`` programs (the
    last may hold fewer units), ``slabs`` the most programs sharing one tile (the workspace's
    slabs), ``shared`` the tiles that more than one program touches (the fix-up's work)."""

    units: int
    per: int
    programs: int
    slabs: int
    shared: int


def k_blocks(k: int) -> int:
    return -(-k // BLOCK_K)


def schedule(tiles: int, k: int, num_sms: int) -> Schedule:
    """The layout of ``tiles`` output tiles (``prefill.tiles``) over K on ``num_sms`` SMs."""
    kb = k_blocks(k)
    units = tiles * kb
    per = -(-units // num_sms)
    programs = -(-units // per)
    slabs, shared = 1, 0
    for t in range(tiles):
        count = ((t + 1) * kb - 1) // per - (t * kb) // per + 1
        slabs = max(slabs, count)
        shared += count > 1
    return Schedule(units, per, programs, slabs, shared)


def segments(program: int, s: Schedule, kb: int) -> list[tuple[int, int, int, int]]:
    """(tile, first K block, end K block, slab) of each tile ``program`` touches, in its order:
    the kernel's ``_walk`` / ``_item`` in Python (for tests and cost models)."""
    u0 = program * s.per
    u1 = min(u0 + s.per, s.units)
    out = []
    for t in range(u0 // kb, max(-(-u1 // kb), u0 // kb)):
        out.append((t, max(u0 - t * kb, 0), min(u1 - t * kb, kb), program - (t * kb) // s.per))
    return out


@triton.jit
def _fixup_kernel(ws_ptr, c_ptr, M, N, ldc, per, k_blocks, num_pid_m, num_pid_n, BT: tl.constexpr,
                  GROUP_M: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program c - 1 finishes the tile in which program c's units start, when they start inside
    it and c is the second program of that tile (one fix-up per shared tile): the sum of its
    slabs 0 .. count - 1 in order, cast, into C [M, N] (row stride ldc)."""
    c = tl.program_id(0) + 1
    u = c * per
    t = u // k_blocks
    first = (t * k_blocks) // per
    if (u % k_blocks != 0) & (c == first + 1):
        count = ((t + 1) * k_blocks - 1) // per - first + 1
        pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        cols = pid_n * 128 + tl.arange(0, 128)
        slab = M.to(tl.int64) * N
        for t0 in range(0, BT, BLOCK_T):
            toks = pid_m * BT + t0 + tl.arange(0, BLOCK_T)
            mask = (toks < M)[:, None] & (cols < N)[None, :]
            offs = toks.to(tl.int64)[:, None] * N + cols[None, :]
            acc = tl.zeros((BLOCK_T, 128), dtype=tl.float32)
            for r in range(0, count):
                acc += tl.load(ws_ptr + r * slab + offs, mask=mask, other=0.0)
            tl.store(c_ptr + toks.to(tl.int64)[:, None] * ldc + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                     mask=mask)
