"""Stream-K for the Gluon int4 prefill kernel: every program gets the same number of K blocks.

The kernel's persistent grid otherwise walks whole tiles (or tiles split into equal K ranges): a
grid of 80 tiles leaves 52 of 132 SMs idle, 160 tiles take two waves of which the second is 28
tiles wide. Here (the hybrid of data-parallel tiles and stream-K) one program runs per SM:

- all full waves but the last are data-parallel: program p takes tiles p, p + programs, ... whole,
  in the kernel's grouped tile order (neighbouring tiles share weights and activations in L2);
- the remaining tiles (the last full wave and the partial one) are laid out as one sequence of
  (tile, 512-wide K block) units, tile after tile, and program p takes units
  [p * per, (p + 1) * per), per = ceil(units / programs): the programs end together.

A tile one program covers whole is finished by it (epilogue and store as usual); a tile shared by
several programs gets an fp32 partial from each (its scales applied, the bias in the one holding
K block 0) in slab r of a [slabs, M, N] workspace, r the program's rank among the tile's programs,
and ``_sum_shared_tiles_kernel`` sums those slabs in rank order (deterministic: no atomics) and
casts. A program writes at most two partial tiles (where its units start and where they end), so
the partials' traffic is bounded by twice the number of programs, not by the output's size (a
split over K writes every tile once per range). That sum is not the split-K reduction
(``kernels/split_k.py``): only the shared tiles have partials, each as many as the programs its
units span (one to ``slabs``), and the schedule, not a grid of split tiles, says which.

``schedule`` and ``segments`` are the kernel's walk (``prefill_kernel._walk`` / ``_item``) in
Python: the launcher sizes the workspace with them, the tests check the layout with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ..tiles import grouped_tile

BLOCK_K = 512  # K per unit: one of the kernel's K blocks
SUM_TOKENS = 32  # token rows per program of the shared tiles' sum


@dataclass(frozen=True)
class Schedule:
    """The stream-K layout of one call on ``programs`` programs (one per SM): ``dp`` whole tiles
    first (``dp / programs`` per program), then ``units`` (tile, K block) units of the other
    tiles, ``per`` per program (the last ones may hold fewer or none); ``slabs`` the most programs
    sharing one tile (the workspace's slabs), ``shared`` the tiles that several programs share."""

    tiles: int
    k_blocks: int
    programs: int
    dp: int
    units: int
    per: int
    slabs: int
    shared: int


def k_blocks(k: int) -> int:
    return -(-k // BLOCK_K)


def dp_tiles(tiles: int, programs: int) -> int:
    """The data-parallel tiles: all full waves but the last (none below two waves), every wave
    when the tiles fill their waves exactly."""
    full = tiles // programs
    return max(full - 1 + (tiles % programs == 0), 0) * programs


def schedule(tiles: int, k: int, programs: int) -> Schedule:
    """The layout of ``tiles`` output tiles (``prefill_launch.tiles``) over K on ``programs`` programs."""
    kb = k_blocks(k)
    dp = dp_tiles(tiles, programs)
    units = (tiles - dp) * kb
    per = max(-(-units // programs), 1)
    slabs, shared = 1, 0
    for t in range(tiles - dp):
        count = ((t + 1) * kb - 1) // per - (t * kb) // per + 1
        slabs = max(slabs, count)
        shared += count > 1
    return Schedule(tiles, kb, programs, dp, units, per, slabs, shared)


def segments(program: int, s: Schedule) -> list[tuple[int, int, int, int]]:
    """(tile, first K block, end K block, slab) of each item of ``program``, in its order."""
    out = [(program + i * s.programs, 0, s.k_blocks, 0) for i in range(s.dp // s.programs)]
    kb = s.k_blocks
    u0 = program * s.per
    u1 = min(u0 + s.per, s.units)
    if u1 > u0:
        for t in range(u0 // kb, -(-u1 // kb)):
            out.append((s.dp + t, max(u0 - t * kb, 0), min(u1 - t * kb, kb), program - (t * kb) // s.per))
    return out


@triton.jit
def _sum_shared_tiles_kernel(ws_ptr, c_ptr, M, N, ldc, per, k_blocks, dp, units, num_pid_m, num_pid_n,
                             BT: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_T: tl.constexpr, SLABS: tl.constexpr):
    """Programs (c - 1, j) finish token rows [j * BLOCK_T, (j + 1) * BLOCK_T) of the tile in which
    program c's stream-K units start, when they start inside it and c is the second program of
    that tile (one sum per shared tile): the sum of its slabs 0 .. count - 1 in order (all
    loaded at once, SLABS the most any tile has), cast, into C [M, N] (row stride ldc)."""
    c = tl.program_id(0) + 1
    u = c * per
    t = u // k_blocks
    first = (t * k_blocks) // per
    if (u < units) & (u % k_blocks != 0) & (c == first + 1):
        count = ((t + 1) * k_blocks - 1) // per - first + 1
        pid_m, pid_n = grouped_tile(dp + t, num_pid_m, num_pid_n, GROUP_M)
        cols = pid_n * 128 + tl.arange(0, 128)
        toks = pid_m * BT + tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = (toks < M)[:, None] & (cols < N)[None, :]
        offs = toks.to(tl.int64)[:, None] * N + cols[None, :]
        slab = M.to(tl.int64) * N
        acc = tl.zeros((BLOCK_T, 128), dtype=tl.float32)
        for r in tl.static_range(SLABS):
            acc += tl.load(ws_ptr + r * slab + offs, mask=mask & (r < count), other=0.0)
        tl.store(c_ptr + toks.to(tl.int64)[:, None] * ldc + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
