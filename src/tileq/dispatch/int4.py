"""Prepacked int4 weights: the rules that route a call on a ``PrepackedInt4`` weight.

The decode kernel's config (``config_for``: the tuned table, else ``decode_rule``), whether W4A8
activations are cast first (``compute_type``), the Gluon prefill kernel's tiling
(``prefill_tiling``, ``streamk_for``) and build (``fused_for``, ``overlap_for``), and why that
kernel does not serve a call (``unserved``). ``dispatch.prepacked`` makes the plan from them.
The numbers are the plan's arch's (``thresholds.for_arch``, ``INT4_*``); the device facts are
``tileq.device``'s; every grid is costed by ``dispatch.waves``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import device as _device
from .. import settings as _settings
from ..device import DeviceFacts
from ..kernels.int4p.config import (DECODE_TOKEN_TILES, PER_SM_CAPPED, PER_SM_S2, PER_SM_S3, REGS_AHEAD,
                                    REGS_CAPPED, ROWS, Int4pConfig)
from ..kernels.int4p.prefill_launch import TOKEN_TILES, overlap_builds, tiles
from ..kernels.int4p.streamk import k_blocks
from ..kernels.int4p.streamk import schedule as streamk_schedule
from ..prepacked import BLOCK_K
from . import thresholds, waves
from .gluon import gluon_unavailable
from .tuned import int4_decode_table

T64, T128, T256 = TOKEN_TILES  # the Gluon prefill kernel's token tiles
D16, D32 = DECODE_TOKEN_TILES  # the decode kernel's
SM90 = _device.for_arch("sm_90")  # rules called without facts plan for an sm_90 GPU (its typical SMs)


def _table(facts: DeviceFacts):
    return thresholds.for_arch(facts.arch.name)


def sixteen_bit(x_type: str) -> bool:
    return x_type in ("bf16", "fp16")


# ----------------------------------------------------------------------------- decode kernel

def config_for(m: int, n: int, k: int, x_type: str = "bf16", facts: DeviceFacts = SM90) -> tuple[Int4pConfig, str]:
    """(config, where it came from) of the decode kernel: the tuned table for the weights and
    decode sizes it lists with 16-bit activations (it was measured with bf16; fp16 runs the same
    code), else the rule (``decode_rule``; its reason follows "heuristic: "). fp8 activations take
    the rule, which has its own measured branch for them."""
    T = _table(facts)
    if m <= T.INT4_TUNED_MAX_M and sixteen_bit(x_type):
        hit = int4_decode_table().get((n, k, 1 if m == 1 else T.INT4_TUNED_MAX_M))
        if hit is not None:
            return hit, "tuned table"
    cfg, why = decode_rule(m, n, k, x_type, facts)
    return cfg, f"heuristic: {why}"


def default_config(m: int, n: int, k: int, x_type: str = "bf16", facts: DeviceFacts = SM90) -> Int4pConfig:
    """The rule's config (``decode_rule`` without its reason)."""
    return decode_rule(m, n, k, x_type, facts)[0]


def decode_rule(m: int, n: int, k: int, x_type: str = "bf16", facts: DeviceFacts = SM90,
                streamk: bool = True) -> tuple[Int4pConfig, str]:
    """(config, why): the tiles, split and occupancy band (``_decode_tiles``); with 16-bit
    activations stream-K for a wave tail (``_streamk_tail``; ``streamk=False``: without that
    step); a split's partials summed in the kernel; fp8 activations converted to fp16 in the
    kernel. Measured on an H200 (``INT4_DECODE_*``'s evidence, and int4/fixup/, int4/fp16-decode/)."""
    cfg, why = _decode_tiles(m, n, k, x_type, facts)
    if streamk and sixteen_bit(x_type):
        cfg, why = _streamk_tail(cfg, m, n, facts, why)
    if cfg.split_k > 1:
        cfg, why = replace(cfg, fixup=True), f"{why}; the partials summed in the kernel"
    if x_type in ("fp8", "bf8"):
        return replace(cfg, fp16=True), f"{why}; {x_type} converted to fp16"
    return cfg, why


