"""The deterministic default: pipeline from the logical M, config from the arch's table.

Decode (M <= 64) is memory-bound: a narrow M tile and, when the output has too few tiles to
keep every multiprocessor streaming weights, a split over K. Prefill is compute-bound: the
arch's large tile. Every result passes ``config.config_problem`` (the shared legality predicate)
or the planner raises; there is no silent default.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from importlib import resources

from ..dtypes import OperandType, compute_type
from ..errors import ArchError, UnsupportedError, expect
from ..problem import ProblemSpec, ScaleLayout
from ..device import ArchInfo
from ..kernels.config import TileConfig, config_problem
from . import thresholds
from .waves import split_for_programs


@lru_cache(maxsize=1)
def default_table() -> dict:
    text = resources.files("tileq.dispatch").joinpath("data/defaults.json").read_text()
    return json.loads(text)


def choose_pipeline(spec: ProblemSpec, decode_max_m: int) -> str:
    """'decode' for M <= decode_max_m (logical M, after transposes; the arch's DECODE_MAX_M),
    else prefill or preshufflequant."""
    if spec.m <= decode_max_m:
        return "decode"
    if spec.scheme.a_grouped and spec.a_scale_layout is ScaleLayout.PRESHUFFLED:
        return "preshufflequant"
    return "prefill"


def decode_m_tile(m: int) -> int:
    """The decode M tile: the narrowest of 16, 32 and 64 rows that covers M (64 above)."""
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def _width(spec: ProblemSpec) -> str:
    ct = compute_type(spec.a_type, spec.b_type)
    return "16bit" if ct in (OperandType.BF16, OperandType.FP16) else "8bit"


def base_config(spec: ProblemSpec, arch: ArchInfo, pipeline: str) -> TileConfig:
    table = default_table()
    if arch.name not in table:
        raise ArchError(expect("arch", f"one of {', '.join(k for k in table if not k.startswith('_'))}", arch.name))
    kind = "decode" if pipeline == "decode" else "prefill"
    bm, bn, bk, w, s = table[arch.name][kind][_width(spec)]
    return TileConfig(bm, bn, bk, w, s)


def heuristic_config(spec: ProblemSpec, arch: ArchInfo, pipeline: str, num_sms: int) -> TileConfig:
    t = thresholds.for_arch(arch.name)
    cfg = base_config(spec, arch, pipeline)
    bm, bn, bk, w, s, sk = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, 1
    if spec.scheme.grouped:
        while spec.group_k % bk:  # a K tile must sit inside one group
            bk //= 2
        # Promotion keeps a second fp32 tile (the K-tile partial) live: 128x256 x2 spills on
        # sm_90 (232 B of spills seen in the AOT build), 128x128 x2 fits.
        bn = min(bn, 128)
    if OperandType.I4 in (spec.a_type, spec.b_type):
        bn = min(bn, 128)  # the unpacked copy of the int4 tile needs registers too
    if pipeline == "decode":
        bm = decode_m_tile(spec.m)
        swapped = _decode_swapped(spec, arch, bk, w, s, num_sms)
        if swapped is not None:
            return swapped
        if not spec.scheme.grouped:
            return _decode_single_pass(spec, arch, bm, bk, w, s, num_sms)
        tiles = math.ceil(spec.m / bm) * math.ceil(spec.n / bn)
        k_tiles = max(math.ceil(spec.k / bk), 1)
        # Enough programs to keep every SM streaming, each with enough K tiles.
        sk = split_for_programs(tiles, t.DECODE_SPLIT_PROGRAMS_PER_SM * num_sms, k_tiles,
                                t.DECODE_SPLIT_MIN_K_TILES, t.DECODE_SPLIT_MAX)
    else:
        # Skinny or small problems: halve the tile until the grid covers the SMs once.
        while bn > 64 and math.ceil(spec.m / bm) * math.ceil(spec.n / bn) < num_sms:
            bn //= 2
        while bm > 64 and math.ceil(spec.m / bm) * math.ceil(spec.n / bn) < num_sms:
            bm //= 2
    cfg = TileConfig(bm, bn, bk, w, s, sk)
    why = config_problem(spec, cfg, arch)
    if why is not None:
        raise UnsupportedError(f"no legal default config for {arch.name}: {why}")
    return cfg


def _decode_swapped(spec: ProblemSpec, arch: ArchInfo, bk: int, w: int, s: int,
                    num_sms: int) -> TileConfig | None:
    """The swapped decode kernel (C^T = B^T A^T: the weight on the matrix instruction's 64-row
    side, M on its 16/32/64-wide side) where it measured best, or None: an int4 weight packed
    along K (nn.Linear layout) at every decode M (unswapped, the unpacked tile is transposed on
    its way to the mma), and 8-bit weights at M <= DECODE_SWAP_MAX_M with enough 64-row tiles
    (DECODE_SWAP_MIN_TILES_PER_SM)."""
    t = thresholds.for_arch(arch.name)
    int4_weight = spec.b_type is OperandType.I4 and spec.layout[1] == "c"
    tiles = math.ceil(spec.n / 64)
    if not int4_weight and (spec.m > t.DECODE_SWAP_MAX_M or tiles < t.DECODE_SWAP_MIN_TILES_PER_SM * num_sms):
        return None
    m_tile = decode_m_tile(spec.m)
    if spec.scheme.grouped:
        # A split over K where 64-row tiles alone leave SMs idle (each split >= 4 K tiles).
        k_tiles = max(math.ceil(spec.k / bk), 1)
        split = split_for_programs(tiles, t.DECODE_SWAP_SPLIT_PROGRAMS_PER_SM * num_sms, k_tiles,
                                   t.DECODE_SPLIT_MIN_K_TILES, t.DECODE_SWAP_SPLIT_MAX)
        cfg = TileConfig(64, m_tile, bk, w, s, split, swap_ab=True)
    else:
        cfg = TileConfig(64, m_tile, 256 if _width(spec) == "8bit" else 128, w, s, 1, swap_ab=True)
    return cfg if config_problem(spec, cfg, arch) is None else None


def _decode_single_pass(spec: ProblemSpec, arch: ArchInfo, bm: int, bk: int, w: int, s: int,
                        num_sms: int) -> TileConfig:
    """Non-grouped decode: one pass over K (no split, so no second launch), the widest N tile that
    gives at least DECODE_SINGLE_PASS_PROGRAMS_PER_SM programs per SM, and long K tiles (BK 512)
    from DECODE_LONG_K (8-bit operands)."""
    t = thresholds.for_arch(arch.name)
    bn = 128
    while bn > 16 and math.ceil(spec.n / bn) < t.DECODE_SINGLE_PASS_PROGRAMS_PER_SM * num_sms:
        bn //= 2
    if _width(spec) == "8bit":
        bk = 512 if spec.k >= t.DECODE_LONG_K else 256
    cfg = TileConfig(bm, bn, bk, w, s, 1)
    # Fall back to narrower K tiles where the long ones do not fit (shared memory, group size).
    while config_problem(spec, cfg, arch) is not None and cfg.block_k > 64:
        cfg = TileConfig(bm, bn, cfg.block_k // 2, w, s, 1)
    return cfg
