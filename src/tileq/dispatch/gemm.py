"""An 8-bit or pk_int4 GEMM's route (a ``ProblemSpec``): the pipeline, the portable kernel's config
(a tuned table, else the heuristic), whether the sm_90 Gluon kernel runs it and with which tiles,
and the lowering as tile stages. One route, two executors: the Triton kernel is specialized on it
and the torch reference interprets the same problem, so ``tileq explain`` shows what either does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..catalog.names import KernelFamily
from ..device import DeviceFacts, check_types
from ..dtypes import compute_type, mma_types
from ..errors import UnsupportedError, expect
from ..kernels.config import TileConfig
from ..kernels.gluon.config import GluonConfig, accumulation, instance_name, launch_config, split_schedule
from ..kernels.select import kernel_notes
from ..problem import ProblemSpec, ScaleKind
from . import thresholds, tuned
from .gluon import choose_tiles, implementation
from .heuristic import choose_pipeline, heuristic_config

if TYPE_CHECKING:
    from .plan import Plan

_DTYPE_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "f32", torch.int32: "i32"}


@dataclass(frozen=True)
class GemmRoute:
    """What runs an 8-bit or pk_int4 GEMM: the kernel family (its pipeline), the portable kernel's
    config and where it came from, and the Gluon kernel where it takes the problem."""

    family: KernelFamily
    config: TileConfig | None  # None: the reference executor
    config_source: str  # 'heuristic' | 'table: <file>' | 'n/a'
    pipeline_reason: str
    # Which kernel family runs it (kernels/select.py): 'triton' (the portable kernel, also the
    # fallback of a Gluon plan for calls TMA cannot serve) or 'gluon' (sm_90), and why.
    impl: str = "triton"
    impl_reason: str = ""
    gluon: object = None  # kernels.gluon.config.GluonConfig when impl == 'gluon'
    gluon_reason: str = ""  # why that tile (kernels.gluon.config.choose_tiles)

    @property
    def pipeline(self) -> str:
        return self.family.pipeline

    @property
    def in_kernel_sum(self) -> bool:
        """Whether the portable kernel sums its split over K itself (``sums_in_kernel``)."""
        return self.config is not None and sums_in_kernel(self.pipeline, self.config)

    def gluon_launch(self, spec: ProblemSpec, num_sms: int, tma_store: bool) -> GluonConfig:
        """The config the Gluon kernel runs for an output stored by TMA (``tma_store``; a property
        of the output's address, known per call) or by masked stores on ``num_sms`` SMs: ``gluon``
        narrowed for that output (``launch_config``: what builds without spilling), without its
        split where the schedule splits no tile (the tiles fill whole waves)."""
        cfg = launch_config(self.gluon, spec, tma_store)
        rows, cols = (spec.n, spec.m) if cfg.swap_ab else (spec.m, spec.n)
        if cfg.split_k > 1 and not split_schedule(rows, cols, cfg, num_sms)[2]:
            cfg = replace(cfg, split_k=1)
        return cfg

    def describe(self, plan: Plan) -> str:
        s = plan.spec
        where = plan.executor + (" (Triton interpreter)" if plan.interpreted else "")
        lines = [
            f"problem   : {s.scheme} {s.a_type}x{s.b_type} {s.layout}  M={s.m} N={s.n} K={s.k}"
            + (f"  group_k={s.group_k} group_n={s.group_n}" if s.scheme.grouped else ""),
            f"executor  : {where}",
            f"pipeline  : {self.pipeline} ({self.pipeline_reason})",
            f"family    : {self.family.name}",
        ]
        if plan.executor == "triton":
            lines.append(f"impl      : {self.impl} ({self.impl_reason})")
        if self.gluon is not None:
            lines.append(f"gluon     : {instance_name(self.family.name, s, self.gluon, plan.arch.tag)}")
            lines.append(f"            {self.gluon.describe(accumulation(s))}")
            if self.gluon_reason:
                lines.append(f"            {self.gluon_reason}")
        if plan.instance is not None:
            fallback = " (the Triton fallback)" if self.gluon is not None else ""
            lines.append(f"instance  : {plan.instance.name}{fallback}")
            c = self.config
            lines.append(
                f"config    : BM={c.block_m} BN={c.block_n} BK={c.block_k} warps={c.num_warps} "
                f"stages={c.num_stages} split_k={c.split_k}  [{self.config_source}]"
            )
            lines.append("kernel    : " + "; ".join(kernel_notes(s, c)))
        else:
            lines.append("config    : n/a (the reference runs the same lowering in torch)")
        if self.in_kernel_sum:
            lines.append("reduction : split over K summed in the kernel by each tile's last program, in split order "
                         "(one launch; bit-identical run to run)")
        else:
            lines.append("reduction : fixed order, no atomics (bit-identical run to run)")
        lines.append("lowering  : " + " -> ".join(lowering(s)))
        return "\n".join(lines)


def sums_in_kernel(pipeline: str, cfg: TileConfig) -> bool:
    """A decode split over K is summed by the kernel itself (each tile's last program adds the
    partials in split order), saving the reduction kernel's launch; its tiles are small ([64, 16]
    fp32: the last program's extra reads are a few KB). Prefill splits keep the reduction kernel,
    which spreads the sum of large tiles over the whole GPU."""
    return pipeline == "decode" and cfg.split_k > 1


def lowering(spec: ProblemSpec) -> list[str]:
    """The tile stages in the epilogue order of docs/schemes.md section 1."""
    st: list[str] = []
    ct = compute_type(spec.a_type, spec.b_type)
    for side, t in (("a", spec.a_type), ("b", spec.b_type)):
        if t is not ct:
            st.append(f"convert {side}({t}->{ct})" if t.value != "i4" else f"unpack {side}(i4->{ct})")
    acc_short = "i32" if spec.integer_mainloop else "f32"
    mma_a, mma_b = mma_types(spec.a_type, spec.b_type)
    mma = f"mma({mma_a}x{mma_b}->{acc_short})"
    if spec.a_type.is_float8 and spec.b_type.is_float8 and not spec.scheme.grouped:
        mma += " fast-accum" if spec.fast_accum else " promoted to f32 per K tile"
    if spec.scheme.grouped:
        scales = []
        if spec.a_scale_kind is ScaleKind.GROUP:
            scales.append(f"a_scale[M,Gk]({spec.a_scale_layout})")
        if spec.b_scale_kind is ScaleKind.GROUP:
            scales.append(f"b_scale[Gk,Gn](group_n={spec.group_n})")
        st.append(f"{mma} per K-group of {spec.group_k}")
        st.append("promote(" + " x ".join(scales) + ") += f32")
    else:
        st.append(mma)
    if spec.has_acc:
        st.append(f"+ acc_in({_DTYPE_SHORT[spec.acc_dtype]})")
    st.append("cast f32" if spec.acc_dtype == torch.int32 else "f32")
    if spec.a_scale_kind is ScaleKind.SCALAR:
        st.append("row_scale(scalar)")
    elif spec.a_scale_kind is ScaleKind.VECTOR:
        st.append("row_scale[M]")
    if spec.b_scale_kind is ScaleKind.SCALAR:
        st.append("col_scale(scalar)")
    elif spec.b_scale_kind is ScaleKind.VECTOR:
        st.append("col_scale[N]")
    if spec.has_bias:
        st.append("+ bias[N]")
    st.append(f"cast {_DTYPE_SHORT[spec.out_dtype]}")
    return st


def family_of(spec: ProblemSpec, pipeline: str) -> KernelFamily:
    return KernelFamily(spec.scheme, spec.a_type, spec.b_type, spec.layout, pipeline)


def check_pipeline(pipeline: str | None, spec: ProblemSpec) -> str | None:
    """A pipeline the caller forces (None: the planner's choice), refused where the problem has no such pipeline."""
    if pipeline is None:
        return None
    allowed = ["prefill", "decode"]
    if spec.scheme.a_grouped and spec.a_scale_layout.value == "preshuffled":
        allowed.append("preshufflequant")
    if pipeline not in allowed:
        raise UnsupportedError(expect("pipeline", f"None or one of {', '.join(allowed)}", repr(pipeline)))
    return pipeline


def _pipeline(spec: ProblemSpec, arch_name: str | None, forced: str | None) -> tuple[str, str]:
    """(pipeline, why): the caller's, else decode up to the arch's DECODE_MAX_M."""
    if forced:
        return forced, "forced by the caller"
    decode_max_m = thresholds.for_arch(arch_name).DECODE_MAX_M
    pipeline = choose_pipeline(spec, decode_max_m)
    why = f"logical M={spec.m} {'<=' if spec.m <= decode_max_m else '>'} {decode_max_m}"
    if pipeline == "preshufflequant":
        why += ", a_scale preshuffled"
    return pipeline, why


def reference_route(spec: ProblemSpec, forced_pipeline: str | None) -> GemmRoute:
    """What the reference executor runs: the default arch's pipeline, no kernel config."""
    pipeline, why = _pipeline(spec, None, forced_pipeline)
    return GemmRoute(family_of(spec, pipeline), None, "n/a", why)


def choose_route(spec: ProblemSpec, facts: DeviceFacts, interpreted: bool, forced_pipeline: str | None,
                 gluon_switch: bool | None, user_tables: tuple[str, ...]) -> GemmRoute:
    """The Triton executor's route on a GPU of ``facts`` (``interpreted``: Triton's interpreter):
    the pipeline, the portable kernel's config (``user_tables`` and the shipped tuned tables, else
    the heuristic), and the Gluon kernel where ``gluon.implementation`` gives it the problem
    (``gluon_switch``: TILEQ_GLUON's value)."""
    arch = facts.arch
    pipeline, why = _pipeline(spec, arch.name, forced_pipeline)
    check_types(arch, spec.a_type, spec.b_type)
    hit = tuned.lookup(spec, arch, pipeline, facts.name, user_tables)
    if hit is not None:
        cfg, source = hit
    else:
        cfg, source = heuristic_config(spec, arch, pipeline, facts.num_sms), "heuristic"
    impl = implementation(spec, pipeline, arch.name, interpreted, gluon_switch)
    gcfg, tiles_why = None, ""
    if impl.name == "gluon":
        gcfg, tiles_why = choose_tiles(spec, facts.num_sms)
    return GemmRoute(family_of(spec, pipeline), cfg, source, why, impl.name, impl.reason, gcfg, tiles_why)
