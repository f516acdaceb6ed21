"""The sm_90 Gluon kernels: whether they can run here at all (arch, Triton version, the
TILEQ_GLUON switch), for the 8-bit prefill kernel (``kernels/gluon/``) and the int4 prefill kernel
(``kernels/int4p/prefill_kernel.py``) alike."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..device import triton_version
from ..dtypes import OperandType
from ..kernels.gluon.config import GluonConfig, kernel_spec, max_stages, per_column_b_groups
from ..problem import ProblemSpec, ScaleKind, Scheme
from . import thresholds
from .waves import split_to_fill, waves

GLUON_ARCH = "sm_90"
GLUON_TRITON_VERSIONS = ("3.6.0",)
GLUON_ENV = "TILEQ_GLUON"


def gluon_unavailable(arch_name: str | None, interpreted: bool, switch: bool | None) -> str | None:
    """Why no Gluon kernel runs for a plan on ``arch_name`` (``interpreted``: Triton's
    interpreter; ``switch``: ``settings.current().gluon``), or None when they can."""
    if interpreted:
        return "the Triton interpreter runs the portable kernel (Gluon needs a GPU)"
    if arch_name != GLUON_ARCH:
        return f"Gluon kernels are {GLUON_ARCH} only, this is {arch_name}"
    version = triton_version()
    if version not in GLUON_TRITON_VERSIONS:
        return f"Gluon kernels are tested with Triton {', '.join(GLUON_TRITON_VERSIONS)} only, this is {version}"
    if switch is False:
        return f"{GLUON_ENV}=0 switches the Gluon kernels off"
    return None


def _t():
    return thresholds.for_arch(GLUON_ARCH)


# ---------------------------------------------------------------------- which kernel runs a plan

# What the 8-bit Gluon kernel serves (kernels/gluon/ws_gemm.py): fp8 e4m3/e5m2 pairs and int8 x
# int8 in layout rcr (both operands K-major, as the 8-bit wgmma reads them).
GLUON_PAIRS = ((OperandType.FP8, OperandType.FP8), (OperandType.I8, OperandType.I8),
               (OperandType.BF8, OperandType.BF8), (OperandType.FP8, OperandType.BF8),
               (OperandType.BF8, OperandType.FP8))
GLUON_LAYOUTS = ("rcr",)
# int8 accumulates exactly in the wgmma's int32 accumulator: no promotion, no group schemes.
GLUON_INT8_SCHEMES = (Scheme.TENSOR, Scheme.ROWCOL)
GLUON_GROUP_K = 128  # the kernel's K tile: a group scale applies to exactly one K tile
GLUON_GROUP_N = 128  # a b_scale column group spans a 128-column sub-tile of the N tile
# On by default where the kernel measured faster than the portable one (gluon/final2/); the others
# it serves are opt-in, TILEQ_GLUON=1 (docs/performance.md section 1, "Kernels").
GLUON_DEFAULT_PAIRS = ((OperandType.FP8, OperandType.FP8), (OperandType.I8, OperandType.I8))

_GLUON_ON = "sm_90 warp-specialized kernel (TMA producer warp + 2 consumer warpgroups)"
_ALIGN_NOTE = "a call whose A or B rows or base pointers are not 16-byte aligned runs the Triton kernel"


@dataclass(frozen=True)
class Implementation:
    """Which kernel family runs a plan: 'triton' (portable) or 'gluon' (sm_90), and why."""

    name: str
    reason: str


def gluon_serves(spec: ProblemSpec, pipeline: str, decode_max_m: int) -> str | None:
    """Why the Gluon family does not serve this problem, or None when it does."""
    if pipeline not in ("prefill", "preshufflequant") or spec.m <= decode_max_m:
        return f"prefill only (M > {decode_max_m}): the {pipeline} pipeline runs the portable kernel"
    if (spec.a_type, spec.b_type) not in GLUON_PAIRS or spec.layout not in GLUON_LAYOUTS:
        return (f"8-bit rcr prefill only (fp8 e4m3/e5m2 pairs or int8 x int8; A row-major, B K-major "
                f"as the 8-bit wgmma reads them), this is {spec.a_type}x{spec.b_type} {spec.layout}")
    if spec.integer_mainloop and spec.scheme not in GLUON_INT8_SCHEMES:
        return f"int8 x int8: tensor and rowcol schemes only, this is {spec.scheme}"
    if spec.scheme.grouped and spec.group_k != GLUON_GROUP_K:
        return f"group_k = {GLUON_GROUP_K} only (one K tile per group), this is group_k={spec.group_k}"
    if spec.b_scale_kind is ScaleKind.GROUP and spec.group_n % GLUON_GROUP_N and spec.group_n != 1:
        return (f"b_scale groups of one column or of {GLUON_GROUP_N} (128 x 128 weight blocks) only, "
                f"this is group_n={spec.group_n}")
    if spec.k == 0:
        return "K = 0"
    return None


def implementation(spec: ProblemSpec, pipeline: str, arch_name: str | None, interpreted: bool,
                   switch: bool | None) -> Implementation:
    """The kernel family for a Triton-executor plan (``switch``: ``settings.current().gluon``).

    The Gluon kernel runs only on sm_90, with a Triton version it was tested with, compiled (not
    interpreted), for the problems it serves (``gluon_serves``), and only when switched on.
    """
    why = gluon_unavailable(arch_name, interpreted, None)
    if why is not None:
        return Implementation("triton", why)
    t = _t()
    why = gluon_serves(spec, pipeline, t.DECODE_MAX_M)
    if why is not None:
        return Implementation("triton", why)
    if switch is False:
        return Implementation("triton", f"{GLUON_ENV}=0 switches the Gluon kernel off")
    if switch is None and (spec.a_type, spec.b_type) not in GLUON_DEFAULT_PAIRS:
        return Implementation("triton", f"the Gluon sm_90 kernel serves this problem but is off by "
                                        f"default for {spec.a_type}x{spec.b_type}: {GLUON_ENV}=1 opts in")
    if switch is None and per_column_b_groups(spec) and not swap_for(spec):
        return Implementation("triton", f"the Gluon sm_90 kernel serves this problem but is off by default for "
                                        f"b_scale groups of one column with a_scale groups (correct on an H200, no "
                                        f"faster than the portable kernel there: 0.93-1.01x): "
                                        f"{GLUON_ENV}=1 opts in")
    if switch is None and spec.integer_mainloop and spec.m < t.GLUON_INT8_MIN_M:
        return Implementation("triton", f"the Gluon sm_90 kernel serves this problem but runs int8 by default "
                                        f"from M = {t.GLUON_INT8_MIN_M} only (below, not timed against the portable "
                                        f"kernel on an H200): {GLUON_ENV}=1 opts in")
    how = f"switched on by {GLUON_ENV}=1" if switch else "on by default"
    return Implementation("gluon", f"{_GLUON_ON}; {how}; {_ALIGN_NOTE}")


# ---------------------------------------------------------------------- its tiles (a wave model)

def swap_for(spec: ProblemSpec) -> bool:
    """Whether the kernel runs the problem swapped (C^T = B^T A^T, ``GluonConfig.swap_ab``):
    b_scale groups of one column without A groups (bquant with group_n = 1): those scales are
    then per row of the tile, two registers per thread (evidence: ``GLUON_SWAP_COLUMN_GROUPS``)."""
    return bool(_t().GLUON_SWAP_COLUMN_GROUPS) and per_column_b_groups(spec) and spec.a_scale_kind is not ScaleKind.GROUP


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def split_k_for(tiles: int, k_steps: int, num_sms: int) -> int:
    """K ranges per tile of the last, partial wave (1: no split): as many as fill the SMs, each
    at least GLUON_MIN_SPLIT_STEPS K steps long."""
    t = _t()
    return split_to_fill(tiles, num_sms, k_steps, t.GLUON_MIN_SPLIT_STEPS, t.GLUON_MAX_SPLIT_K)


def gluon_config(spec: ProblemSpec, num_sms: int) -> GluonConfig:
    """The deterministic default (``choose_tiles``' config)."""
    return choose_tiles(spec, num_sms)[0]


def tile_costs(spec: ProblemSpec, num_sms: int, swapped: bool = False) -> dict[str, tuple[float, GluonConfig, str]]:
    """Each candidate tiling of the persistent grid with its cost in K steps of a 128 x 128 tile
    (the wave model) and a description; ``spec`` as the kernel sees it (``swapped``: the problem
    swapped, ``kernel_spec``)."""
    t = _t()
    rows = math.ceil(spec.m / 128)
    k_steps = max(1, math.ceil(spec.k / 128))
    narrow = rows * math.ceil(spec.n / 128)
    out = {}
    w64 = waves(2 * narrow, num_sms)
    if per_column_b_groups(spec):  # 128 x 64 tiles only (``column_groups_config``)
        return {"64": (w64 * k_steps * t.GLUON_NARROW64_STEP, GluonConfig(block_n=64),
                       f"128 x 64 tiles (b_scale groups of one column): {2 * narrow} tiles, {_n(w64, 'wave')}")}
    w = waves(narrow, num_sms)
    out["128"] = (w * k_steps, GluonConfig(block_n=128), f"128 x 128 tiles: {narrow} tiles, {_n(w, 'wave')}")
    split = split_k_for(narrow, k_steps, num_sms)
    if split > 1:
        full = narrow // num_sms
        cost = full * k_steps + math.ceil(k_steps / split) + t.GLUON_SPLIT_FIXED_STEPS
        last = (f"{_n(full, 'full wave')}, the last {narrow % num_sms} tiles" if full
                else "every tile")
        out["128+split"] = (cost, GluonConfig(block_n=128, split_k=split),
                            f"128 x 128 tiles: {narrow} tiles, {last} split {split} ways over K")
    out["64"] = (w64 * k_steps * t.GLUON_NARROW64_STEP, GluonConfig(block_n=64),
                 f"128 x 64 tiles: {2 * narrow} tiles, {_n(w64, 'wave')}")
    # Wide tiles: group-scaled fp8 with a 16-bit output and no acc_in only (an fp32 output or an
    # acc_in tile spills: ``acc_in_config``); the other schemes measured no faster with them.
    if (spec.scheme.grouped and not spec.integer_mainloop and spec.out_dtype != torch.float32
            and not spec.has_acc and not per_column_b_groups(spec) and not (swapped and spec.has_bias)):
        wide = rows * math.ceil(spec.n / 256)
        ww = waves(wide, num_sms)
        out["256"] = (ww * k_steps * 2 / t.GLUON_WIDE_TILE_GAIN, GluonConfig(block_n=256, overlap=True),
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
    partial wave as a whole one); 128 x 64 tiles cost GLUON_NARROW64_STEP per step, 128 x 256 tiles
    (group-scaled fp8, 16-bit output, overlapped) 2 / t.GLUON_WIDE_TILE_GAIN; splitting the last wave
    over K makes it ceil(K steps / split) long plus GLUON_SPLIT_FIXED_STEPS. Ring slots: as many as
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
    """Whether the default config loads the epilogue\'s vectors at the start of each tile
    (``GluonConfig.epi_preload``): schemes without group scales (their row / column scale vectors
    are the epilogue\'s), on tiles of at most 128 columns (evidence: ``GLUON_EPI_PRELOAD``)."""
    return bool(_t().GLUON_EPI_PRELOAD) and not spec.scheme.grouped and cfg.block_n <= 128
