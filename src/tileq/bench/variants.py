"""tileq forced onto one kernel or one tiling: the rows of ``tileq bench --impls`` and ``--gluon-tilings``.

The ``tileq`` row times what the plan runs. These rows time the same call with one choice of the
dispatch layer forced, through the same launcher (``kernels.launch.make_launch``, as
``tileq.gemm`` keeps it per call signature), so that the choice can be checked against the data
(``tileq replay``):

  tileq_gluon            ``--impls gluon``: the sm_90 Gluon kernel switched on (as TILEQ_GLUON=1,
                         so also where it is opt-in) with the plan's tiling; N/A where it does not
                         serve the problem or cannot run here
  tileq_triton           ``--impls triton``: the plan forced onto the portable Triton kernel
                         (``dispatch.plan.with_config`` with the plan's own TileConfig)
  tileq_deep             ``--impls deep``: the same with as many pipeline stages as one
                         program's shared memory holds (at most 8; N/A where the plan's are
                         already the most): more K tiles in flight per program
  tileq_gluon:<tiling>   ``--gluon-tilings``: the Gluon kernel with one candidate tiling of its wave
                         model (``dispatch.gluon.tile_costs``: 128, 128+split, 64, 256), as the
                         planner would finish it (``gluon_tilings``); one row per candidate for
                         each problem the kernel serves (one N/A row ``tileq_gluon_tilings`` for
                         the others), the plan's choice marked in the note

Their kind is 'variant': never a baseline, and a failure counts as tileq's (exit status 1). A
prepacked int4 case (B ``i4p``) has its own variants (``int4.py``, ``--int4-variants``): these
rows are N/A for it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import replace

from ..errors import UnsupportedError, expect
from .baselines import Context, Impl, NotApplicable, Runnable
from .cases import Operands
from .gate import poisoned

KIND = "variant"
TILING_PREFIX = "tileq_gluon:"  # + the tiling's name in dispatch.gluon.tile_costs
TILINGS_NA = "tileq_gluon_tilings"  # the one row of a problem the Gluon kernel does not serve


@contextmanager
def gluon_switch(on: bool):
    """TILEQ_GLUON set to 1 / 0 for the plans made inside (restored after)."""
    from ..dispatch.gluon import GLUON_ENV

    saved = os.environ.get(GLUON_ENV)
    os.environ[GLUON_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(GLUON_ENV, None)
        else:
            os.environ[GLUON_ENV] = saved


def _problem(ops: Operands):
    from ..problem import build_problem

    return build_problem(ops.a, ops.b, ops.a_scale, ops.b_scale, **ops.kwargs)


def _plan(problem, ctx: Context, gluon: bool | None = None):
    from ..dispatch.plan import make_plan

    if gluon is None:
        return make_plan(problem.spec, problem.device, backend=ctx.tileq_backend)
    with gluon_switch(gluon):
        return make_plan(problem.spec, problem.device, backend=ctx.tileq_backend)


def _storage(x):
    from ..dtypes import PackedInt4

    return x.data if isinstance(x, PackedInt4) else x


def plan_runnable(ops: Operands, problem, plan, *, note: str, kernel: str) -> Runnable:
    """``plan`` run on the case's operands through its launcher, made once (a repeated call then
    only gathers its tensors and launches, as ``tileq.gemm``'s does). A Gluon plan whose call the
    launcher would hand to the Triton kernel (TMA cannot read the operands) is not applicable."""
    from ..kernels.gluon.launch import GluonLaunch
    from ..kernels.launch import make_launch

    launch = make_launch(problem, plan)
    a, b = _storage(problem.a), _storage(problem.b)
    if plan.route.impl == "gluon" and (not isinstance(launch, GluonLaunch) or (a.data_ptr() | b.data_ptr()) & 15):
        raise NotApplicable("TMA cannot read these operands (rows or base pointers not 16-byte aligned): "
                            "the call would run the Triton kernel")
    args = (a, b, problem.a_scale, problem.b_scale, problem.bias, problem.acc)
    spec = problem.spec

    def gated():
        return launch(*args, poisoned(spec.m, spec.n, spec.out_dtype, problem.device))

    return Runnable(lambda: launch(*args, None), "quantized", ops.bytes, note=note, gated=gated,
                    kernel=kernel)


def gluon_instance(plan, cfg=None) -> str:
    """The instance name of a Gluon plan's kernel (``cfg``: another config of it)."""
    from ..kernels.gluon.config import instance_name

    return instance_name(plan.route.family.name, plan.spec, cfg or plan.route.gluon, plan.arch.tag)


