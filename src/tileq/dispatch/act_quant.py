"""The activation-quantization kernels' configuration: how a program covers a row (or its
groups), and how many warps it takes (``kernels/act_quant.py`` runs what this returns)."""

from __future__ import annotations

from ..errors import UnsupportedError, expect
from ..kernels.act_quant import LOOP_CHUNK, MAX_REGISTER_ELEMS, ActQuantConfig, _pow2_ceil, _pow2_floor
from . import thresholds

# About 16 values per thread: two 16-byte loads of bf16 each, a row of 5120 in 16 warps
# (designed, not yet measured: to be checked on the H200).
ELEMS_PER_THREAD = 16
MAX_WARPS = 16
# From ACT_QUANT_LARGE_M rows on, row programs get fewer warps (thresholds.py).
# A 'group' program covers about this many elements (several groups), so that small M still
# spreads over many SMs: K = 17408 with groups of 128 makes 9 programs per row.
GROUP_TILE_ELEMS = 2048


def _split(n: int) -> tuple[int, int]:
    """(head, tail) powers of two covering n units with the fewest: one power of two, or the
    largest one below n plus a power of two for the rest (17408 = 16384 + 1024, not 32768)."""
    single = _pow2_ceil(n)
    head = _pow2_floor(n)
    rest = n - head
    tail = _pow2_ceil(rest) if rest else 0
    return (head, tail) if head + tail < single else (single, 0)


def keeps_outputs(m: int, arch: str | None = None) -> bool:
    """Whether a kept quantization launch writes calls of ``m`` rows into outputs it keeps
    (ACT_QUANT_SCRATCH_MAX_M)."""
    return m <= thresholds.for_arch(arch).ACT_QUANT_SCRATCH_MAX_M


def _warps(elems: int, m: int = 1, arch: str | None = None) -> int:
    t = thresholds.for_arch(arch)
    if m >= t.ACT_QUANT_LARGE_M:
        per_thread = t.ACT_QUANT_LARGE_M_ELEMS_PER_THREAD
        return min(MAX_WARPS, max(1, _pow2_floor(-(-elems // (32 * per_thread)))))
    return min(MAX_WARPS, _pow2_ceil(-(-elems // (32 * ELEMS_PER_THREAD))))


def _groups_per_program(n_groups: int, gp: int) -> int:
    """Groups per 'group' program: the largest power of two up to GROUP_TILE_ELEMS / gp whose
    last program is not mostly idle (padding at most 1/8 of the groups; Gk = 40 -> 8, 136 -> 16)."""
    gpp = min(max(1, GROUP_TILE_ELEMS // gp), _pow2_ceil(n_groups))
    while gpp > 1 and (-(-n_groups // gpp)) * gpp - n_groups > n_groups / 8:
        gpp //= 2
    return gpp


def act_quant_config(k: int, granularity: str, group_k: int, *, fused: bool = False,
                     m: int = 1, arch: str | None = None) -> ActQuantConfig:
    """The deterministic heuristic (K >= 1; ``m`` rows). Raises UnsupportedError where the kernels
    have no layout: groups wider than MAX_REGISTER_ELEMS, a fused row longer than it."""
    if granularity == "group":
        gp = _pow2_ceil(min(group_k, k))
        n_groups = -(-k // group_k)
        if fused:  # the whole row in one program: head and tail pieces of whole groups
            hr, tr = _split(n_groups)
            cfg = ActQuantConfig(hr, gp, tr, gp if tr else 0, 0, 0, 1)
        else:
            gpp = _groups_per_program(n_groups, gp)
            cfg = ActQuantConfig(gpp, gp, 0, 0, 0, 0, -(-n_groups // gpp))
    else:
        if k > MAX_REGISTER_ELEMS and not fused:
            return ActQuantConfig(1, 0, 0, 0, LOOP_CHUNK, _warps(LOOP_CHUNK), 1)
        hc, tc = _split(k)
        cfg = ActQuantConfig(1, hc, 1 if tc else 0, tc, 0, 0, 1)
    if cfg.elems > MAX_REGISTER_ELEMS:
        what = f"group_k={group_k}" if granularity == "group" and not fused else f"K={k}"
        raise UnsupportedError(expect(
            "x", f"rows (fused) or groups of at most {MAX_REGISTER_ELEMS} elements for the Triton "
            "kernel (they are held in registers); use backend='reference'", what))
    rows = m if (granularity != "group" or fused) else 1  # group programs are already small
    return ActQuantConfig(cfg.hr, cfg.hc, cfg.tr, cfg.tc, 0, _warps(cfg.elems, rows, arch), cfg.grid_k)


