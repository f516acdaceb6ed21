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
from .arch import ArchInfo
from .config import TileConfig, config_problem

DECODE_MAX_M = 64


@lru_cache(maxsize=1)
def default_table() -> dict:
    text = resources.files("tileq.catalog").joinpath("data/defaults.json").read_text()
    return json.loads(text)


def choose_pipeline(spec: ProblemSpec) -> str:
    """'decode' for M <= 64 (logical M, after transposes), else prefill or preshufflequant."""
    if spec.m <= DECODE_MAX_M:
        return "decode"
    if spec.scheme.a_grouped and spec.a_scale_layout is ScaleLayout.PRESHUFFLED:
        return "preshufflequant"
    return "prefill"


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
        bm = 16 if spec.m <= 16 else (32 if spec.m <= 32 else 64)
        swapped = _decode_swapped(spec, arch, bk, w, s, num_sms)
        if swapped is not None:
            return swapped
        if not spec.scheme.grouped:
            return _decode_single_pass(spec, arch, bm, bk, w, s, num_sms)
        tiles = math.ceil(spec.m / bm) * math.ceil(spec.n / bn)
        k_tiles = max(math.ceil(spec.k / bk), 1)
        # Enough programs to keep every SM streaming (about 2 per SM), each with >= 4 K tiles.
        want = math.ceil(2 * num_sms / max(tiles, 1))
        sk = max(1, min(want, k_tiles // 4, 16))
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
    side, M on its 16/32/64-wide side) where it measured best, or None.

    From ``tileq tune`` on an H200 (2026-11-29, read-flush timing, six LLM weights):
    - an int4 weight packed along K (nn.Linear layout) at every decode M: 45 of the 48 tuned
      int4 problems (M in {1, 16, 32, 64}) chose a swapped config. Unswapped, the unpacked tile
      is transposed on its way to the mma; at M = 64 that ran 1.5x slower than even the
      prefill kernel (llm-decode bench);
    - 8-bit rowcol at M <= 16 with at least 0.6 x SMs 64-row tiles: m64n16 (BK 256) fastest or
      within 2% on 16 of 24 problems.
    """
    int4_weight = spec.b_type is OperandType.I4 and spec.layout[1] == "c"
    tiles = math.ceil(spec.n / 64)
    if not int4_weight and (spec.m > 16 or tiles < 0.6 * num_sms):
        return None
    m_tile = 16 if spec.m <= 16 else (32 if spec.m <= 32 else 64)
    if spec.scheme.grouped:
        # A split over K where 64-row tiles alone leave SMs idle (each split >= 4 K tiles).
        k_tiles = max(math.ceil(spec.k / bk), 1)
        split = max(1, min(math.ceil(1.2 * num_sms / tiles), 4, k_tiles // 4))
        cfg = TileConfig(64, m_tile, bk, w, s, split, swap_ab=True)
    else:
        cfg = TileConfig(64, m_tile, 256 if _width(spec) == "8bit" else 128, w, s, 1, swap_ab=True)
    return cfg if config_problem(spec, cfg, arch) is None else None


def _decode_single_pass(spec: ProblemSpec, arch: ArchInfo, bm: int, bk: int, w: int, s: int,
                        num_sms: int) -> TileConfig:
    """Non-grouped decode: one pass over K (no split, so no second launch), the widest N tile that
    gives at least 1.2 programs per SM, and long K tiles for long K.

    From ``tileq tune`` on an H200 (2026-11-29): all 24 int8/fp8 rowcol decode problems (six LLM
    weights x M in {1, 16}) were fastest without a split over K, with 128 to 544 N tiles, and
    BK = 512 for K >= 16384, 256 below (8-bit operands).
    """
    bn = 128
    while bn > 16 and math.ceil(spec.n / bn) < 1.2 * num_sms:
        bn //= 2
    if _width(spec) == "8bit":
        bk = 512 if spec.k >= 16384 else 256
    cfg = TileConfig(bm, bn, bk, w, s, 1)
    # Fall back to narrower K tiles where the long ones do not fit (shared memory, group size).
    while config_problem(spec, cfg, arch) is not None and cfg.block_k > 64:
        cfg = TileConfig(bm, bn, cfg.block_k // 2, w, s, 1)
    return cfg