# ----------------------------------------------------------------------------- --impls


def build_gluon(ops: Operands, ctx: Context) -> Runnable:
    problem = _problem(ops)
    plan = _plan(problem, ctx, gluon=True)
    if plan.route.impl != "gluon":
        raise NotApplicable(plan.route.impl_reason)
    return plan_runnable(ops, problem, plan, note=f"TILEQ_GLUON=1; {plan.route.gluon_reason}",
                         kernel=gluon_instance(plan))


def build_triton(ops: Operands, ctx: Context) -> Runnable:
    from ..dispatch.plan import with_config

    problem = _problem(ops)
    plan = _plan(problem, ctx)
    impl, source = plan.route.impl, plan.route.config_source
    forced = with_config(plan, plan.config, source=source)
    note = ("the plan runs the portable kernel itself" if impl == "triton"
            else f"the plan's {impl} kernel replaced by the portable one")
    return plan_runnable(ops, problem, forced, note=f"{note} [{source}]",
                         kernel=forced.instance.name)


DEEP_MOST_STAGES = 8


def deepest_stages(spec, cfg, arch) -> int:
    """The most pipeline stages (at most DEEP_MOST_STAGES) whose tiles fit one program's shared
    memory: K tiles in flight per program, what a grid of fewer programs than SMs streams with."""
    from ..kernels.config import config_problem

    for stages in range(DEEP_MOST_STAGES, cfg.num_stages, -1):
        if config_problem(spec, replace(cfg, num_stages=stages), arch) is None:
            return stages
    return cfg.num_stages


def build_deep(ops: Operands, ctx: Context) -> Runnable:
    from ..dispatch.plan import with_config

    problem = _problem(ops)
    plan = _plan(problem, ctx)
    if plan.config is None:
        raise NotApplicable(f"the {plan.executor} executor runs no tile kernel")
    stages = deepest_stages(plan.spec, plan.config, plan.arch)
    if stages == plan.config.num_stages:
        raise NotApplicable(f"the plan's {stages} stages are already the most that fit")
    source = plan.route.config_source
    forced = with_config(plan, replace(plan.config, num_stages=stages), source=source)
    return plan_runnable(ops, problem, forced, note=f"the plan's portable-kernel config with {stages} stages "
                         f"instead of {plan.config.num_stages} [{source}]", kernel=forced.instance.name)


PREPACKED = "a prepacked int4 weight runs its own kernels (its variants: --int4-variants)"


def _not_prepacked(case, m, n, k):
    return PREPACKED if case.prepacked else None


IMPLS: dict[str, Impl] = {
    "gluon": Impl("tileq_gluon", KIND, "tileq with the sm_90 Gluon kernel switched on (TILEQ_GLUON=1) "
                  "and the plan's tiling", _not_prepacked, build_gluon, default=False),
    "triton": Impl("tileq_triton", KIND, "tileq's plan forced onto the portable Triton kernel "
                   "(dispatch.plan.with_config)", _not_prepacked, build_triton, default=False),
    "deep": Impl("tileq_deep", KIND, "tileq's plan forced onto the portable Triton kernel with as many "
                 "pipeline stages as one program's shared memory holds (at most 8)", _not_prepacked, build_deep,
                 default=False),
}


