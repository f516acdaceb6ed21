"""How the portable Triton kernel runs a (ProblemSpec, TileConfig): facts of the kernel.

- orientation: whether the kernel computes C^T = B^T A^T (swap-AB), and the problem as the
  kernel then sees it (its A and B storage types, compute types, layouts and scale kinds);
- load paths: whether an int4 operand is read as 16-bit words of four nibbles;
- K masking: whether every K tile is full (no K masks).

The planner (``tileq explain``), the shared-memory estimate of the legality predicate
(``kernels.config``), the AOT build and the launcher (``kernels.launch``: constexprs, signature,
operand order) all read these answers instead of working them out anew. Imports no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from ..dtypes import OperandType, mma_types
from ..problem import ProblemSpec, ScaleKind

if TYPE_CHECKING:  # (annotations only: kernels.config imports this module)
    from .config import TileConfig

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