def _decode_tiles(m: int, n: int, k: int, x_type: str, facts: DeviceFacts) -> tuple[Int4pConfig, str]:
    """16-token tiles up to INT4_DECODE_TILE16_MAX_M (32-token ones, two stages, above); K split
    until the programs cover INT4_DECODE_SPLIT_WAVES x SMs, at M = 1 with 16-bit activations (fp8:
    every M) further while four per SM hold them; then stages and register cap by programs per SM
    (``PER_SM_*``: three stages, two, two capped at 128 registers; beyond four: capped at M = 1,
    three stages above); configs not capped load group scales ahead (``_scales_ahead``)."""
    T = _table(facts)
    sms = facts.num_sms
    step = T.INT4_DECODE_SPLIT_STEP
    rows = waves.cdiv(n, ROWS)
    ktiles = waves.cdiv(k, BLOCK_K)
    sixteen = sixteen_bit(x_type)
    bm = D16 if m <= T.INT4_DECODE_TILE16_MAX_M else D32
    tiles_ = rows * waves.cdiv(m, bm)
    split = waves.split_until(tiles_, T.INT4_DECODE_SPLIT_WAVES * sms, ktiles, T.INT4_DECODE_SPLIT_MIN_KTILES, step)
    if bm == D32:
        return Int4pConfig(D32, split, 2), (f"{m} tokens: 32-token tiles, two stages, {tiles_ * split} "
                                           f"programs (split-K {split})")
    # fp8 activations take the M = 1 branches at every decode M (the further split, the cap with
    # split-K): their capped split-K configs won at M = 4 and 16 where bf16's lost.
    like_m1 = m == 1 or not sixteen
    if like_m1:
        split = waves.split_within(tiles_, PER_SM_CAPPED * sms, ktiles, T.INT4_DECODE_SPLIT_MIN_KTILES, step, split)
    programs = tiles_ * split
    what = f"{programs} programs ({rows} row tiles x split-K {split})"
    if programs <= PER_SM_S3 * sms:
        return _scales_ahead(Int4pConfig(D16, split, 3), f"{what}, up to {PER_SM_S3} per SM: three stages")
    if programs <= PER_SM_S2 * sms:
        return _scales_ahead(Int4pConfig(D16, split, 2), f"{what}, up to {PER_SM_S2} per SM: two stages")
    capped = Int4pConfig(D16, split, 2, 4, REGS_CAPPED)
    if programs <= PER_SM_CAPPED * sms and (like_m1 or split == 1):
        return capped, f"{what}, up to {PER_SM_CAPPED} per SM: two stages, registers capped at {REGS_CAPPED}"
    if m == 1:
        return capped, f"{what}, over {PER_SM_CAPPED} per SM: at M = 1 two stages, registers capped at {REGS_CAPPED}"
    return _scales_ahead(Int4pConfig(D16, split, 3), f"{what}, over {PER_SM_CAPPED} per SM: three stages")


def _scales_ahead(cfg: Int4pConfig, why: str) -> tuple[Int4pConfig, str]:
    """A 16-token config not capped at 128 registers loads the group scales one K tile ahead under
    a 168-register cap (int4/scale-ahead/: 1.06x, median of 716 pairs)."""
    return (replace(cfg, maxnreg=REGS_AHEAD, scale_ahead=True),
            f"{why}; group scales one K tile ahead ({REGS_AHEAD} registers)")


# stream-K's 16-token config: two programs per SM, three stages, scales ahead under 168 registers
STREAMK_CONFIG = Int4pConfig(D16, 1, 3, 4, REGS_AHEAD, True, streamk=True)


def _streamk_tail(cfg: Int4pConfig, m: int, n: int, facts: DeviceFacts, why: str) -> tuple[Int4pConfig, str]:
    """Stream-K (two programs per SM streaming equal shares of the (tile, K block) units) for an
    unsplit config whose tiles fill more than one wave of its band and leave the last wave at most
    INT4_DECODE_STREAMK_TAIL full."""
    if cfg.split_k > 1 or cfg.streamk:
        return cfg, why
    tail = _table(facts).INT4_DECODE_STREAMK_TAIL
    slots = cfg.per_sm * facts.num_sms
    count = waves.cdiv(n, cfg.rows) * waves.cdiv(m, cfg.bm)
    w = waves.wave_fraction(count, slots)
    fill = waves.last_wave_fill(count, slots)
    if w <= 1 or fill == 1 or fill > tail:
        return cfg, why
    stk = STREAMK_CONFIG if cfg.bm == D16 else Int4pConfig(cfg.bm, 1, 2, streamk=True)
    return stk, (f"{why}; {w:.2f} waves of {cfg.per_sm} per SM (last one at most {tail} full): "
                 f"stream-K over {stk.per_sm * facts.num_sms} programs")


