"""A grouped GEMM's route (a ``GroupedSpec``): its tile config, orientation and launch order, and why.

The host never knows how many rows each expert has (they live on the device), so the rule reads
what the shapes say: T / E rows per expert in the contiguous form, C in the masked form (an upper
bound). The bands are ``GROUPED_SWAP_MAX_M`` and the dense GEMM's ``DECODE_MAX_M``
(``thresholds``) and the tiles start from the arch's defaults (``heuristic.base_config``):

- few rows per expert (<= GROUPED_SWAP_MAX_M): swapped decode tile, the weight's rows on the
  matrix instruction's 64-row side and 16 or 32 tokens on its narrow side (wgmma m64n16 / m64n32
  on sm_90); weight bytes dominate, so the K tile is the arch's long decode one;
- up to DECODE_MAX_M: the decode tile unswapped (64 rows);
- above: the arch's prefill tile, launched in groups of GROUPED_PREFILL_GROUP_M row tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from ..device import ARCHS, check_types
from ..errors import UnsupportedError, expect
from ..kernels.grouped.launch import grid
from ..kernels.grouped.spec import GroupedConfig, GroupedSpec, config_problem
from . import thresholds
from .heuristic import base_config

if TYPE_CHECKING:
    from .plan import Plan

@dataclass(frozen=True)
class GroupedRoute:
    """What runs a grouped GEMM: the grouped kernel's tile config, and why."""

    config: GroupedConfig | None  # None: the reference executor
    reason: str

    def describe(self, plan: Plan) -> str:
        s = plan.spec
        where = plan.executor + (" (Triton interpreter)" if plan.interpreted else "")
        groups = f"  group_k={s.group_k} group_n={s.group_n}" if s.grouped else ""
        lines = [
            (f"problem   : grouped {s.form} {s.scheme} {s.x_type}x{s.w_type}  E={s.e} "
            f"{'C' if s.form == 'masked' else 'T'}={s.rows} N={s.n} K={s.k}{groups}"),
            f"scales    : x_scale {s.x_scale}, w_scale {s.w_scale}"
            + (", row_scale per row" if s.has_row_scale else ""),
            f"executor  : {where}",
        ]
        if self.config is not None:
            c = self.config
            lines.append(f"config    : BM={c.block_m} BN={c.block_n} BK={c.block_k} warps={c.num_warps} "
                         f"stages={c.num_stages} group_m={c.group_m}"
                         f"{' swapped' if c.swap_ab else ''}  [{plan.arch.name}]")
            lines.append(f"grid      : {grid_text(s, c)}")
        else:
            lines.append("config    : n/a (the reference loops over experts in torch)")
        lines.append(f"why       : {self.reason}")
        lines.append("lowering  : per expert " + " -> ".join(lowering(s)))
        return "\n".join(lines)


REFERENCE_ROUTE = GroupedRoute(None, "the reference backend (per-expert torch loop)")


