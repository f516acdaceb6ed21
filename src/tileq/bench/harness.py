"""The sweep: shape by shape, each case's implementations gated, then timed back to back.

For every (shape, case): operands are built (weights quantized once per (case, N, K) and reused
across M), tileq's reference output is computed once, then each implementation of the registry
runs in order: N/A with a reason, or gated (tileq into a NaN-poisoned ``out=``); then, when a GPU
is present, the gated ones are timed in turn. tileq and its baselines are thus interleaved shape
by shape, so slow drift of clocks or temperature affects both sides of each ratio alike; with
``rounds`` > 1 each one's runs are split into rounds, every implementation timed once per round
(the time: the median of the rounds' medians), which interleaves them within a shape too.

``variants`` (``--impls``) and ``gluon_tilings`` (``--gluon-tilings``) add tileq forced onto one
kernel or one Gluon tiling (``variants.py``), and ``int4_variants`` (``--int4-variants``) a
prepacked int4 call forced onto one path, decode config or prefill tiling (``int4.py``), after the
registry's entries.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace

import torch

from . import results as R
from .baselines import Context, Impl, NotApplicable, Runnable
from .cases import (
    Case, Operands, WeightSide, build_operands, draw_activation, draw_weight, quantize_weight_side,
)
from .gate import gate, sqnr_db
from .int4 import NA_NAME as INT4_NA
from .int4 import int4_impls
from .progress import Progress
from .suites import Shape
from .timing import Ceilings, Timer, Timing, TimingConfig, combine_rounds, environment, measure_ceilings
from .variants import KIND as VARIANT
from .variants import TILINGS_NA, tiling_impls


@dataclass
class SweepConfig:
    shapes: list[Shape]
    cases: tuple[Case, ...]  # for shapes whose suite row names none
    impls: tuple[Impl, ...]
    device: torch.device
    timing: TimingConfig = field(default_factory=TimingConfig)
    seed: int = 0
    time_budget_s: float | None = None
    progress: bool = True
    ceilings: bool = True
    title: str = "bench"
    precompile_jobs: int | None = None  # CUDA: None = CPUs - 1 processes, 0 = compile inline
    variants: tuple[Impl, ...] = ()  # tileq forced onto one kernel (variants.IMPLS), after impls
    gluon_tilings: bool = False  # also every candidate tiling of the Gluon kernel (variants.py)
    int4_variants: bool = False  # also prepacked int4 calls forced onto each path / config (int4.py)
    rounds: int = 1  # timing rounds per (shape, case), implementations in turn in each


@dataclass
class Sweep:
    rows: list[R.Result]
    env: dict
    ceilings: Ceilings | None
    method: str
    elapsed_s: float
    operands: str = (
        "seeded bf16 activations X [M, K] ~ N(0, 1) and weights W [N, K] ~ N(0, 1/K), drawn on "
        "the device and quantized with tileq.quant at each scheme's canonical granularity "
        "(tensor: per-tensor; rowcol: per-row x per-column; aquant: 1x128 groups x one weight "
        "scale; bquant: per-row x 128x1 groups; abquant: 1x128 x 128x128); weights quantized once "
        "per (case, N, K); prepacked int4 cases (B i4p): the same int4 weight prepacked once "
        "(tileq.prepack_int4) and run by tileq.linear"
    )


def _short(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tileq_kernel(ops: Operands, backend: str) -> str:
    from ..dispatch.plan import make_plan
    from ..problem import build_problem

    try:
        if ops.case.prepacked:
            from .int4 import call_plan, plan_kernel

            return plan_kernel(call_plan(ops))
        problem = build_problem(ops.a, ops.b, ops.a_scale, ops.b_scale, **ops.kwargs)
        p = make_plan(problem.spec, problem.device, backend=backend)
    except Exception as e:  # the gated run reports the same error with its context
        return f"(no plan: {_short(e, 120)})"
    inst = p.instance
    return inst.name if inst is not None else p.route.family.name


class _ShapeState:
    """Tensors shared by the cases of one shape, and weights shared across M."""

    def __init__(self, device, seed):
        self.device, self.seed = device, seed
        self.nk = None
        self.weights: dict = {}
        self.w: torch.Tensor | None = None
        self.mk = None
        self.x: torch.Tensor | None = None
        self.float_product: torch.Tensor | None = None
        self.shape_id = None
        self.shared: dict = {}  # impl name -> Result measured once per shape

    def enter(self, shape: Shape):
        if self.nk != (shape.n, shape.k):
            self.nk = (shape.n, shape.k)
            self.weights.clear()
            self.w = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if self.mk != (shape.m, shape.n, shape.k):
            self.mk = (shape.m, shape.n, shape.k)
            self.x = None
            self.float_product = None
        if self.shape_id != (shape.suite, shape.name, shape.m, shape.n, shape.k):
            self.shape_id = (shape.suite, shape.name, shape.m, shape.n, shape.k)
            self.shared.clear()  # shared rows carry the shape's name: never reuse across rows

    def weight(self, case: Case, n: int, k: int) -> WeightSide:
        if self.w is None:
            self.w = draw_weight(n, k, self.seed, self.device)
        if case not in self.weights:
            self.weights[case] = quantize_weight_side(case, self.w)
        return self.weights[case]

    def activation(self, m: int, k: int) -> torch.Tensor:
        if self.x is None:
            self.x = draw_activation(m, k, self.seed, self.device)
        return self.x

    def product(self) -> torch.Tensor:
        """X @ W.t() in fp32 from the bf16 originals: the unquantized result."""
        if self.float_product is None:
            self.float_product = self.x.float() @ self.w.float().t()
        return self.float_product


def _raw_product(ops: Operands) -> torch.Tensor:
    from ..reference import dense_float64

    return dense_float64(ops.a) @ dense_float64(ops.b)  # exact for int8 / int4 values


class _Runner:
    def __init__(self, cfg: SweepConfig):
        self.cfg = cfg
        dev = cfg.device
        self.ctx = Context(dev, "triton")
        # --rounds: each measurement's runs split between the rounds
        per_round = replace(cfg.timing, runs=max(1, cfg.timing.runs // max(1, cfg.rounds)))
        self.timer = Timer(dev, per_round) if dev.type == "cuda" else None
        self.broken: str | None = None  # set when the CUDA context failed: nothing runs after

    def row(self, shape: Shape, case: Case, impl: Impl, status: str, **kw) -> R.Result:
        return R.Result(
            suite=shape.suite, shape=shape.name, m=shape.m, n=shape.n, k=shape.k, case=case.name,
            scheme=case.scheme.value, dtypes=case.dtypes, layout=case.layout, impl=impl.name,
            kind=impl.kind, status=status, **kw,
        )

    def _note_cuda_failure(self, e: BaseException) -> None:
        text = str(e)
        if self.cfg.device.type == "cuda" and ("CUDA error" in text or "illegal memory" in text):
            self.broken = _short(e, 200)

    def prepare(self, shape: Shape, case: Case, impl: Impl, ops: Operands, expected: dict,
                state: _ShapeState) -> R.Result | _Pending:
        """N/A, reused (shared), failed or not timed: the row; else the gated runnable, pending."""
        why = impl.unavailable(case, shape.m, shape.n, shape.k, self.cfg.device)
        if why:
            return self.row(shape, case, impl, R.NA, note=why)
        if impl.shared and impl.name in state.shared:
            first = state.shared[impl.name]
            return replace(first, case=case.name, scheme=case.scheme.value, dtypes=case.dtypes,
                           layout=case.layout, note=(first.note + "; " if first.note else "")
                           + "measured once per shape (does not depend on the case)")
        kernel = _tileq_kernel(ops, self.ctx.tileq_backend) if impl.kind == "tileq" else ""
        try:
            run: Runnable = impl.build(ops, self.ctx)
            out = (run.gated or run.fn)()
        except NotApplicable as e:
            return self.row(shape, case, impl, R.NA, note=str(e))
        except Exception as e:  # reported in the row; the sweep goes on
            self._note_cuda_failure(e)
            return self.row(shape, case, impl, R.ERROR, kernel=kernel, note=_short(e))
        kernel = run.kernel or kernel
        want = expected[run.expected]()
        g = gate(out, want)
        sq = sqnr_db(out, state.product()) if run.expected != "raw" and g.ok else None
        common = dict(kernel=kernel, rel_err=g.rel_err, sqnr_db=sq, bytes=run.bytes)
        if not g.ok:
            return self.row(shape, case, impl, R.FAIL, **common, note=g.reason)
        del out
        if self.timer is None:
            return self.row(shape, case, impl, R.NOT_MEASURED, **common, note=run.note)
        return _Pending(impl, run, common, ops.flops)

    def time_pending(self, shape: Shape, case: Case, pending: list[_Pending]) -> dict:
        """{impl name: row} of the gated implementations, timed in turn over the rounds."""
        rows = {}
        for _ in range(self.cfg.rounds):
            for p in pending:
                if p.impl.name in rows:
                    continue  # failed in an earlier round
                try:
                    p.timings.append(self.timer.measure(p.run.fn))
                except Exception as e:
                    self._note_cuda_failure(e)
                    rows[p.impl.name] = self.row(shape, case, p.impl, R.ERROR, **p.common,
                                                 note="timing: " + _short(e))
        for p in pending:
            if p.impl.name not in rows:
                rows[p.impl.name] = self._timed_row(shape, case, p, combine_rounds(p.timings))
        return rows

    def _timed_row(self, shape, case, p: _Pending, t: Timing) -> R.Result:
        sec = t.median_ms * 1e-3
        note = "; ".join(x for x in (p.run.note, t.note) if x)
        return self.row(shape, case, p.impl, R.OK, **p.common, time_ms=t.median_ms,
                        time_min_ms=t.min_ms, runs=t.runs, tflops=p.flops / sec / 1e12,
                        tbps=p.run.bytes / sec / 1e12, note=note)


@dataclass
class _Pending:
    """A gated implementation waiting to be timed."""

    impl: Impl
    run: Runnable
    common: dict
    flops: int
    timings: list = field(default_factory=list)


def run_sweep(cfg: SweepConfig) -> Sweep:
    t_start = time.monotonic()
    runner = _Runner(cfg)
    env = environment(cfg.device)
    ceilings = None
    if cfg.device.type == "cuda" and cfg.ceilings:
        ceilings = measure_ceilings(cfg.device)
    method = runner.timer.describe() if runner.timer else "correctness only (no GPU): not timed"
    if runner.timer and cfg.rounds > 1:
        method += (f"; repeated in {cfg.rounds} rounds, every implementation of a (shape, case) "
                   "measured once per round in turn, its time the median of its rounds' medians")

    items = [(s, c) for s in cfg.shapes for c in s.cases_to_run(cfg.cases)]
    if cfg.device.type == "cuda" and cfg.precompile_jobs != 0:
        from .precompile import precompile

        try:
            done = precompile(items, cfg.device, cfg.precompile_jobs)
        except Exception as e:  # said aloud; the sweep then compiles each kernel on first use
            done = f"precompilation failed ({_short(e, 200)}): kernels compiled inside the sweep"
        print(done, file=sys.stderr)
        method += f"; {done} before the sweep (compile time is not in any timing)"
    progress = Progress(len(items), title=cfg.title, enabled=cfg.progress)
    state = _ShapeState(cfg.device, cfg.seed)
    rows: list[R.Result] = []
    tileq_impl = next(i for i in cfg.impls if i.name == "tileq")
    for shape, case in items:
        label = f"{shape.name} M={shape.m} {case.name}"
        elapsed = time.monotonic() - t_start
        if runner.broken:
            rows.append(runner.row(shape, case, tileq_impl, R.ERROR,
                                   note=f"not run: the CUDA context failed earlier ({runner.broken})"))
        elif cfg.time_budget_s is not None and elapsed > cfg.time_budget_s:
            rows.append(runner.row(shape, case, tileq_impl, R.SKIPPED,
                                   note=f"time budget of {cfg.time_budget_s:.0f} s reached"))
        else:
            rows.extend(_run_item(runner, state, shape, case))
        progress.advance(label)
    progress.close()
    return Sweep(rows, env, ceilings, method, time.monotonic() - t_start)


def _run_item(runner: _Runner, state: _ShapeState, shape: Shape, case: Case) -> list[R.Result]:
    cfg = runner.cfg
    impls = cfg.impls + cfg.variants
    why = case.unsupported_reason(shape.m, shape.n, shape.k)
    if why:
        return [runner.row(shape, case, impl, R.NA, note="case: " + why) for impl in impls]
    state.enter(shape)
    try:
        weight = state.weight(case, shape.n, shape.k)
        ops = build_operands(case, state.activation(shape.m, shape.k), weight)
        reference = ops.gemm(backend="reference")
    except Exception as e:
        runner._note_cuda_failure(e)
        return [runner.row(shape, case, impl, R.ERROR, note="operands/reference: " + _short(e))
                for impl in impls]
    if cfg.gluon_tilings:
        try:
            impls += tiling_impls(ops, runner.ctx)
        except Exception as e:  # the problem's plan failed: the tileq row reports it too
            impls += (Impl(TILINGS_NA, VARIANT, "the Gluon kernel's tilings", lambda *_: None,
                           _raise(e)),)
    if cfg.int4_variants:
        try:
            impls += int4_impls(ops, runner.ctx)
        except Exception as e:  # the call's plan failed: the tileq row reports it too
            impls += (Impl(INT4_NA, VARIANT, "prepacked int4 variants", lambda *_: None, _raise(e)),)
    expected = {
        "quantized": lambda: reference,
        "float": state.product,
        "raw": lambda: _raw_product(ops),
    }
    rows, pending = [], []
    for impl in impls:
        r = runner.prepare(shape, case, impl, ops, expected, state)
        rows.append(r)
        if isinstance(r, _Pending):
            pending.append(r)
    if pending:
        timed = runner.time_pending(shape, case, pending)
        rows = [timed[r.impl.name] if isinstance(r, _Pending) else r for r in rows]
    for impl, r in zip(impls, rows):  # a shared entry's row serves the shape's other cases
        if impl.shared and impl.name not in state.shared and r.status != R.NA:
            state.shared[impl.name] = r
    return rows


def _raise(e: BaseException):
    def build(ops, ctx):
        raise e

    return build


def tileq_failures(rows: list[R.Result]) -> list[R.Result]:
    """tileq rows (its plan's and its forced variants') that failed the gate or raised: what makes
    ``bench`` / ``demo`` exit non-zero."""
    return [r for r in rows if (r.impl == "tileq" or r.kind == VARIANT) and r.status in (R.FAIL, R.ERROR)]

