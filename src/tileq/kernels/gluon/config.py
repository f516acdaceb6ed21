"""Configuration of the sm_90 Gluon prefill kernel (``ws_gemm.py``): tile, ring depth, partitions,
how a problem accumulates (``accumulation``) and its instance names.

Imports no Triton: the planner and ``tileq explain`` read it on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ...problem import ProblemSpec, ScaleKind

# sm_90: 227 KiB of shared memory per program (opt-in maximum, catalog/arch.py) less a margin for
# the mbarriers and what the compiler adds (256 B measured in the sm_90 build of 2026-12).
SMEM_BYTES = 232448
SMEM_MARGIN = 2048
MAX_STAGES = 8

_OUT_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def mma_accumulates(spec: ProblemSpec) -> bool:
    """Whether the wgmma accumulator holds the sum over all of K (the kernel's MMA_ACC): int8
    (exact int32) and fp8 tensor/rowcol with fast_accum (the wgmma's reduced precision). Else
    fp8 is promoted into fp32 every K tile; group scales force that whatever fast_accum says
    (each K group's sum is scaled on its own, as the Triton kernel and the reference do)."""
    return spec.integer_mainloop or (spec.fast_accum and not spec.scheme.grouped)


def accumulation(spec: ProblemSpec) -> str:
    """'int32', 'fast' (fp8 fast_accum) or 'promoted': how the kernel accumulates over K."""
    if spec.integer_mainloop:
        return "int32"
    return "fast" if mma_accumulates(spec) else "promoted"


def instance_tag(spec: ProblemSpec, cfg: "GluonConfig") -> str:
    """The config tag of the kernel a problem runs: the fast-accumulation instance of an fp8
    family is a different kernel (MMA_ACC), so its tag says so ('_fa')."""
    return cfg.tag + ("_fa" if accumulation(spec) == "fast" else "")


def instance_name(family: str, spec: ProblemSpec, cfg: "GluonConfig", arch_tag: str) -> str:
    """``{family}__gluon_{tag}_{arch}``, e.g. rowcol_fp8xfp8_rcr_prefill__gluon_m128n128k128_s6_ws2x64_sm90
    (explain and the AOT build's manifest)."""
    return f"{family}__gluon_{instance_tag(spec, cfg)}_{arch_tag}"


@dataclass(frozen=True)
class GluonConfig:
    """A persistent, warp-specialized tile kernel: ``block_m`` = 128 rows split between two
    consumer warpgroups (64 rows each, the height of one wgmma), ``block_k`` = 128 = the
    promotion interval (fp8 wgmma partial sums are added into fp32 every 128 of K), a ring of
    ``stages`` shared-memory slots filled by one producer warp."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    stages: int = 6
    group_m: int = 8
    # Output staging buffers of [64, sub_n] per consumer (TMA store): 1 = each sub-tile waits for
    # the previous store from the buffer; sub-tiles = each has its own.
    epi_bufs: int = 1
    # fp8: start each K tile's wgmma at the end of the previous K tile's step, so that the next
    # tile's first K tile runs during the epilogue (int8 accumulates in place: never).
    overlap: bool = False
    # The tiles of the last, partial wave of the persistent grid (every tile when they are fewer
    # than the SMs) split over K in this many ranges, each an item of its own, their fp32
    # partials summed in order by split_reduce.py: the last wave then keeps every SM busy.
    # 128-column tiles at most, no overlap (``split_schedule``).
    split_k: int = 1
    # Group-scaled fp8: the main loop unrolled by two, a register set of scales per parity
    # loaded two K steps ahead (False: one step ahead, not unrolled).
    scale_unroll: bool = True
    # The epilogue's scale and bias vectors loaded at the start of each tile and held through the
    # main loop (128-column tiles at most, TMA stores only: ``launch_config``), so that the
    # epilogue does not wait for them with the tensor cores idle. The planner sets it where it
    # was timed faster (``choose_tiles``).
    epi_preload: bool = False
    # swap-AB (``swap_for``): the kernel's A is the weight [N, K], its B the activations; it
    # computes C^T tile by tile and writes each tile transposed (TRANS_C).
    swap_ab: bool = False
    # setmaxnreg budgets per thread. The kernel runs 12 warps (4 + 4 + the producer's warpgroup,
    # which Triton pads to 4 warps) under maxnreg = 168, i.e. 168 x 384 = 64512 of the 65536
    # registers: 232 x 128 for each consumer warpgroup and 40 x 128 for the producer's (the
    # split DeepGEMM uses). A consumer holds two 64 x BN fp32 tiles (its accumulator and the
    # wgmma partial sum): 128 registers at BN = 128.
    consumer_regs: int = 232
    producer_regs: int = 40
    maxnreg: int = 168
    num_warps: int = 4  # the default partition (consumer 0); the kernel adds 4 + 1 worker warps

    def __post_init__(self):
        if self.split_k > 1 and (self.block_n > 128 or self.overlap):
            raise ValueError(f"split_k={self.split_k} needs block_n <= 128 and no overlap "
                             f"(block_n={self.block_n}, overlap={self.overlap})")

    @property
    def sub_n(self) -> int:
        """Columns per wgmma and per accumulator: a 256-wide tile is two 128-wide sub-tiles, so
        that a consumer holds 2 x 64 accumulator registers plus one 64-register partial sum."""
        return min(self.block_n, 128)

    @property
    def sub_tiles(self) -> int:
        return self.block_n // self.sub_n

    @property
    def tag(self) -> str:
        epi = f"_e{self.epi_bufs}" if self.epi_bufs != 1 else ""
        ovl = "_ov" if self.overlap else ""
        split = f"_sk{self.split_k}" if self.split_k > 1 else ""
        unroll = "" if self.scale_unroll else "_nu"
        pre = "_ep" if self.epi_preload else ""
        grp = f"_g{self.group_m}" if self.group_m != 8 else ""
        swap = "_swap" if self.swap_ab else ""
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}_s{self.stages}{epi}{ovl}{split}{unroll}{pre}"
                f"{grp}{swap}_ws2x64")

    def describe(self, accumulation: str = "promoted") -> str:
        """``accumulation``: ``accumulation(spec)``."""
        acc = {"int32": "int32 in the wgmma accumulator over all of K",
               "fast": "fast_accum: fp32 in the wgmma accumulator over all of K (fp8's reduced precision)",
               "promoted": f"fp32 promotion every {self.block_k} of K"}[accumulation]
        subs = f" ({self.sub_tiles} sub-tiles of {self.sub_n} columns)" if self.sub_tiles > 1 else ""
        ovl = ("; next tile's first wgmma during the epilogue" if self.overlap and accumulation == "promoted"
               else "")
        if self.split_k > 1:
            ovl += f"; the last wave's tiles split {self.split_k} ways over K (fp32 partials, summed in order)"
        if self.epi_preload:
            ovl += "; the epilogue's scale and bias vectors loaded at the start of each tile"
        if self.swap_ab:
            ovl += ("; swapped: computes C^T (the weight's rows on the tile's 128 rows, the tokens on its "
                    "columns), each tile written transposed")
        return (f"BM={self.block_m} BN={self.block_n}{subs} BK={self.block_k} stages={self.stages} "
                f"GROUP_M={self.group_m}; persistent; 1 TMA producer warp (setmaxnreg "
                f"{self.producer_regs}) + 2 consumer warpgroups x 64 rows (setmaxnreg {self.consumer_regs}; "
                f"{self.maxnreg} per thread at launch); {acc}{ovl}")


def stage_bytes(cfg: GluonConfig) -> int:
    """One ring slot: the fp8 A and B tiles."""
    return cfg.block_m * cfg.block_k + cfg.block_n * cfg.block_k


def epilogue_bytes(cfg: GluonConfig, out_dtype: torch.dtype) -> int:
    """The two consumers' output staging buffers (TMA store)."""
    return 2 * cfg.epi_bufs * (cfg.block_m // 2) * cfg.sub_n * _OUT_BYTES[out_dtype]


def smem_bytes(cfg: GluonConfig, out_dtype: torch.dtype) -> int:
    """Ring slots plus the output staging buffers."""
    return cfg.stages * stage_bytes(cfg) + epilogue_bytes(cfg, out_dtype)


def max_stages(cfg: GluonConfig, out_dtype: torch.dtype) -> int:
    """As many ring slots as shared memory holds next to the staging buffers."""
    return min(MAX_STAGES, (SMEM_BYTES - SMEM_MARGIN - epilogue_bytes(cfg, out_dtype)) // stage_bytes(cfg))


def masked_store_config(cfg: GluonConfig, out_dtype: torch.dtype) -> GluonConfig:
    """The config of a call whose output TMA cannot store (e.g. N = 577 in bf16): 128 x 128 in
    place of 128 x 256 tiles, whose masked stores (64-bit addresses of two sub-tiles) would
    spill registers (sm_90 build, 2026-12)."""
    if cfg.sub_tiles == 1:
        return cfg
    out = replace(cfg, block_n=128, overlap=False)
    return replace(out, stages=max_stages(out, out_dtype))


def split_schedule(m: int, n: int, cfg: GluonConfig, num_sms: int) -> tuple[int, int, int]:
    """(programs, tiles computed whole, tiles split over K) of the persistent grid for an
    M x N output: with split_k > 1 the tiles past the last full wave (``tiles % programs``;
    all of them when fewer than the SMs) are split, as the kernel's ``_items`` does."""
    tiles = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
    if cfg.split_k == 1:
        return max(1, min(num_sms, tiles)), tiles, 0
    programs = max(1, min(num_sms, tiles * cfg.split_k))
    n_full = tiles - tiles % programs
    return programs, n_full, tiles - n_full


# Cost per column of a 128 x 256 overlapped tile over a 128 x 128 tile, for group-scaled fp8
# (A and/or B scales per 128 of K). Measured throughput per tile: median 1.3x (1.17-1.42x) at
# M = 4096 and 8192 over 11 (N, K) of Qwen3-14B, Llama-3-8B, DeepSeek-V3 and Mistral-Small-24B
# (H200, 2026-12-01, bench/results/h200/gluon/). 1.2 is the value that, with the other costs
# below, picks the fastest of the four tilings best at M 128-2048 (55 problems per scheme,
# bench/results/h200/gluon/tiles/), and picks as 1.3 did at M 4096-8192. Rowcol and tensor
# gained nothing from wide tiles (0.94-1.06x, mixed), int8 lost (0.9x median): 128 x 128.
WIDE_TILE_GAIN = 1.2


# The wave model's costs, in K steps (128 of K) of one 128 x 128 tile on one SM, fitted to the
# fastest of four tilings (128 x 128, the same with the last wave split, 128 x 64, 128 x 256) on
# 165 problems (fp8 rowcol, abquant, int8 x M 128-2048 x 11 (N, K); H200, 2026-12-01,
# bench/results/h200/gluon/tiles/): the chosen tiling ran at 99.7% of the best one's speed on
# average, 91% at worst.
# - a 128 x 64 tile's K step (half the columns; the A tile is loaded all the same);
NARROW64_STEP = 0.6
# - splitting the last wave: the partials' stores and the reduction kernel's launch and reads;
SPLIT_FIXED_STEPS = 12.0
# - each split keeps at least this many K steps (a shorter one is all prologue and epilogue).
MIN_SPLIT_STEPS = 4
MAX_SPLIT_K = 16


def per_column_b_groups(spec: ProblemSpec) -> bool:
    """b_scale groups of one column (group_n = 1): a [SUB_N] scale vector per K group."""
    return spec.b_scale_kind is ScaleKind.GROUP and spec.group_n == 1


def swap_for(spec: ProblemSpec) -> bool:
    """Whether the kernel runs the problem swapped (C^T = B^T A^T, ``GluonConfig.swap_ab``):
    b_scale groups of one column without A groups (bquant with group_n = 1, e.g. W4A8's int4
    values with their per-row group scales). Swapped, those scales are per row of the tile: two
    registers per thread and K step in the wgmma accumulator's layout, against a [SUB_N] vector
    per K step unswapped (which held the unswapped kernel to 128 x 64 tiles). H200, 44 problems
    (M 256-4096 x 11 (N, K), bench/results/h200/gluon/bquant-swapped/): 1.71x the unswapped
    128 x 64 kernel's speed and 1.69x the portable Triton kernel's (medians), 0.89x the Gluon
    rowcol kernel's on the same shapes (0.78-1.00x)."""
    return per_column_b_groups(spec) and spec.a_scale_kind is not ScaleKind.GROUP


def kernel_spec(spec: ProblemSpec, cfg: GluonConfig) -> ProblemSpec:
    """The problem as the kernel sees it: swapped (``cfg.swap_ab``), M and N, the operand types
    and the scale kinds trade places (the weight's column groups become row groups, per row and K
    group); both operands stay K-major (rcr)."""
    if not cfg.swap_ab:
        return spec
    return replace(spec, m=spec.n, n=spec.m, a_type=spec.b_type, b_type=spec.a_type,
                   a_scale_kind=spec.b_scale_kind, b_scale_kind=spec.a_scale_kind, group_n=1)


def acc_in_config(cfg: GluonConfig, out_dtype: torch.dtype) -> GluonConfig:
    """The config of a call with acc_in, or swapped with a bias: 128 x 128 (or 64) tiles without
    the overlapped loop. Loading the acc_in tile next to two 128-column accumulators (and the
    overlapped loop's in-flight partial sum) spilled registers: 520 B with a bias at 128 x 256
    overlapped, 104-712 B for int8 and fast_accum at 128 x 256, 24 B at 128 x 128 overlapped with
    masked stores (sm_90 build, 2026-12-01); every 128 x 128 and 128 x 64 config without overlap
    builds clean. Swapped bquant with a bias (along the tile's rows) spilled 160 B at 128 x 256
    overlapped and 288 B without the overlap (sm_90 build), none at 128 x 128."""
    out = replace(cfg, overlap=False)
    if cfg.block_n > 128:
        out = replace(out, block_n=128)
        out = replace(out, stages=max_stages(out, out_dtype))
    return out


def column_groups_config(cfg: GluonConfig, out_dtype: torch.dtype) -> GluonConfig:
    """The config of a call with b_scale groups of one column: 128 x 64 tiles. Their [64]
    column-scale vectors (two register sets: the loop is unrolled by two) fit beside the
    accumulator and the partial sum; at 128 x 128 every config spilled 190-620 B (sm_90 build,
    2026-12-01)."""
    out = replace(cfg, block_n=64, overlap=False)
    return replace(out, stages=max_stages(out, out_dtype))


def launch_config(cfg: GluonConfig, spec: ProblemSpec, tma_store: bool) -> GluonConfig:
    """The config one launch variant runs: the plan's, narrowed for masked stores and for acc_in,
    with at most the ring slots shared memory holds next to this output's staging buffers (a
    config forced or tuned for a 16-bit output would not fit an fp32 one's)."""
    spec = kernel_spec(spec, cfg)
    out = cfg if tma_store else masked_store_config(cfg, spec.out_dtype)
    if not tma_store and out.epi_preload:
        # Preloaded epilogue vectors beside the masked stores' addresses spilled (rowcol with a
        # bias: 144 B; abquant with a bias: 56 B; sm_90 build, 2026-12-01).
        out = replace(out, epi_preload=False)
    out = acc_in_config(out, spec.out_dtype) if spec.has_acc or (cfg.swap_ab and spec.has_bias) else out
    if per_column_b_groups(spec) and out.block_n > 64:
        out = column_groups_config(out, spec.out_dtype)
    return replace(out, stages=min(out.stages, max_stages(out, spec.out_dtype)))


def _waves(tiles: int, num_sms: int) -> int:
    return -(-tiles // num_sms)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def split_k_for(tiles: int, k_steps: int, num_sms: int) -> int:
    """K ranges per tile of the last, partial wave (1: no split): as many as fill the SMs, each
    at least MIN_SPLIT_STEPS K steps long."""
    rem = tiles % num_sms
    if rem == 0:
        return 1
    return max(1, min(num_sms // rem, k_steps // MIN_SPLIT_STEPS, MAX_SPLIT_K))


def gluon_config(spec: ProblemSpec, num_sms: int) -> GluonConfig:
    """The deterministic default (``choose_tiles``' config)."""
    return choose_tiles(spec, num_sms)[0]


def tile_costs(spec: ProblemSpec, num_sms: int, swapped: bool = False) -> dict[str, tuple[float, GluonConfig, str]]:
    """Each candidate tiling of the persistent grid with its cost in K steps of a 128 x 128 tile
    (the wave model) and a description; ``spec`` as the kernel sees it (``swapped``: the problem
    swapped, ``kernel_spec``)."""
    rows = math.ceil(spec.m / 128)
    k_steps = max(1, math.ceil(spec.k / 128))
    narrow = rows * math.ceil(spec.n / 128)
    out = {}
    w64 = _waves(2 * narrow, num_sms)
    if per_column_b_groups(spec):  # 128 x 64 tiles only (``column_groups_config``)
        return {"64": (w64 * k_steps * NARROW64_STEP, GluonConfig(block_n=64),
                       f"128 x 64 tiles (b_scale groups of one column): {2 * narrow} tiles, {_n(w64, 'wave')}")}
    w = _waves(narrow, num_sms)
    out["128"] = (w * k_steps, GluonConfig(block_n=128), f"128 x 128 tiles: {narrow} tiles, {_n(w, 'wave')}")
    split = split_k_for(narrow, k_steps, num_sms)
    if split > 1:
        full = narrow // num_sms
        cost = full * k_steps + math.ceil(k_steps / split) + SPLIT_FIXED_STEPS
        last = (f"{_n(full, 'full wave')}, the last {narrow % num_sms} tiles" if full
                else "every tile")
        out["128+split"] = (cost, GluonConfig(block_n=128, split_k=split),
                            f"128 x 128 tiles: {narrow} tiles, {last} split {split} ways over K")
    out["64"] = (w64 * k_steps * NARROW64_STEP, GluonConfig(block_n=64),
                 f"128 x 64 tiles: {2 * narrow} tiles, {_n(w64, 'wave')}")
    # Wide tiles: group-scaled fp8 with a 16-bit output and no acc_in only (an fp32 output or an
    # acc_in tile spills: ``acc_in_config``). Rowcol, tensor, int8 and fast_accum (int8's main
    # loop) measured no faster with them.
    if (spec.scheme.grouped and not spec.integer_mainloop and spec.out_dtype != torch.float32
            and not spec.has_acc and not per_column_b_groups(spec) and not (swapped and spec.has_bias)):
        wide = rows * math.ceil(spec.n / 256)
        ww = _waves(wide, num_sms)
        out["256"] = (ww * k_steps * 2 / WIDE_TILE_GAIN, GluonConfig(block_n=256, overlap=True),
                      f"128 x 256 overlapped tiles: {wide} tiles, {_n(ww, 'wave')}")
    return out


def choose_tiles(spec: ProblemSpec, num_sms: int) -> tuple[GluonConfig, str]:
    """The default config and why (``_choose_tiles``), for the problem swapped where ``swap_for``
    says so."""
    if not swap_for(spec):
        return _choose_tiles(spec, num_sms)
    cfg, why = _choose_tiles(kernel_spec(spec, GluonConfig(swap_ab=True)), num_sms, swapped=True)
    return replace(cfg, swap_ab=True), f"swapped (b_scale groups of one column on the tile's rows): {why}"


def _choose_tiles(spec: ProblemSpec, num_sms: int, swapped: bool = False) -> tuple[GluonConfig, str]:
    """The default config and why: the cheapest tiling under a model of the persistent grid's
    waves (``tile_costs``). A wave costs its tiles' K steps (ceil(tiles / SMs) counts the last,
    partial wave as a whole one); 128 x 64 tiles cost NARROW64_STEP per step, 128 x 256 tiles
    (group-scaled fp8, 16-bit output, overlapped) 2 / WIDE_TILE_GAIN; splitting the last wave
    over K makes it ceil(K steps / split) long plus SPLIT_FIXED_STEPS. Ring slots: as many as
    shared memory holds (6 for a bf16 output at BN = 128, 4 at 256)."""
    costs = tile_costs(spec, num_sms, swapped)
    best = min(costs, key=lambda key: costs[key][0])  # (ties: the first, the plainest)
    cost, cfg, what = costs[best]
    others = ", ".join(f"{key} {c:.0f}" for key, (c, _, _) in costs.items() if key != best)
    why = f"{what} on {num_sms} SMs: {cost:.0f} K steps of a 128 x 128 tile, against {others}"
    if spec.has_acc and spec.scheme.grouped:
        why += "; with acc_in, 128 x 256 tiles spill registers (acc_in_config)"
    elif swapped and spec.has_bias:
        why += "; swapped with a bias, 128 x 256 tiles spill registers (acc_in_config)"
    if preload_epilogue(spec, cfg):
        cfg = replace(cfg, epi_preload=True)
    return replace(cfg, stages=max_stages(cfg, spec.out_dtype)), why


def preload_epilogue(spec: ProblemSpec, cfg: GluonConfig) -> bool:
    """Whether the default config loads the epilogue's vectors at the start of each tile
    (``GluonConfig.epi_preload``): schemes without group scales (their row / column scale vectors
    are the epilogue's), on tiles of at most 128 columns. Timed on an H200 against the same
    config loading them after the main loop (bench/results/h200/gluon/preload/, 77 problems,
    same run): by tile median 1.02-1.03x on 128 x 128 tiles, 1.08-1.10x on 128 x 64 tiles,
    1.03x on split tiles at M 128-512 and 0.99-1.01x on them at M >= 1024, for fp8 rowcol and
    fast_accum; int8 1.01-1.02x. With group scales the epilogue holds only the bias: no change
    measured (0.997-1.006), left off."""
    return not spec.scheme.grouped and cfg.block_n <= 128
