"""Configuration of the sm_90 Gluon prefill kernel (``ws_gemm.py``): tile, ring depth, partitions,
how a problem accumulates (``accumulation``) and its instance names.

Imports no Triton: the planner and ``tileq explain`` read it on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ...problem import ProblemSpec

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
    # K split in this many ranges, each item a (tile, range) pair, fp32 partials summed in order
    # by gemm_kernel._splitk_reduce_kernel: for tiles too few to fill the SMs (a medium M).
    # Runs 128 x 128 (or 64) tiles with masked stores into the workspace, no overlap.
    split_k: int = 1
    # setmaxnreg budgets per thread. The kernel runs 12 warps (4 + 4 + the producer's warpgroup,
    # which Triton pads to 4 warps) under maxnreg = 168, i.e. 168 x 384 = 64512 of the 65536
    # registers: 232 x 128 for each consumer warpgroup and 40 x 128 for the producer's (the
    # split DeepGEMM uses). A consumer holds two 64 x BN fp32 tiles (its accumulator and the
    # wgmma partial sum): 128 registers at BN = 128.
    consumer_regs: int = 232
    producer_regs: int = 40
    maxnreg: int = 168
    num_warps: int = 4  # the default partition (consumer 0); the kernel adds 4 + 1 worker warps

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
        return f"m{self.block_m}n{self.block_n}k{self.block_k}_s{self.stages}{epi}{ovl}{split}_ws2x64"

    def describe(self, accumulation: str = "promoted") -> str:
        """``accumulation``: ``accumulation(spec)``."""
        acc = {"int32": "int32 in the wgmma accumulator over all of K",
               "fast": "fast_accum: fp32 in the wgmma accumulator over all of K (fp8's reduced precision)",
               "promoted": f"fp32 promotion every {self.block_k} of K"}[accumulation]
        subs = f" ({self.sub_tiles} sub-tiles of {self.sub_n} columns)" if self.sub_tiles > 1 else ""
        ovl = ("; next tile's first wgmma during the epilogue" if self.overlap and accumulation == "promoted"
               else "")
        return (f"BM={self.block_m} BN={self.block_n}{subs} BK={self.block_k} stages={self.stages} "
                f"GROUP_M={self.group_m}; persistent; 1 TMA producer warp (setmaxnreg "
                f"{self.producer_regs}) + 2 consumer warpgroups x 64 rows (setmaxnreg {self.consumer_regs}; "
                f"code within {self.maxnreg} registers); {acc}{ovl}")


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
    """The config of a call whose output TMA cannot store (e.g. N = 577 in bf16, or split-K's
    workspace): 128 x 128 in place of 128 x 256 tiles, whose masked stores (64-bit addresses of
    two sub-tiles) would spill registers (sm_90 build, 2026-12); split-K without the overlapped
    loop (each item's partial is stored before the next starts)."""
    out = cfg
    if cfg.sub_tiles > 1:
        out = replace(cfg, block_n=128, overlap=False)
        out = replace(out, stages=max_stages(out, out_dtype))
    if out.split_k > 1 and out.overlap:
        out = replace(out, overlap=False)
    return out


def acc_in_config(cfg: GluonConfig, out_dtype: torch.dtype) -> GluonConfig:
    """The config of a call with acc_in: 128 x 128 (or 64) tiles without the overlapped loop.
    Loading the acc_in tile next to two 128-column accumulators (and the overlapped loop's
    in-flight partial sum) spilled registers: 520 B with a bias at 128 x 256 overlapped, 104-712 B
    for int8 and fast_accum at 128 x 256, 24 B at 128 x 128 overlapped with masked stores (sm_90
    build, 2026-12-01); every 128 x 128 and 128 x 64 config without overlap builds clean."""
    out = replace(cfg, overlap=False)
    if cfg.block_n > 128:
        out = replace(out, block_n=128)
        out = replace(out, stages=max_stages(out, out_dtype))
    return out


def launch_config(cfg: GluonConfig, spec: ProblemSpec, tma_store: bool) -> GluonConfig:
    """The config one launch variant runs: the plan's, narrowed for masked stores (and split-K's
    workspace) and for acc_in."""
    out = cfg if tma_store and cfg.split_k == 1 else masked_store_config(cfg, spec.out_dtype)
    return acc_in_config(out, spec.out_dtype) if spec.has_acc else out


# Throughput per tile of a 128 x 256 tile with the overlapped main loop over a 128 x 128 tile,
# for group-scaled fp8 (A and/or B scales per 128 of K): median 1.3x (1.17-1.42x) at M = 4096
# and 8192 over 11 (N, K) of Qwen3-14B, Llama-3-8B, DeepSeek-V3 and Mistral-Small-24B (H200,
# 2026-12-01, bench/results/h200/gluon/). Rowcol and tensor gained nothing from wide tiles
# (0.94-1.06x, mixed), int8 lost (0.9x median), so they keep 128 x 128.
WIDE_TILE_GAIN = 1.3


def _waves(tiles: int, num_sms: int) -> int:
    return -(-tiles // num_sms)


def gluon_config(spec: ProblemSpec, num_sms: int) -> GluonConfig:
    """The deterministic default (``choose_tiles``' config)."""
    return choose_tiles(spec, num_sms)[0]


def choose_tiles(spec: ProblemSpec, num_sms: int) -> tuple[GluonConfig, str]:
    """The default config and why, a model of the persistent grid's waves:
    - 128 x 64 tiles where 128-wide tiles would fill at most half the SMs (a small M: each
      program then finishes in about half the time);
    - for group-scaled fp8 with a 16-bit output (an fp32 one spills) and no acc_in (it spills,
      ``acc_in_config``), 128 x 256 tiles with the overlapped main loop (masked-store calls:
      ``masked_store_config``) where their waves, each WIDE_TILE_GAIN times cheaper per column
      than two narrow tiles' waves, take less time (ceil(tiles / SMs) counts the last, partial
      wave as a whole one);
    - 128 x 128 otherwise;
    and as many ring slots as shared memory holds (6 for a bf16 output at BN = 128, 4 at 256)."""
    rows = math.ceil(spec.m / 128)
    narrow = rows * math.ceil(spec.n / 128)
    wide = rows * math.ceil(spec.n / 256)
    w_narrow, w_wide = _waves(narrow, num_sms), _waves(wide, num_sms)
    wide_kind = spec.scheme.grouped and not spec.integer_mainloop and spec.out_dtype != torch.float32
    if narrow * 2 <= num_sms:
        cfg = GluonConfig(block_n=64)
        why = f"128 x 64 tiles: {narrow} tiles of 128 x 128 would fill at most half of {num_sms} SMs"
    elif wide_kind and spec.has_acc:
        cfg = GluonConfig(block_n=128)
        why = "128 x 128 tiles: with acc_in, 128 x 256 tiles spill registers (acc_in_config)"
    elif wide_kind and 2 * w_wide < WIDE_TILE_GAIN * w_narrow:
        cfg = GluonConfig(block_n=256, overlap=True)
        why = (f"128 x 256 overlapped tiles: {wide} tiles, {w_wide} waves on {num_sms} SMs, worth "
               f"{2 * w_wide / WIDE_TILE_GAIN:.1f} waves of 128 x 128 tiles against their {w_narrow}")
    elif wide_kind:
        cfg = GluonConfig(block_n=128)
        why = (f"128 x 128 tiles: {narrow} tiles, {w_narrow} waves on {num_sms} SMs, against 128 x 256 "
               f"tiles worth {2 * w_wide / WIDE_TILE_GAIN:.1f}")
    elif mma_accumulates(spec) and not spec.integer_mainloop:
        # fp8 fast_accum runs int8's main loop (no promotion, no partial sum: 128 x 256 fits,
        # 2 x 64 accumulator registers, and builds clean), where 128 x 256 measured 0.9x of
        # 128 x 128 (before the loop kept a wgmma in flight); fast_accum itself is not timed yet.
        cfg = GluonConfig(block_n=128)
        why = "128 x 128 tiles (fast_accum runs int8's main loop, where wide tiles measured slower)"
    else:
        cfg = GluonConfig(block_n=128)
        why = "128 x 128 tiles (wide tiles measured no faster for tensor, rowcol and int8 scales)"
    return replace(cfg, stages=max_stages(cfg, spec.out_dtype)), why
