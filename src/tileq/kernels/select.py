"""Which kernel runs a (ProblemSpec, TileConfig): the one place that decides it.

- orientation: whether the kernel computes C^T = B^T A^T (swap-AB), and the problem as the
  kernel then sees it (its A and B storage types, compute types, layouts and scale kinds);
- load paths: whether an int4 operand is read as 16-bit words of four nibbles;
- K masking: whether every K tile is full (no K masks).

The planner (``plan.kernel_notes``, ``tileq explain``), the shared-memory estimate of the
legality predicate (``catalog.config``), the AOT build and the launcher (``kernels.launch``:
constexprs, signature, operand order) all read these answers instead of working them out anew.

This module imports no Triton and queries no device; it depends on ``problem``, ``dtypes`` and
the Gluon kernel's config (``kernels/gluon/config.py``, Triton-free too) only, so the catalog can
use it without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from ..dtypes import OperandType, mma_types
from ..errors import UnsupportedError, expect
from ..problem import ProblemSpec, ScaleKind, Scheme
from .gluon.config import per_column_b_groups, swap_for

if TYPE_CHECKING:  # no runtime import: catalog.config imports this module
    from ..catalog.config import TileConfig

_FLIP = {"r": "c", "c": "r"}


@dataclass(frozen=True)
class Orientation:
    """The problem as the tile kernel sees it.

    Unswapped, the kernel's A and B are the logical A and B. Swapped (C^T = B^T A^T), B plays the
    kernel's A: its storage type, compute type and b_scale (columns of C become the kernel's
    rows), and a layout flipped because B^T's contiguous dimension is the other one.
    """

    swapped: bool
    a_type: OperandType  # storage type of the kernel's A operand
    b_type: OperandType
    a_ct: OperandType  # the type each operand is converted to before the mma
    b_ct: OperandType
    a_layout: str  # 'r' (K contiguous) or 'c', as the kernel's A_LAYOUT
    b_layout: str  # 'r' (N contiguous) or 'c' (K contiguous), as the kernel's B_LAYOUT
    a_scale: ScaleKind  # the kernel's row scale (C^T's rows: b_scale when swapped)
    b_scale: ScaleKind


@lru_cache(maxsize=4096)
def orientation(spec: ProblemSpec, swapped: bool) -> Orientation:
    a_ct, b_ct = mma_types(spec.a_type, spec.b_type)
    if not swapped:
        return Orientation(False, spec.a_type, spec.b_type, a_ct, b_ct, spec.layout[0],
                           spec.layout[1], spec.a_scale_kind, spec.b_scale_kind)
    return Orientation(True, spec.b_type, spec.a_type, b_ct, a_ct, _FLIP[spec.layout[1]],
                       _FLIP[spec.layout[0]], spec.b_scale_kind, spec.a_scale_kind)


def i4_words_path(spec: ProblemSpec, cfg: "TileConfig") -> bool:
    """Whether the kernel reads the int4 operand as 16-bit words of four nibbles (four dots per
    K tile, see the kernel) rather than bytes: an int4 operand packed along K facing an 8-bit
    float (fp8/bf8), K a multiple of 4, K tiles of at least 128 (each dot then spans 32, the
    8-bit matrix instruction's depth), and a decode-sized activation tile. The storage must also
    be 2-byte aligned (checked per call by the launcher)."""
    packed_along_k = ((spec.b_type is OperandType.I4 and spec.layout[1] == "c")
                      or (spec.a_type is OperandType.I4 and spec.layout[0] == "r"))
    partner = spec.a_type if spec.b_type is OperandType.I4 else spec.b_type
    # Decode tiles only (the activation side of the tile at most 64): at prefill tiles the four
    # dots per K tile ran several times slower than the byte path (H200 benches, 2026-11-29).
    activation_tile = cfg.block_n if cfg.swap_ab else cfg.block_m
    return (packed_along_k and partner in (OperandType.FP8, OperandType.BF8)
            and spec.k % 4 == 0 and cfg.block_k >= 128 and activation_tile <= 64)


@dataclass(frozen=True)
class TritonKernel:
    """How the portable Triton tile kernel runs one (spec, config)."""

    orientation: Orientation
    i4_words: bool  # the int4 word path, when the storage is 2-byte aligned (launcher, per call)
    even_k: bool  # K % BK == 0: no K masks, the loads become plain async copies

    @property
    def swapped(self) -> bool:
        return self.orientation.swapped


@lru_cache(maxsize=4096)
def triton_kernel(spec: ProblemSpec, cfg: "TileConfig") -> TritonKernel:
    return TritonKernel(orientation(spec, cfg.swap_ab), i4_words_path(spec, cfg),
                        spec.k % cfg.block_k == 0)


def kernel_notes(spec: ProblemSpec, cfg: "TileConfig") -> list[str]:
    """How the Triton kernel runs this config: orientation, int4 loads, K masking (explain)."""
    tk = triton_kernel(spec, cfg)
    notes = ["swapped: computes C^T = B^T A^T, the weight on the mma's row side" if tk.swapped
             else "direct: A rows x B columns"]
    if OperandType.I4 in (spec.a_type, spec.b_type):
        notes.append("int4 read as 16-bit words, four dots per K tile (when 2-byte aligned)"
                     if tk.i4_words else "int4 read as bytes, unpacked in registers")
    notes.append("no K masks (K % BK == 0)" if tk.even_k else "last K tile masked")
    return notes


# ---------------------------------------------------------------------------- implementation

# The sm_90 Gluon family (kernels/gluon/): what it serves, where it was tested. Anything else
# runs the portable Triton kernel, the reference implementation and the fallback.
GLUON_ARCH = "sm_90"
GLUON_TRITON_VERSIONS = ("3.6.0",)
# fp8 e5m2 (bf8) pairs run the same kernel (wgmma takes e4m3 and e5m2 in any combination); they
# compile in the sm_90 build checks but have not been timed: opt-in (TILEQ_GLUON=1).
GLUON_PAIRS = ((OperandType.FP8, OperandType.FP8), (OperandType.I8, OperandType.I8),
               (OperandType.BF8, OperandType.BF8), (OperandType.FP8, OperandType.BF8),
               (OperandType.BF8, OperandType.FP8))
GLUON_LAYOUTS = ("rcr",)
# int8 accumulates exactly in the wgmma's int32 accumulator: no promotion, no group schemes.
GLUON_INT8_SCHEMES = (Scheme.TENSOR, Scheme.ROWCOL)
GLUON_GROUP_K = 128  # the kernel's K tile: a group scale applies to exactly one K tile
GLUON_GROUP_N = 128  # a b_scale column group spans a 128-column sub-tile of the N tile
# On by default where the GPU tests passed and the kernel beat the portable one (H200,
# 2026-12-01, bench/results/h200/gluon/): fp8 e4m3 at every prefill M (rowcol 0.97x cuBLASLt at
# M >= 1024 against the Triton kernel's 0.62x; 1x128 x 128x128 1.04x against 0.52x); int8 from
# GLUON_INT8_MIN_M tokens: with the pipelined int8 main loop it ran faster than the Triton kernel
# at every M timed, by median 1.59x / 1.52x / 1.13x / 1.19x at M 128 / 256 / 512 / 1024 (11
# (N, K) each, 0.98x at worst, same run: bench/results/h200/gluon/preload/int8.csv). Below
# M = 128 nothing was timed: the Triton kernel keeps those.
GLUON_DEFAULT_ON = True
GLUON_DEFAULT_PAIRS = ((OperandType.FP8, OperandType.FP8), (OperandType.I8, OperandType.I8))
GLUON_INT8_MIN_M = 128
# fast_accum (fp8 tensor/rowcol: the wgmma accumulates over all of K) and acc_in are served by
# default too: both pass the H200 tests (exact on small integers across every forced config),
# and fast_accum ran at 1.00x / 0.95x cuBLASLt's use_fast_accum at M 128-512 / >= 1024 (77
# problems, bench/results/h200/gluon/final/) against the Triton kernel's 0.75-0.87x. acc_in was
# not timed: its main loop is the timed one's, plus one read of the acc_in tile per tile.
# The e5m2 (bf8) pairs pass the same GPU tests but were not timed: opt-in. b_scale groups of one
# column pass them too; unswapped (128 x 64 tiles) they ran at 0.93-1.01x the Triton kernel's
# speed (gluon/final2/): opt-in where a_scale has groups too (abquant); bquant's run swapped
# (``gluon.config.swap_for``), on by default: 1.69x the Triton kernel's speed (median of 44
# problems, M 256-4096; bench/results/h200/gluon/bquant-swapped/), GPU tests passed.
GLUON_ENV = "TILEQ_GLUON"

_GLUON_ON = "sm_90 warp-specialized kernel (TMA producer warp + 2 consumer warpgroups)"
_ALIGN_NOTE = "a call whose A or B rows or base pointers are not 16-byte aligned runs the Triton kernel"


@dataclass(frozen=True)
class Implementation:
    """Which kernel family runs a plan: 'triton' (portable) or 'gluon' (sm_90), and why."""

    name: str
    reason: str


def _triton_version() -> str:
    import triton

    return triton.__version__


def gluon_switch(raw) -> bool | None:
    """TILEQ_GLUON's value: True ('1'), False ('0'), None (unset: the shipped default)."""
    if raw is None:
        return None
    value = raw.decode() if isinstance(raw, bytes) else str(raw)
    value = value.strip()
    if value not in ("0", "1"):
        raise UnsupportedError(expect(GLUON_ENV, "0 or 1", repr(value)))
    return value == "1"


def gluon_serves(spec: ProblemSpec, pipeline: str) -> str | None:
    """Why the Gluon family does not serve this problem, or None when it does."""
    from ..catalog.heuristic import DECODE_MAX_M  # (catalog imports this module: no cycle here)

    if pipeline not in ("prefill", "preshufflequant") or spec.m <= DECODE_MAX_M:
        return f"prefill only (M > {DECODE_MAX_M}): the {pipeline} pipeline runs the portable kernel"
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
                   gluon_env=None) -> Implementation:
    """The kernel family for a Triton-executor plan. ``gluon_env``: TILEQ_GLUON's raw value.

    The Gluon kernel runs only on sm_90, with a Triton version it was tested with, compiled (not
    interpreted), for the problems it serves (``gluon_serves``), and only when switched on.
    """
    if interpreted:
        return Implementation("triton", "the Triton interpreter runs the portable kernel (Gluon needs a GPU)")
    if arch_name != GLUON_ARCH:
        return Implementation("triton", f"Gluon kernels are {GLUON_ARCH} only, this is {arch_name}")
    version = _triton_version()
    if version not in GLUON_TRITON_VERSIONS:
        return Implementation("triton", f"Gluon kernels are tested with Triton "
                                        f"{', '.join(GLUON_TRITON_VERSIONS)} only, this is {version}")
    why = gluon_serves(spec, pipeline)
    if why is not None:
        return Implementation("triton", why)
    switch = gluon_switch(gluon_env)
    if switch is False:
        return Implementation("triton", f"{GLUON_ENV}=0 switches the Gluon kernel off")
    if switch is None and not (GLUON_DEFAULT_ON and (spec.a_type, spec.b_type) in GLUON_DEFAULT_PAIRS):
        return Implementation("triton", f"the Gluon sm_90 kernel serves this problem but is off by "
                                        f"default for {spec.a_type}x{spec.b_type}: {GLUON_ENV}=1 opts in")
    if switch is None and per_column_b_groups(spec) and not swap_for(spec):
        return Implementation("triton", f"the Gluon sm_90 kernel serves this problem but is off by default for "
                                        f"b_scale groups of one column with a_scale groups (correct on an H200, no "
                                        f"faster than the portable kernel there: 0.93-1.01x): "
                                        f"{GLUON_ENV}=1 opts in")
    if switch is None and spec.integer_mainloop and spec.m < GLUON_INT8_MIN_M:
        return Implementation("triton", f"the Gluon sm_90 kernel serves this problem but runs int8 by default "
                                        f"from M = {GLUON_INT8_MIN_M} only (below, not timed against the portable "
                                        f"kernel on an H200): {GLUON_ENV}=1 opts in")
    how = f"switched on by {GLUON_ENV}=1" if switch else "on by default"
    return Implementation("gluon", f"{_GLUON_ON}; {how}; {_ALIGN_NOTE}")