def traced_config(cfg: Int4pConfig) -> tuple[Int4pConfig, str]:
    """(config, why) a launch traced into a torch.compile graph runs in place of ``cfg``: torch
    launches a user kernel with its warps and stages only, so a traced launch has no register cap
    (``maxnreg``). Three stages: the same config uncapped (shared memory holds two programs per SM
    whatever their registers); two stages capped at 168 registers: uncapped, group scales in the
    loop; two stages capped at 128: three stages, scales ahead. The measurements: docs/int4.md
    ("Decode configs"; int4/scale-ahead/, h100/int4-traced-2026-12-07/)."""
    if cfg.maxnreg is None:
        return cfg, ""
    if cfg.stages >= 3:
        return replace(cfg, maxnreg=None), "its three stages uncapped"
    if cfg.maxnreg > REGS_CAPPED:
        return replace(cfg, maxnreg=None, scale_ahead=False), "two stages uncapped, group scales in the loop"
    return replace(cfg, stages=3, maxnreg=None, scale_ahead=True), "three stages uncapped, group scales ahead"


def cast_min_bytes(m: int, facts: DeviceFacts = SM90) -> int:
    """The int4 bytes from which fp8 activations of ``m`` tokens (at most INT4_W4A8_CAST_MAX_M)
    are cast to bf16 for the decode kernel."""
    T = _table(facts)
    return T.INT4_W4A8_CAST_MIN_BYTES if m <= T.INT4_DECODE_TILE16_MAX_M else T.INT4_W4A8_CAST_MIN_BYTES_32


