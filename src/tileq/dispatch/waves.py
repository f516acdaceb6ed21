"""The one cost model of a grid on the SMs: waves, the last wave's fill, split over K.

Every rule that sizes a grid (the portable kernel's decode split, the Gluon prefill kernel's
tilings, the int4 decode and prefill kernels' splits and stream-K) counts in these terms: a grid
of ``tiles`` programs on ``slots`` concurrent program slots (SMs x programs per SM) runs in
``waves(tiles, slots)`` rounds, the last one ``last_wave_fill`` full.
"""

from __future__ import annotations

import math


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def waves(tiles: int, slots: int) -> int:
    """Rounds of a grid of ``tiles`` programs on ``slots`` program slots (a partial round counts
    whole: it takes as long as a full one)."""
    return cdiv(tiles, slots)


def wave_fraction(tiles: int, slots: int) -> float:
    """Waves as a fraction (1.25: one full wave and a quarter-full one)."""
    return tiles / slots


def last_wave_fill(tiles: int, slots: int) -> float:
    """How full the last round is, in (0, 1]: 1 when the tiles fill every round."""
    rem = tiles % slots
    return 1.0 if rem == 0 else rem / slots


def split_to_fill(tiles: int, slots: int, k_steps: int, min_steps: int, max_split: int) -> int:
    """K ranges per tile of the last, partial wave (1: none): as many as fill the slots, each
    range at least ``min_steps`` K steps, at most ``max_split``."""
    rem = tiles % slots
    if rem == 0:
        return 1
    return max(1, min(slots // rem, k_steps // min_steps, max_split))


def split_cost(tiles: int, k_steps: int, split: int, slots: int, step_cost: float = 1.0) -> float:
    """K steps one slot runs one after another for ``tiles`` tiles each split into ``split`` K
    ranges: the waves of the items, times the steps of the longest range (a split that does not
    divide the steps saves less than 1 / split), each step costing ``step_cost`` (a wider tile's
    step, in steps of the reference tile)."""
    return waves(tiles * split, slots) * cdiv(k_steps, split) * step_cost


def cheapest_split(tiles: int, k_steps: int, slots: int, min_steps: int, max_split: int) -> int:
    """The split over K (1 to ``max_split``, each range at least ``min_steps`` K steps) whose items
    take the fewest K steps one after another (``split_cost``; ties: the smaller split); 1 where no
    split keeps ``min_steps``."""
    splits = [s for s in range(1, max_split + 1) if k_steps >= min_steps * s]
    return min(splits, key=lambda s: (split_cost(tiles, k_steps, s, slots), s)) if splits else 1


def streamk_cost(dp_tiles: int, k_steps: int, per: int, slots: int, overhead, step_cost: float = 1.0) -> float:
    """Stream-K's in the same units: a slot's share of the data-parallel (whole) tiles' K steps,
    its ``per`` (tile, K step) units of the rest, and ``overhead`` steps (its partial tiles'
    epilogues and the fix-up), each step costing ``step_cost``."""
    return (dp_tiles // slots * k_steps + per + overhead) * step_cost


def split_for_programs(tiles: int, programs: float, k_steps: int, min_steps: int, max_split: int) -> int:
    """K ranges per tile so that ``tiles`` tiles make about ``programs`` programs (1: none), each
    range at least ``min_steps`` K steps, at most ``max_split``."""
    return max(1, min(math.ceil(programs / max(tiles, 1)), k_steps // min_steps, max_split))


def split_until(tiles: int, programs: float, k_steps: int, min_steps: int, step: int, split: int = 1) -> int:
    """``split`` multiplied by ``step`` while the grid has fewer than ``programs`` programs and
    every K range of the next split keeps at least ``min_steps`` K steps (the last step may
    overshoot ``programs``)."""
    while tiles * split < programs and k_steps >= min_steps * step * split:
        split *= step
    return split


def split_within(tiles: int, programs: float, k_steps: int, min_steps: int, step: int, split: int = 1) -> int:
    """``split`` multiplied by ``step`` while the grid of the next split stays within ``programs``
    programs and every K range of it keeps at least ``min_steps`` K steps."""
    while tiles * split * step <= programs and k_steps >= min_steps * step * split:
        split *= step
    return split
