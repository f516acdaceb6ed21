"""What the grouped kernel specializes on (``GroupedSpec``) and how it tiles (``GroupedConfig``).

Hashable and tensor-free: ``tileq.api_grouped`` builds a spec from validated arguments,
``dispatch.plan.make_plan`` plans it (``dispatch.grouped``'s rule), the launcher maps (spec,
config) to the kernel's constexprs.
Imports no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...dtypes import OperandType, integer_mainloop, mma_types
from ...problem import GroupCounts, ProblemSpec, ScaleKind, Scheme

FORMS = ("contiguous", "masked")


@dataclass(frozen=True)
class GroupedSpec(GroupCounts):
    """One grouped call. ``rows``: T (contiguous form, x [T, K]) or C (masked form, x [E, C, K]).

    Scales: ``x_scale`` 'none', 'vector' (per row) or 'group' ([rows, Gk]); ``w_scale`` 'vector'
    ([E, N]) or 'group' ([E, Gn, Gk], one row per N group of ``group_n``)."""

    form: str
    e: int
    rows: int
    n: int
    k: int
    x_type: OperandType
    w_type: OperandType
    scheme: Scheme
    x_scale: ScaleKind
    w_scale: ScaleKind
    out_dtype: torch.dtype = torch.bfloat16
    group_k: int = 128
    group_n: int = 1
    has_row_scale: bool = False

    @property
    def integer_mainloop(self) -> bool:
        return integer_mainloop(self.x_type, self.w_type)

    @property
    def grouped(self) -> bool:
        return self.scheme.grouped

    @property
    def rows_per_expert(self) -> int:
        """What the host knows of an expert's rows: T / E (rounded up) or C. The real counts live
        on the device and are never read here."""
        if self.form == "masked":
            return self.rows
        return -(-self.rows // self.e) if self.e else 0

    def expert(self) -> ProblemSpec:
        """One expert's GEMM as tileq.linear describes it (rows_per_expert rows, the logical
        B = w[e].t() stored K-contiguous: layout 'rcr')."""
        return ProblemSpec(
            m=self.rows_per_expert, n=self.n, k=self.k, a_type=self.x_type, b_type=self.w_type,
            layout="rcr", scheme=self.scheme, a_scale_kind=self.x_scale, b_scale_kind=self.w_scale,
            out_dtype=self.out_dtype, group_k=self.group_k, group_n=self.group_n,
        )

    def mma_types(self) -> tuple[OperandType, OperandType]:
        return mma_types(self.x_type, self.w_type)


@dataclass(frozen=True)
class GroupedConfig:
    """A tile of the grouped kernel: ``block_m`` rows of one expert x ``block_n`` output columns,
    ``block_k`` deep. ``swap_ab``: the kernel computes the tile transposed (weight rows on the
    matrix instruction's M side, the few tokens on its N side), the decode orientation.
    ``group_m``: row tiles per group of the launch order (L2 reuse)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False
    group_m: int = 8

    @property
    def tag(self) -> str:
        """m128n128k128_w8_s3 (+ _g<group_m> unless 8, _swap when swapped)."""
        t = f"m{self.block_m}n{self.block_n}k{self.block_k}_w{self.num_warps}_s{self.num_stages}"
        t += f"_g{self.group_m}" if self.group_m != 8 else ""
        return t + ("_swap" if self.swap_ab else "")


def config_problem(spec: GroupedSpec, cfg: GroupedConfig) -> str | None:
    """Why ``cfg`` cannot run ``spec`` (None when it can): the one legality rule."""
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v > 512 or v & (v - 1):
            return f"{name}={v}: expected a power of two in [16, 512]"
    ct = spec.mma_types()[0]
    if ct in (OperandType.I8, OperandType.FP8, OperandType.BF8) and cfg.block_k < 32:
        return f"block_k={cfg.block_k}: 8-bit matrix instructions need block_k >= 32"
    if spec.grouped and spec.group_k % cfg.block_k:
        return f"block_k={cfg.block_k} must divide group_k={spec.group_k} (promotion per K-group)"
    if cfg.num_warps not in (1, 2, 4, 8) or not 1 <= cfg.num_stages <= 8:
        return f"num_warps={cfg.num_warps}, num_stages={cfg.num_stages}: expected 1-8 warps, 1-8 stages"
    if cfg.group_m < 1:
        return f"group_m={cfg.group_m}: expected >= 1"
    return None
