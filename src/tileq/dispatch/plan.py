"""The plan: which executor, pipeline, kernel instance and config run a ProblemSpec, and the
lowering as tile stages. One plan, two executors: the Triton kernel is specialized on it and the
torch reference interprets the same problem, so ``tileq explain`` shows what either would do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from .. import device as _device
from .. import settings as _settings
from ..catalog.names import KernelFamily, KernelInstance
from ..device import ARCHS, ArchInfo, check_types
from ..dtypes import compute_type, mma_types
from ..errors import UnsupportedError, expect
from ..kernels.config import TileConfig, config_problem
from ..kernels.gluon.config import accumulation, instance_name
from ..kernels.launch import launch_gemm
from ..kernels.select import kernel_notes
from ..problem import Problem, ProblemSpec, ScaleKind
from ..reference import gemm_ref
from . import thresholds, tuned
from .gluon import choose_tiles, implementation
from .heuristic import choose_pipeline, heuristic_config

BACKENDS = _settings.BACKENDS

_DTYPE_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "f32", torch.int32: "i32"}


def resolve_backend(backend: str | None, device: torch.device) -> tuple[str, bool]:
    """(executor, interpreted) for a requested backend and the operands' device."""
    env = _settings.current()
    requested = env.backend if backend is None else _settings.parse_backend(str(backend), "backend")
    if requested == "reference":
        return "reference", False
    if device.type == "cuda":
        return "triton", env.interpreted
    if requested == "auto":
        return "reference", False
    if device.type == "cpu" and env.interpreted:
        return "triton", True
    raise UnsupportedError(
        expect(
            "backend",
            "CUDA tensors for 'triton', or CPU tensors with TRITON_INTERPRET=1 set before tileq and "
            "triton are imported (Triton's interpreter)",
            f"'triton' on {device.type} tensors without TRITON_INTERPRET=1",
        )
    )


def deterministic_requested(flag: bool | None) -> bool:
    if flag is not None:
        return bool(flag)
    return _settings.current().deterministic


@dataclass(frozen=True)
class Plan:
    spec: ProblemSpec
    executor: str  # 'triton' | 'reference'
    interpreted: bool
    arch: ArchInfo | None
    family: KernelFamily
    config: TileConfig | None
    config_source: str  # 'heuristic' | 'table: <file>' | 'n/a'
    deterministic: bool
    pipeline_reason: str = ""
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
        return self.executor == "triton" and self.config is not None and sums_in_kernel(self.pipeline, self.config)

    @property
    def instance(self) -> KernelInstance | None:
        if self.config is None or self.arch is None:
            return None
        return KernelInstance(self.family, self.config, self.arch.name)

    def stages(self) -> list[str]:
        return lowering(self.spec)

    def describe(self) -> str:
        s = self.spec
        where = self.executor + (" (Triton interpreter)" if self.interpreted else "")
        lines = [
            f"problem   : {s.scheme} {s.a_type}x{s.b_type} {s.layout}  M={s.m} N={s.n} K={s.k}"
            + (f"  group_k={s.group_k} group_n={s.group_n}" if s.scheme.grouped else ""),
            f"executor  : {where}",
            f"pipeline  : {self.pipeline} ({self.pipeline_reason})",
            f"family    : {self.family.name}",
        ]
        if self.executor == "triton":
            lines.append(f"impl      : {self.impl} ({self.impl_reason})")
        if self.gluon is not None:
            lines.append(f"gluon     : {instance_name(self.family.name, s, self.gluon, self.arch.tag)}")
            lines.append(f"            {self.gluon.describe(accumulation(s))}")
            if self.gluon_reason:
                lines.append(f"            {self.gluon_reason}")
        if self.instance is not None:
            fallback = " (the Triton fallback)" if self.gluon is not None else ""
            lines.append(f"instance  : {self.instance.name}{fallback}")
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
        lines.append("lowering  : " + " -> ".join(self.stages()))
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