def compute_type(m: int, n: int, k: int, x_type: str, facts: DeviceFacts = SM90) -> str:
    """The activation type the decode kernel runs for ``x_type``: fp8 cast to 'bf16' above
    INT4_W4A8_CAST_MAX_M tokens, or at fewer for weights of ``cast_min_bytes(m)`` of int4 and
    more (the kernel's own fp8 conversion writes the activations back to shared memory); else
    ``x_type`` itself."""
    if x_type in ("fp8", "bf8") and (m > _table(facts).INT4_W4A8_CAST_MAX_M or n * k // 2 >= cast_min_bytes(m, facts)):
        return "bf16"
    return x_type


# ----------------------------------------------------------------------------- Gluon prefill kernel


def prefill_tiling(m: int, n: int, k: int, facts: DeviceFacts = SM90, x_scale: bool = False
                   ) -> tuple[int, int] | None:
    """(token tile, split over K) of the Gluon prefill kernel for a call of ``m`` tokens, or None
    where the decode kernel takes it (below INT4_PREFILL_MIN_M; below INT4_DEQUANT_MIN_M without
    a split and without the tiles ``prefers`` asks for). ``x_scale``: the call brings an
    activation scale (W4A8), which 256-token tiles do not take. Whether the kernel serves the call
    is ``unserved``'s answer."""
    T = _table(facts)
    if m < T.INT4_PREFILL_MIN_M:
        return None
    tokens = T64 if m <= T.INT4_T64_MAX_M else T128
    if tiles(m, n, tokens) <= T.INT4_SPLIT_FILL * facts.num_sms:
        split = split_for(m, n, k, tokens, facts)
        if split > 1:
            return tokens, split
    if m >= T.INT4_DEQUANT_MIN_M or prefers(m, n, facts):
        return tokens_for(m, n, facts, x_scale), 1
    return None


def split_for(m: int, n: int, k: int, tokens: int, facts: DeviceFacts = SM90) -> int:
    """K ranges per tile for a grid of fewer tiles than SMs (1 otherwise): the split whose items
    take the fewest K blocks one after another (``waves.cheapest_split``; ties: the smaller
    split), each range at least ``min_split_blocks(m)`` blocks, at most INT4_MAX_SPLIT."""
    count = tiles(m, n, tokens)
    if count >= facts.num_sms:
        return 1
    return waves.cheapest_split(count, k_blocks(k), facts.num_sms, min_split_blocks(m, facts),
                                int(_table(facts).INT4_MAX_SPLIT))


def min_split_blocks(m: int, facts: DeviceFacts = SM90) -> int:
    """512-wide K blocks per K range of a split: INT4_SPLIT_MIN_BLOCKS up to
    INT4_SPLIT_MIN_BLOCKS_MAX_M tokens, INT4_SPLIT_MIN_BLOCKS_WIDE beyond (a longer K loop per tile
    beat short ranges there)."""
    T = _table(facts)
    return T.INT4_SPLIT_MIN_BLOCKS if m <= T.INT4_SPLIT_MIN_BLOCKS_MAX_M else T.INT4_SPLIT_MIN_BLOCKS_WIDE


def prefers(m: int, n: int, facts: DeviceFacts = SM90) -> bool:
    """Whether a call of M < INT4_DEQUANT_MIN_M tokens takes the Gluon kernel unsplit (where it
    serves) rather than the decode kernel: from INT4_PREFILL_MIN_M tokens, with at least
    INT4_SMALL_M_FILL(_128) x SMs tiles of 128 weight rows x 64 tokens."""
    T = _table(facts)
    fill = T.INT4_SMALL_M_FILL_128 if m >= T.INT4_SMALL_M_FILL_128_MIN_M else T.INT4_SMALL_M_FILL
    return m >= T.INT4_PREFILL_MIN_M and tiles(m, n, T64) >= fill * facts.num_sms


def tokens_for(m: int, n: int, facts: DeviceFacts = SM90, x_scale: bool = False) -> int:
    """The token tile of an unsplit call: 64 up to INT4_T64_MAX_M; below INT4_DEQUANT_MIN_M the one
    of 64 and 128 with the cheaper waves (a 64-token tile at INT4_TILE64_COST); from
    INT4_T256_MIN_M 256 where its waves cost less (at INT4_TILE256_COST), the call has no
    activation scale (``x_scale``) and, below INT4_T256_THIN_MAX_M, the last 256-token tile holds
    at least 128 tokens; else 128."""
    T = _table(facts)
    if m <= T.INT4_T64_MAX_M:
        return T64
    if m >= T.INT4_T256_MIN_M:
        cheaper = T.INT4_TILE256_COST * prefill_waves(m, n, T256, facts) < prefill_waves(m, n, T128, facts)
        thin = m < T.INT4_T256_THIN_MAX_M and 0 < m % T256 < T128
        return T256 if cheaper and not x_scale and not thin else T128
    if m >= T.INT4_DEQUANT_MIN_M:
        return T128
    return T64 if T.INT4_TILE64_COST * prefill_waves(m, n, T64, facts) < prefill_waves(m, n, T128, facts) else T128


def prefill_waves(m: int, n: int, tokens: int, facts: DeviceFacts = SM90) -> int:
    """Waves of the persistent grid for tiles of ``tokens`` tokens x 128 weight rows."""
    return waves.waves(tiles(m, n, tokens), facts.num_sms)


def _block_cost(tokens: int, facts: DeviceFacts) -> float:
    """A K block of one tile, in 128-token tiles' blocks."""
    return _table(facts).INT4_TILE256_COST if tokens == T256 else 1.0


def plan_cost(m: int, n: int, k: int, tokens: int, split: int, facts: DeviceFacts = SM90) -> float:
    """A tiling's K blocks per SM one after another: waves of the grid's items x the blocks of the
    longest K range (a 256-token tile's at INT4_TILE256_COST)."""
    return waves.split_cost(tiles(m, n, tokens), k_blocks(k), split, facts.num_sms, _block_cost(tokens, facts))


def streamk_cost(m: int, n: int, k: int, tokens: int, facts: DeviceFacts = SM90) -> float:
    """Stream-K's in the same units: a program's data-parallel tiles' K blocks, its ``per`` units
    and INT4_STREAMK_OVERHEAD."""
    s = streamk_schedule(tiles(m, n, tokens), k, facts.num_sms)
    return waves.streamk_cost(s.dp, s.k_blocks, s.per, facts.num_sms, _table(facts).INT4_STREAMK_OVERHEAD,
                              _block_cost(tokens, facts))


def streamk_for(m: int, n: int, k: int, tokens: int, split: int, facts: DeviceFacts = SM90,
                x_scale: bool = False) -> tuple[int, bool]:
    """(token tile, stream-K) for a call the tiling gave (``tokens``, ``split``): W4A16 from
    INT4_STREAMK_MIN_M to INT4_STREAMK_MAX_M - 1 tokens, stream-K with 128- or (from
    INT4_STREAMK_T256_MIN_M) 256-token tiles where its cost beats the tiling's by
    INT4_STREAMK_MARGIN, else the tiling's tiles. W4A8 (``x_scale``) keeps its tiling."""
    T = _table(facts)
    if x_scale or not T.INT4_STREAMK_MIN_M <= m < T.INT4_STREAMK_MAX_M:
        return tokens, False
    best = (plan_cost(m, n, k, tokens, split, facts), tokens, False)
    for t in (T128, T256) if m >= T.INT4_STREAMK_T256_MIN_M else (T128,):
        cost = streamk_cost(m, n, k, t, facts) * T.INT4_STREAMK_MARGIN
        if cost < best[0]:
            best = (cost, t, True)
    return best[1], best[2]


def overlap_for(ct: str, tokens: int, facts: DeviceFacts = SM90) -> bool:
    """Whether a build of compute type ``ct`` with ``tokens``-token tiles overlaps its conversion
    with the wgmmas: wherever the build takes it, while INT4_OVERLAP is on."""
    return bool(_table(facts).INT4_OVERLAP) and overlap_builds(ct, tokens)


def fused_wide_rule(facts: DeviceFacts = SM90) -> str:
    """Where the fused fp8 build takes W4A8 from INT4_W4A8_MAX_M tokens, in words."""
    T = _table(facts)
    return (f"on weights with N >= {T.INT4_FUSED_WIDE_N} up to {T.INT4_FUSED_WIDE_N_MAX_M} tokens, with K >= "
            f"{T.INT4_FUSED_WIDE_K} up to {T.INT4_FUSED_WIDE_MAX_M}")


def fused_for(m: int, x_type: str, w_kind: str, n: int, k: int, facts: DeviceFacts = SM90) -> bool:
    """Whether a W4A8 call runs the fused fp8 build of the Gluon prefill kernel where that kernel
    takes it: e4m3 activations with group scales below INT4_W4A8_MAX_M tokens (instead of the
    activations cast to bf16 for its 16-bit build), and a little above on wide or deep weights
    (``fused_wide_rule``, instead of the fp8 GEMM)."""
    if x_type != "fp8" or w_kind != "group":
        return False
    T = _table(facts)
    return (m < T.INT4_W4A8_MAX_M or (m <= T.INT4_FUSED_WIDE_N_MAX_M and n >= T.INT4_FUSED_WIDE_N)
            or (m <= T.INT4_FUSED_WIDE_MAX_M and k >= T.INT4_FUSED_WIDE_K))


_CT_16 = (torch.bfloat16, torch.float16)


def problem_reason(m: int, k: int, x_type: str, x_kind: str, w_kind: str, out_dtype: torch.dtype,
                   tokens: int | None = None, fused: bool = False, facts: DeviceFacts = SM90) -> str | None:
    """Why the Gluon prefill kernel does not serve (or is not chosen for) this problem with the
    tiling's token tile ``tokens``, or None (``fused``: W4A8 on its fp8 build)."""
    T = _table(facts)
    w4a8 = x_type in ("fp8", "bf8") and x_kind in ("vector", "scalar")
    if fused and w4a8:
        if x_type != "fp8":
            return "the fused fp8 kernel takes e4m3 activations only (e5m2 not built yet)"
        if w_kind != "group":
            return "the fused fp8 kernel takes group scales only (per-channel builds spilled)"
        if out_dtype not in _CT_16:
            return "bf16/fp16 outputs only"
        return "K a multiple of 16 (16-byte fp8 activation rows for TMA)" if k % 16 else None
    if (w_kind == "group" and m >= T.INT4_GROUP_SCALE_MAX_M
            and not (tokens == T256 and m < T.INT4_GROUP_T256_MAX_M)):
        return (f"with group scales, dequantize + cuBLAS from {T.INT4_GROUP_SCALE_MAX_M} tokens (measured faster; "
                f"256-token tiles below {T.INT4_GROUP_T256_MAX_M} where their waves cost less)")
    if not w4a8 and (not sixteen_bit(x_type) or x_kind != "none"):
        return ("bf16/fp16 activations without an activation scale (W4A16) or fp8 ones with a per-token "
                "or per-tensor scale (W4A8) only")
    if w4a8 and m >= T.INT4_W4A8_MAX_M:
        return (f"W4A8 from {T.INT4_W4A8_MAX_M} tokens: the fp8 GEMM on the int4 values (measured faster; with group "
                f"scales and e4m3 the fp8 build {fused_wide_rule(facts)})")
    if out_dtype not in _CT_16:
        return "bf16/fp16 outputs only"
    if k % 8:
        return "K a multiple of 8 (16-byte activation rows for TMA)"
    return None


def unserved(m: int, k: int, x_type: str, x_kind: str, w_kind: str, out_dtype: torch.dtype,
             tokens: int | None = None, fused: bool = False, facts: DeviceFacts = SM90,
             device: torch.device | None = None, switches: _settings.Settings | None = None) -> str | None:
    """Why the Gluon prefill kernel does not serve a call (``problem_reason``, then the device:
    a compiled sm_90 GPU, a tested Triton version, TILEQ_GLUON not 0), or None. Without
    ``device``: a described call on a GPU of ``facts``' arch, compiled, with the default switch."""
    why = problem_reason(m, k, x_type, x_kind, w_kind, out_dtype, tokens, fused, facts)
    if why is not None:
        return why
    if device is None:
        return gluon_unavailable(facts.arch.name, False, None)
    switches = switches or _settings.current()
    if device.type != "cuda" or switches.interpreted:
        return "a compiled kernel on a GPU"
    return gluon_unavailable(facts.arch.name, False, switches.gluon)
