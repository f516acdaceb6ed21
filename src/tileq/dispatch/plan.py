"""The plan of a call, for every kind of problem: ``make_plan`` is the one entry point and
``Plan`` the one type, the differences between the kinds held as data (``variant``, ``route``).

- 'gemm': an 8-bit or pk_int4 GEMM (a ``problem.ProblemSpec``; ``gemm.GemmRoute``: pipeline,
  portable-kernel config, Gluon kernel and tiles);
- 'prepacked': ``tileq.linear`` on a prepacked int4 weight (a ``kernels.int4p.spec.PrepackedSpec``;
  ``prepacked.PrepackedRoute``: path, kernel, decode config or prefill tiling);
- 'grouped': ``tileq.grouped_linear`` (a ``kernels.grouped.spec.GroupedSpec``;
  ``grouped.GroupedRoute``: tile config).

The launchers run a plan and decide nothing; ``tileq explain`` prints ``Plan.describe()``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from .. import device as _device
from .. import settings as _settings
from ..catalog.names import KernelInstance
from ..device import ArchInfo, DeviceFacts
from ..errors import TileqError, UnsupportedError, expect
from ..kernels.config import TileConfig, config_problem
from ..kernels.grouped.spec import GroupedConfig, GroupedSpec
from ..kernels.int4p.config import Int4pConfig
from ..kernels.int4p.spec import PrepackedSpec
from ..kernels.launch import launch_gemm
from ..problem import Problem, ProblemSpec
from ..reference import gemm_ref
from . import gemm, grouped, prepacked
from .pdl import pdl_enabled


@dataclass(frozen=True)
class Plan:
    """What runs one call, and why (the module docstring lists the variants)."""

    variant: str  # 'gemm' | 'prepacked' | 'grouped'
    spec: ProblemSpec | PrepackedSpec | GroupedSpec
    executor: str  # 'triton' | 'reference'
    interpreted: bool  # Triton's interpreter runs the kernels
    facts: DeviceFacts | None  # the GPU (or arch) planned for; None: the reference executor
    route: gemm.GemmRoute | prepacked.PrepackedRoute | grouped.GroupedRoute
    # Whether its PDL-aware kernels (gemm, prepacked) launch with programmatic dependent launch
    # (``dispatch.pdl``).
    pdl: bool = False

    @property
    def arch(self) -> ArchInfo | None:
        return self.facts.arch if self.facts is not None else None

    @property
    def config(self) -> TileConfig | Int4pConfig | GroupedConfig | None:
        """The kernel config the route runs: every route has one (None: the reference executor,
        a prepacked path other than the decode kernel)."""
        return self.route.config

    @property
    def instance(self) -> KernelInstance | None:
        """The catalog's instance of the portable kernel a gemm plan runs (None: the reference
        executor; the prepacked and grouped kernels are named by their routes)."""
        if self.variant != "gemm" or self.config is None:
            return None
        return KernelInstance(self.route.family, self.config, self.arch.name)

    def describe(self) -> str:
        return self.route.describe(self)


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


def make_plan(spec: ProblemSpec | PrepackedSpec | GroupedSpec, device: torch.device, *, backend=None,
              arch: str | None = None, num_sms: int | None = None, pipeline: str | None = None,
              config: Int4pConfig | None = None, traced: bool = False) -> Plan:
    """The plan of a call on tensors of ``device``; with ``arch``, of a call described for a GPU of
    that arch (``num_sms``: its SM count, default the arch's typical one).

    ``backend`` (gemm, grouped): 'auto', 'triton' or 'reference' (None: ``TILEQ_BACKEND``).
    ``pipeline`` (gemm): 'prefill' or 'decode' forced. ``config`` (prepacked): a decode config
    the decode kernel runs; ``traced`` (prepacked): the launch is traced into a torch.compile
    graph. A described prepacked call plans with the default switches, compiled."""
    if num_sms is not None and arch is None:
        raise UnsupportedError(expect("num_sms", "None without arch (a device's facts are its own)", num_sms))
    if isinstance(spec, ProblemSpec):
        _refuse("an 8-bit or pk_int4 GEMM", config=config, traced=traced)
        return _gemm_plan(spec, device, backend, arch, num_sms, pipeline)
    if isinstance(spec, PrepackedSpec):
        _refuse("a prepacked int4 weight", backend=backend, pipeline=pipeline)
        return _prepacked_plan(spec, device, arch, num_sms, config, traced)
    if isinstance(spec, GroupedSpec):
        _refuse("a grouped GEMM", pipeline=pipeline, config=config, traced=traced)
        return _grouped_plan(spec, device, backend, arch, num_sms)
    raise TypeError(f"make_plan: a ProblemSpec, PrepackedSpec or GroupedSpec, not {type(spec).__name__}")


def _refuse(what: str, **options) -> None:
    """Options the variant has no meaning for are refused, never ignored."""
    given = [name for name, value in options.items() if value not in (None, False)]
    if given:
        raise UnsupportedError(expect(", ".join(given), f"none for {what} (its plan has no such option)",
                                      ", ".join(f"{n}={options[n]!r}" for n in given)))


def _facts(device: torch.device, arch: str | None, num_sms: int | None) -> DeviceFacts:
    """The device's facts, or the named arch's (its typical SM count unless ``num_sms``)."""
    if arch is None:
        return _device.facts(device)
    facts = _device.for_arch(arch)
    return facts if num_sms is None else replace(facts, num_sms=num_sms)


# ----------------------------------------------------------------------------- gemm


def _gemm_plan(spec, device, backend, arch, num_sms, pipeline) -> Plan:
    forced = gemm.check_pipeline(pipeline, spec)
    executor, interpreted = resolve_backend(backend, device)
    if executor == "reference":
        return _gemm_cached(spec, executor, False, None, forced, None, (), False)
    # The interpreter has no arch and runs the default arch's plan (the reference target).
    facts = _facts(device if not interpreted else torch.device("cpu"), arch, num_sms)
    env = _settings.current()
    pdl = pdl_enabled(device, interpreted, facts.arch)
    return _gemm_cached(spec, executor, interpreted, facts, forced, env.gluon, env.tuned_tables, pdl)


@lru_cache(maxsize=4096)
def _gemm_cached(spec: ProblemSpec, executor: str, interpreted: bool, facts: DeviceFacts | None,
                 forced_pipeline: str | None, gluon_switch: bool | None, user_tables: tuple[str, ...],
                 pdl: bool) -> Plan:
    """Plans per (spec, executor, device facts, switches): every argument is one the plan reads."""
    if executor == "reference":
        return Plan("gemm", spec, executor, False, None, gemm.reference_route(spec, forced_pipeline))
    route = gemm.choose_route(spec, facts, interpreted, forced_pipeline, gluon_switch, user_tables)
    return Plan("gemm", spec, executor, interpreted, facts, route, pdl)


def with_config(plan: Plan, cfg: TileConfig, source: str = "forced") -> Plan:
    """The same gemm plan running ``cfg`` instead (tuner, experiments); the legality predicate rules."""
    if plan.variant != "gemm" or plan.executor != "triton":
        raise UnsupportedError(expect("config", "a gemm plan for the 'triton' executor",
                                      f"a {plan.variant} plan for '{plan.executor}'"))
    why = config_problem(plan.spec, cfg, plan.arch)
    if why is not None:
        raise UnsupportedError(expect("config", f"a legal config for {plan.arch.name}", why))
    # A forced TileConfig is the Triton kernel's: the plan runs that kernel (tuner, experiments).
    r = plan.route
    impl_reason = "a forced config of the portable kernel" if r.impl != "triton" else r.impl_reason
    return replace(plan, route=replace(r, config=cfg, config_source=source, impl="triton", impl_reason=impl_reason,
                                       gluon=None))


def execute(plan: Plan, problem: Problem) -> torch.Tensor:
    """Run a gemm plan on ``problem``'s tensors."""
    spec = plan.spec
    if spec.m == 0 or spec.n == 0:
        # Nothing to compute: no launch. An empty out= is returned as is.
        if problem.out is not None:
            return problem.out
        return torch.empty(spec.m, spec.n, dtype=spec.out_dtype, device=problem.device)
    if plan.executor == "reference":
        return gemm_ref(problem)
    return launch_gemm(problem, plan)


# ----------------------------------------------------------------------------- prepacked


def _prepacked_plan(spec, device, arch, num_sms, config, traced) -> Plan:
    """The Triton kernels' plan (the reference executor runs the unprepacked weight: ``tileq.linear``)."""
    described = arch is not None
    facts = _facts(device, arch, num_sms)
    route = prepacked.choose_route(spec, facts, given=config, device=None if described else device, traced=traced)
    if route.path == "fp8-gemm":
        inner_device = torch.device("cuda") if described else device
        try:
            inner, error = make_plan(prepacked.inner_spec(spec), inner_device, arch=arch, num_sms=num_sms), None
        except TileqError as e:  # the call raises it when it runs; a description does not
            inner, error = None, e
        route = replace(route, inner=inner, inner_error=error)
    interpreted = not described and _settings.current().interpreted
    return Plan("prepacked", spec, "triton", interpreted, facts, route, pdl_enabled(device, interpreted, facts.arch))


# ----------------------------------------------------------------------------- grouped


def _grouped_plan(spec, device, backend, arch, num_sms) -> Plan:
    executor, interpreted = resolve_backend(backend, device)
    if arch is not None:  # a described call: the kernels' plan for that arch
        executor, interpreted = "triton", False
    if executor == "reference":
        return Plan("grouped", spec, executor, False, None, grouped.REFERENCE_ROUTE)
    facts = _facts(device if not interpreted else torch.device("cpu"), arch, num_sms)
    cfg, why = grouped.choose_config(spec, facts.arch.name)
    return Plan("grouped", spec, executor, interpreted, facts, grouped.GroupedRoute(cfg, why))