@lru_cache(maxsize=4096)
def _plan_cached(spec: ProblemSpec, executor: str, interpreted: bool, arch_name: str | None,
                 num_sms: int, deterministic: bool, forced_pipeline: str | None = None,
                 device_name: str | None = None, gluon_switch: bool | None = None) -> Plan:
    decode_max_m = thresholds.for_arch(arch_name).DECODE_MAX_M
    pipeline = forced_pipeline or choose_pipeline(spec, decode_max_m)
    if forced_pipeline:
        why = "forced by the caller"
    else:
        why = f"logical M={spec.m} {'<=' if spec.m <= decode_max_m else '>'} {decode_max_m}"
        if pipeline == "preshufflequant":
            why += ", a_scale preshuffled"
    family = family_of(spec, pipeline)
    if executor == "reference":
        return Plan(spec, executor, False, None, family, None, "n/a", deterministic, why)
    arch = ARCHS[arch_name]
    check_types(arch, spec.a_type, spec.b_type)
    hit = tuned.lookup(spec, arch, pipeline, device_name)
    if hit is not None:
        cfg, source = hit
    else:
        cfg, source = heuristic_config(spec, arch, pipeline, num_sms), "heuristic"
    impl = implementation(spec, pipeline, arch.name, interpreted, gluon_switch)
    gcfg, tiles_why = None, ""
    if impl.name == "gluon":
        gcfg, tiles_why = choose_tiles(spec, num_sms)
    return Plan(spec, executor, interpreted, arch, family, cfg, source, deterministic, why,
                impl.name, impl.reason, gcfg, tiles_why)


def _check_pipeline(pipeline: str | None, spec: ProblemSpec) -> str | None:
    if pipeline is None:
        return None
    allowed = ["prefill", "decode"]
    if spec.scheme.a_grouped and spec.a_scale_layout.value == "preshuffled":
        allowed.append("preshufflequant")
    if pipeline not in allowed:
        raise UnsupportedError(expect("pipeline", f"None or one of {', '.join(allowed)}", repr(pipeline)))
    return pipeline


def make_plan(spec: ProblemSpec, device: torch.device, *, backend=None, deterministic=None,
              arch: str | None = None, pipeline: str | None = None) -> Plan:
    """Plan a problem for tensors on ``device`` (or, with ``arch``, for a described problem)."""
    forced = _check_pipeline(pipeline, spec)
    executor, interpreted = resolve_backend(backend, device)
    det = deterministic_requested(deterministic)
    arch_name, sms, device_name = None, 0, None
    if executor == "triton":
        # A named arch plans with its typical SM count; the interpreter has no arch and runs the
        # default arch's plan (the reference target).
        facts = (_device.for_arch(arch) if arch is not None
                 else _device.facts(device if not interpreted else torch.device("cpu")))
        arch_name, sms, device_name = facts.arch.name, facts.num_sms, facts.name
    gluon = _settings.current().gluon if executor == "triton" else None
    return _plan_cached(spec, executor, interpreted, arch_name, sms, det, forced, device_name, gluon)


def with_config(plan: Plan, cfg: TileConfig, source: str = "forced") -> Plan:
    """The same plan running ``cfg`` instead (tuner, experiments); the legality predicate rules."""
    if plan.executor != "triton":
        raise UnsupportedError(expect("config", "a plan for the 'triton' executor", plan.executor))
    why = config_problem(plan.spec, cfg, plan.arch)
    if why is not None:
        raise UnsupportedError(expect("config", f"a legal config for {plan.arch.name}", why))
    # A forced TileConfig is the Triton kernel's: the plan runs that kernel (tuner, experiments).
    impl_reason = "a forced config of the portable kernel" if plan.impl != "triton" else plan.impl_reason
    return replace(plan, config=cfg, config_source=source, impl="triton", impl_reason=impl_reason,
                   gluon=None)


def execute(plan: Plan, problem: Problem) -> torch.Tensor:
    spec = plan.spec
    if spec.m == 0 or spec.n == 0:
        # Nothing to compute: no launch. An empty out= is returned as is.
        if problem.out is not None:
            return problem.out
        return torch.empty(spec.m, spec.n, dtype=spec.out_dtype, device=problem.device)
    if plan.executor == "reference":
        return gemm_ref(problem)
    return launch_gemm(problem, plan)