def select_impls(names: list[str]) -> tuple[Impl, ...]:
    """``--impls``: the variant entries named ('gluon', 'triton', 'deep'), in that order."""
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        raise UnsupportedError(expect("impls", f"names from {', '.join(IMPLS)}", ", ".join(unknown)))
    return tuple(impl for name, impl in IMPLS.items() if name in names)


# ----------------------------------------------------------------------------- --gluon-tilings


def gluon_tilings(spec, num_sms: int) -> dict:
    """{tiling name: (GluonConfig, modelled cost, description)}: every candidate of the wave model
    (``dispatch.gluon.tile_costs``, on the problem as the kernel sees it) finished as
    ``choose_tiles`` finishes its pick (the epilogue preload, the ring's depth, the swap), so
    that the candidate the planner picks is exactly the plan's config."""
    from ..dispatch.gluon import preload_epilogue, swap_for, tile_costs
    from ..kernels.gluon.config import GluonConfig, kernel_spec, max_stages

    swapped = swap_for(spec)
    kspec = kernel_spec(spec, GluonConfig(swap_ab=True)) if swapped else spec
    out = {}
    for name, (cost, cfg, text) in tile_costs(kspec, num_sms, swapped).items():
        if preload_epilogue(kspec, cfg):
            cfg = replace(cfg, epi_preload=True)
        cfg = replace(cfg, stages=max_stages(cfg, kspec.out_dtype), swap_ab=swapped)
        out[name] = (cfg, cost, text)
    return out


def tiling_name(spec, cfg, num_sms: int) -> str | None:
    """The wave model's name of the tiling ``cfg`` runs (None: no candidate is that config)."""
    return next((name for name, (c, _, _) in gluon_tilings(spec, num_sms).items() if c == cfg), None)


def _unreachable(ops, ctx):
    raise RuntimeError("an N/A entry is never built")


def tiling_impls(ops: Operands, ctx: Context) -> tuple[Impl, ...]:
    """``--gluon-tilings``: one entry per candidate tiling for this case's operands (N/A with the
    plan's reason where the kernel serves the problem but cannot run here, e.g. without a GPU),
    or a single N/A entry where the Gluon kernel does not serve it."""
    from ..device import facts
    from ..dispatch import thresholds
    from ..dispatch.gluon import GLUON_ARCH, choose_tiles, gluon_serves

    if ops.case.prepacked:
        return (Impl(TILINGS_NA, KIND, "the Gluon kernel's tilings", lambda *_: PREPACKED, _unreachable),)
    problem = _problem(ops)
    plan = _plan(problem, ctx, gluon=True)
    spec = problem.spec
    here = None
    if plan.route.impl != "gluon":
        if plan.executor != "triton":
            why = f"the {plan.executor} executor runs no Gluon kernel"
        else:
            why = gluon_serves(spec, plan.route.pipeline, thresholds.for_arch(GLUON_ARCH).DECODE_MAX_M)
        if why:
            return (Impl(TILINGS_NA, KIND, "the Gluon kernel's tilings", lambda *_: why, _unreachable),)
        here = plan.route.impl_reason  # served, but not here (no GPU, another arch, another Triton)
    num_sms = facts(problem.device).num_sms
    chosen = tiling_name(spec, choose_tiles(spec, num_sms)[0], num_sms)
    impls = []
    for name, (cfg, cost, text) in gluon_tilings(spec, num_sms).items():
        note = f"{text}; modelled cost {cost:.0f} K steps" + ("; the plan's choice" if name == chosen else "")

        def build(ops, ctx, cfg=cfg, note=note):
            forced = replace(plan, route=replace(plan.route, gluon=cfg,
                                                 gluon_reason="forced tiling (tileq bench --gluon-tilings)"))
            return plan_runnable(ops, problem, forced, note=note, kernel=gluon_instance(forced))

        impls.append(Impl(TILING_PREFIX + name, KIND, f"the Gluon kernel with the {name} tiling",
                          lambda *_, why=here: why, build, default=False))
    return tuple(impls)
