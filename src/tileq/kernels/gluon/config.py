"""Configuration of the sm_90 Gluon prefill kernel (``ws_gemm.py``): tile, ring depth, partitions,
how a problem accumulates (``accumulation``) and its instance names.

Imports no Triton: the planner and ``tileq explain`` read it on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ...problem import ProblemSpec, ScaleKind

# sm_90: 227 KiB of shared memory per program (opt-in maximum, device.py) less a margin for
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
    # partials summed in order by kernels/split_k.py: the last wave then keeps every SM busy.
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


def per_column_b_groups(spec: ProblemSpec) -> bool:
    """b_scale groups of one column (group_n = 1): a [SUB_N] scale vector per K group."""
    return spec.b_scale_kind is ScaleKind.GROUP and spec.group_n == 1


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