def grid_text(spec: GroupedSpec, cfg: GroupedConfig) -> str:
    tiles_n = -(-spec.n // cfg.block_n)
    if spec.form == "masked":
        m = grid(spec, cfg)[0]
        return (f"{m} x {tiles_n} programs (E x ceil(C/BM) row tiles; those past counts[e] exit at once)")
    m = grid(spec, cfg)[0]
    return (f"{m} x {tiles_n} programs (ceil(T/BM) + min(E, T) row tiles, an upper bound; each finds its "
            "expert from offsets on the device, the surplus exits at once)")


def lowering(spec: GroupedSpec) -> list[str]:
    st = []
    mma_x, mma_w = spec.mma_types()
    if spec.w_type.value == "i4":
        st.append(f"unpack w(i4->{mma_w})")
    elif spec.x_type is not mma_x:
        st.append(f"convert x({spec.x_type}->{mma_x})")
    elif spec.w_type is not mma_w:
        st.append(f"convert w({spec.w_type}->{mma_w})")
    acc = "i32" if spec.integer_mainloop else "f32"
    if spec.grouped:
        st.append(f"mma({mma_x}x{mma_w}->{acc}) per K-group of {spec.group_k}")
        sc = [n for n, k in (("x_scale[rows,Gk]", spec.x_scale), ("w_scale[Gn,Gk]", spec.w_scale))
              if k.value == "group"]
        st.append("promote(" + " x ".join(sc) + ") += f32")
    else:
        st.append(f"mma({mma_x}x{mma_w}->{acc})")
    st.append("f32")
    if spec.x_scale.value == "vector":
        st.append("x_scale[rows]")
    if spec.w_scale.value == "vector":
        st.append("w_scale[N]")
    if spec.has_row_scale:
        st.append("row_scale[rows]")
    st.append(f"cast {str(spec.out_dtype).removeprefix('torch.')}")
    return st


@lru_cache(maxsize=1024)
def choose_config(spec: GroupedSpec, arch_name: str) -> tuple[GroupedConfig, str]:
    """The tile config and the reason, from the rows an expert can have (shapes only)."""
    arch = ARCHS[arch_name]
    check_types(arch, spec.x_type, spec.w_type)
    t = thresholds.for_arch(arch_name)
    rows = spec.rows_per_expert
    what = f"{'C' if spec.form == 'masked' else 'T/E'}={rows} rows per expert"
    expert = spec.expert()
    decode = rows <= t.DECODE_MAX_M
    if rows <= t.GROUPED_SWAP_MAX_M:
        base = base_config(expert, arch, "decode")
        bm = 16 if rows <= 16 else 32
        cfg = GroupedConfig(bm, 64, base.block_k, base.num_warps, base.num_stages, swap_ab=True)
        why = (f"{what} <= GROUPED_SWAP_MAX_M={t.GROUPED_SWAP_MAX_M}: swapped decode tile (weight rows on the "
               f"64-row side, {bm} tokens on the narrow side; weight bytes dominate)")
    elif decode:
        base = base_config(expert, arch, "decode")
        cfg = GroupedConfig(64, 128 if base.block_k <= 128 else 64, base.block_k, base.num_warps,
                            base.num_stages)
        why = f"{what} <= DECODE_MAX_M={t.DECODE_MAX_M}: decode tile of 64 rows"
    else:
        base = base_config(expert, arch, "prefill")
        cfg = GroupedConfig(base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages,
                            group_m=int(t.GROUPED_PREFILL_GROUP_M))
        why = (f"{what} > DECODE_MAX_M={t.DECODE_MAX_M}: the arch's prefill tile, launched in groups of "
               f"{cfg.group_m} row tiles")
        if spec.x_type.is_float8 and spec.w_type.is_float8 and cfg.block_m > t.GROUPED_PREFILL_FP8_BLOCK_M:
            # Experts' row blocks are short (T x top-k / E rows): a 64-row tile wastes less of the last
            # one and doubles the programs per expert.
            cfg = replace(cfg, block_m=int(t.GROUPED_PREFILL_FP8_BLOCK_M), num_warps=4, num_stages=4)
            why += f"; fp8 x fp8: {cfg.block_m}-row tile, 4 warps, 4 stages (GROUPED_PREFILL_FP8_BLOCK_M)"
    bk = cfg.block_k
    while spec.grouped and spec.group_k % bk and bk > 16:
        bk //= 2  # a K tile must sit inside one scale group
    if bk != cfg.block_k:
        cfg = replace(cfg, block_k=bk)
        why += f"; BK={bk} to divide group_k={spec.group_k}"
    problem = config_problem(spec, cfg)
    if problem is not None:
        raise UnsupportedError(expect("group_k", "a multiple of 16 (32 for 8-bit operands): the grouped "
                                      "kernel's K tile must divide it", f"{spec.group_k} ({problem})"))
    return cfg, why

