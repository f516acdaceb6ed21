"""``tileq replay``: a dispatch rule replayed on measured timings, so that a changed threshold is
checked against the data before it ships (no GPU needed).

A results CSV (``tileq bench``'s results.csv) holds, per problem, timed variants of one decision:
rows whose implementation is ``Rule.prefix`` + the variant's name (``tileq bench
--gluon-tilings`` writes ``tileq_gluon:128``, ``tileq_gluon:128+split``, ...). For each problem
the rule asks the dispatch layer which variant it would pick, through the real dispatch
functions (never a copy of their logic); the report gives per case and M range how many problems
were replayed, the chosen variant's time over the fastest timed variant's (median, worst, how
many beyond the tolerance) and the best baseline of the same run against the chosen and the
fastest variant. ``--threshold NAME=VALUE`` replays again with entries of
``tileq.dispatch.thresholds`` changed and reports both, with the problems whose choice changed.

Adding a rule is one function from a problem to the dispatch layer's choice::

    @rule("int4-decode", prefix="tileq_int4:", help="the int4 decode kernel's config ...")
    def int4_decode(p: Problem) -> Choice | None:
        plan = <dispatch.plan.make_plan for the problem's call>
        return Choice(variant_name(plan), among=<the decode variants>, why=plan.route.reason)

``Problem`` carries the CSV's key (suite, shape, M, N, K, case), the problem's ``spec``, the SM
count of the run and the timed variants; ``Choice.variant`` names the variant picked (None: the
dispatch layer picks none of the rule's variants, e.g. another path), ``Choice.among`` (optional)
the variants the rule chooses between (the others timed for the problem stay out of its fastest),
``Choice.config`` (optional) what the measured row's kernel column must name for the time to
stand for the choice (a changed threshold can change the config behind a variant's name: such a
problem counts as not measured). A rule returns None for a problem that is not its own (another
kind of case; decided without reading a threshold).

Rules: ``gluon-tiles`` (the 8-bit Gluon kernel's wave model, rows of ``--gluon-tilings``) and, on
the rows of ``--int4-variants`` (``int4.py``), ``int4-decode`` (the decode kernel's config),
``int4-prefill`` (the path and tiling from INT4_PREFILL_MIN_M), ``int4-streamk`` (W4A16 stream-K)
and ``int4-w4a8`` (W4A8's route). ``--write-table`` with ``int4-decode`` writes the tuned decode
table (``dispatch/data/tuned_int4_sm90.json``'s format) from the data (``write_tuned_table``).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from ..errors import ShapeError, UnsupportedError, expect
from . import results as R
from .report import best_baseline, m_range

TOLERANCE = 0.03


# ----------------------------------------------------------------------------- the data


@dataclass
class Problem:
    """One problem of the CSV and its timed variants."""

    suite: str
    shape: str
    m: int
    n: int
    k: int
    case: str
    num_sms: int  # of the GPU that ran it (the CSV's env.json, else --sms)
    times: dict = field(default_factory=dict)  # variant -> ms
    kernels: dict = field(default_factory=dict)  # variant -> the row's kernel column
    baseline: tuple | None = None  # (name, ms) of the best same-math baseline of the run

    @property
    def spec(self):
        """The ProblemSpec ``tileq bench`` built for this case and shape (``Case.spec``)."""
        from .cases import parse_case

        return parse_case(self.case).spec(self.m, self.n, self.k)

    @property
    def label(self) -> str:
        return f"{self.shape} M={self.m} N={self.n} K={self.k} {self.case}"


@dataclass(frozen=True)
class Choice:
    variant: str | None  # the variant the dispatch layer picks; None: none of the rule's
    config: str = ""  # when set: the measured row's kernel column must name it ('_'-separated part)
    why: str = ""
    among: tuple | None = None  # the variants chosen between (None: every timed one of the rule)


@dataclass(frozen=True)
class Rule:
    name: str
    prefix: str  # a variant's row: impl == prefix + the variant's name
    help: str
    choose: Callable[[Problem], Choice | None]
    arch: str = "sm_90"  # whose thresholds the rule reads (what --threshold changes)
    edges: tuple = (64, 512)  # the report's M ranges unless --m-edges says


RULES: dict[str, Rule] = {}


def rule(name: str, *, prefix: str, help: str, arch: str = "sm_90", edges: tuple = (64, 512)):
    """Register ``choose(problem) -> Choice | None`` as the rule ``name``."""

    def register(choose: Callable[[Problem], Choice | None]):
        RULES[name] = Rule(name, prefix, help, choose, arch, edges)
        return choose

    return register


def _env_sms(csv_path: str) -> int | None:
    """The SM count in the env.json beside a results.csv (``tileq bench`` writes it), or None."""
    path = os.path.join(os.path.dirname(os.path.abspath(csv_path)), "env.json")
    try:
        with open(path, encoding="utf-8") as f:
            return int(json.load(f)["env"]["multiprocessors"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def load_problems(rows: list[R.Result], rule_: Rule, num_sms: int) -> list[Problem]:
    """The problems with at least one timed variant of the rule, in the CSV's order."""
    by: dict = {}
    for r in rows:
        by.setdefault((r.suite, r.shape, r.m, r.n, r.k, r.case), []).append(r)
    problems = []
    for (suite, shape, m, n, k, case), group in by.items():
        p = Problem(suite, shape, m, n, k, case, num_sms)
        for r in group:
            if r.impl.startswith(rule_.prefix) and r.timed:
                name = r.impl[len(rule_.prefix):]
                if name not in p.times or r.time_ms < p.times[name]:  # (a repeated row: its fastest)
                    p.times[name], p.kernels[name] = r.time_ms, r.kernel
        if not p.times:
            continue
        b = best_baseline({r.impl: r for r in group})
        p.baseline = (b.impl, b.time_ms) if b is not None else None
        problems.append(p)
    return problems


def read_problems(path: str, rule_: Rule, num_sms: int | None = None) -> list[Problem]:
    """``path``: a results.csv or the folder of one. ``num_sms``: overrides the env.json's."""
    if os.path.isdir(path):
        path = os.path.join(path, "results.csv")
    sms = num_sms or _env_sms(path)
    if sms is None:
        from ..device import for_arch

        sms = for_arch(rule_.arch).num_sms
    return load_problems(R.read_csv(path), rule_, sms)


# ----------------------------------------------------------------------------- replaying


@dataclass
class Outcome:
    problem: Problem
    choice: Choice
    status: str  # 'replayed' | 'not measured' (the choice's time is not in the CSV) | 'other path'
    chosen_ms: float | None = None
    fastest: tuple = ("", math.nan)  # (variant, ms)

    @property
    def over_fastest(self) -> float | None:
        """The chosen variant's time / the fastest's (1: the choice is the fastest)."""
        return self.chosen_ms / self.fastest[1] if self.chosen_ms is not None else None


def _names(kernel: str, config: str) -> bool:
    return re.search(rf"(^|_){re.escape(config)}(_|$)", kernel or "") is not None


def replay(problems: list[Problem], rule_: Rule) -> list[Outcome]:
    """The rule's choice per problem (problems it returns None for are left out), against the
    fastest of the variants it chooses between."""
    out = []
    for p in problems:
        choice = rule_.choose(p)
        if choice is None:
            continue
        times = p.times
        if choice.among is not None:
            times = {v: t for v, t in p.times.items() if v in choice.among or v == choice.variant}
        fastest = min(times.items(), key=lambda kv: kv[1]) if times else ("", math.nan)
        if choice.variant is None:
            out.append(Outcome(p, choice, "other path", fastest=fastest))
        elif choice.variant not in times or (choice.config and not _names(p.kernels[choice.variant], choice.config)):
            out.append(Outcome(p, choice, "not measured", fastest=fastest))
        else:
            out.append(Outcome(p, choice, "replayed", times[choice.variant], fastest))
    return out


@dataclass
class Group:
    case: str
    m_range: str
    problems: int = 0
    replayed: int = 0
    not_measured: int = 0
    other: int = 0
    changed: int | None = None  # choices that differ from the unchanged thresholds' (overrides only)
    over_fastest: list = field(default_factory=list)
    vs_baseline: list = field(default_factory=list)  # baseline ms / chosen ms
    best_vs_baseline: list = field(default_factory=list)  # baseline ms / fastest ms

    def beyond(self, tolerance: float) -> int:
        return sum(r > 1 + tolerance for r in self.over_fastest)


def summarize(outcomes: list[Outcome], edges=(64, 512), before: list[Outcome] | None = None) -> list[Group]:
    """Per (case, M range), then 'all': ``before`` (the same problems replayed with the unchanged
    thresholds) counts the changed choices."""
    groups: dict = {}
    total = Group("all", "all")
    changed = {id(o.problem): o.choice.variant for o in before} if before is not None else None
    for o in outcomes:
        g = groups.setdefault((o.problem.case, m_range(o.problem.m, edges)),
                              Group(o.problem.case, m_range(o.problem.m, edges)))
        for x in (g, total):
            x.problems += 1
            if changed is not None:
                x.changed = (x.changed or 0) + (changed.get(id(o.problem)) != o.choice.variant)
            if o.status == "not measured":
                x.not_measured += 1
            elif o.status == "other path":
                x.other += 1
            else:
                x.replayed += 1
                x.over_fastest.append(o.over_fastest)
                if o.problem.baseline is not None:
                    x.vs_baseline.append(o.problem.baseline[1] / o.chosen_ms)
                    x.best_vs_baseline.append(o.problem.baseline[1] / o.fastest[1])
    cases = list(dict.fromkeys(case for case, _ in groups))  # in the CSV's order
    order = sorted(groups.values(), key=lambda g: (cases.index(g.case), _range_key(g.m_range)))
    return order + [total]


def _range_key(label: str) -> int:
    return 1 << 62 if label.startswith(">") else int(label.split("-")[0])


# ----------------------------------------------------------------------------- thresholds


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``NAME=VALUE`` items -> {NAME: VALUE} (checked against the table when applied)."""
    out = {}
    for item in items or []:
        name, sep, value = str(item).partition("=")
        if not sep or not name.strip() or not value.strip():
            raise UnsupportedError(expect("--threshold", "NAME=VALUE, e.g. GLUON_SPLIT_FIXED_STEPS=10", repr(item)))
        out[name.strip()] = value.strip()
    return out


def _value(name: str, text: str, old):
    try:
        v = float(text)
    except ValueError:
        raise UnsupportedError(expect(f"--threshold {name}", "a number", repr(text))) from None
    if isinstance(old, int) and not isinstance(old, bool):
        if not v.is_integer():
            raise UnsupportedError(expect(f"--threshold {name}", f"an integer (it is {old})", repr(text)))
        return int(v)
    return v


def _clear_dispatch_caches() -> None:
    """Forget every cached decision of ``tileq.dispatch`` (a cached plan may have read a threshold)."""
    for name, mod in list(sys.modules.items()):
        if name == "tileq.dispatch" or name.startswith("tileq.dispatch."):
            for obj in list(vars(mod).values()):
                clear = getattr(obj, "cache_clear", None)
                if callable(clear) and getattr(obj, "__module__", None) == name:
                    clear()


@contextmanager
def thresholds_overridden(overrides: dict[str, str], arch: str = "sm_90"):
    """Inside: ``tileq.dispatch.thresholds.for_arch(arch)`` returns a Table with the named entries
    changed (a patched copy; the shipped one is restored after), so every rule reading it sees
    them; cached dispatch decisions are forgotten on the way in and out."""
    from ..dispatch import thresholds

    table = thresholds.for_arch(arch)
    unknown = sorted(set(overrides) - set(table.entries))
    if unknown:
        raise UnsupportedError(expect("--threshold", f"names of tileq.dispatch.thresholds ({arch}), e.g. "
                                      f"{', '.join(list(table.entries)[:3])}", ", ".join(unknown)))
    entries = {name: replace(t, value=_value(name, overrides[name], t.value)) if name in overrides else t
               for name, t in table.entries.items()}
    said = ", ".join(f"{n}={entries[n].value}" for n in overrides)
    patched = thresholds.Table(table.arch, entries, f"{table.measured_on}; replayed with {said}")
    tables = thresholds._TABLES  # for_arch's cache: the one place its tables live
    saved = tables.get(table.arch)
    tables[table.arch] = patched
    _clear_dispatch_caches()
    try:
        yield patched
    finally:
        if saved is None:
            tables.pop(table.arch, None)
        else:
            tables[table.arch] = saved
        _clear_dispatch_caches()


# ----------------------------------------------------------------------------- the report


def _x(v) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def _median(vals) -> float | None:
    return statistics.median(vals) if vals else None


def render_groups(groups: list[Group], tolerance: float) -> list[str]:
    with_changed = any(g.changed is not None for g in groups)
    head = ("| case | M | problems | replayed | not measured | other path | "
            + ("changed | " if with_changed else "")
            + f"chosen / fastest: median | worst | beyond {tolerance:.0%} | "
            "baseline / chosen (median) | baseline / fastest (median) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for g in groups:
        worst = max(g.over_fastest) if g.over_fastest else None
        out.append(f"| {g.case} | {g.m_range} | {g.problems} | {g.replayed} | {g.not_measured} | {g.other} | "
                   + (f"{g.changed if g.changed is not None else '–'} | " if with_changed else "")
                   + f"{_x(_median(g.over_fastest))} | {_x(worst)} | {g.beyond(tolerance)} | "
                   f"{_x(_median(g.vs_baseline))} | {_x(_median(g.best_vs_baseline))} |")
    return out


def render_problems(outcomes: list[Outcome], tolerance: float, only_beyond: bool, limit: int | None = None) -> list[str]:
    rows = [o for o in outcomes if not only_beyond or (o.over_fastest or 0) > 1 + tolerance]
    if only_beyond:
        rows.sort(key=lambda o: -(o.over_fastest or 0))
    if not rows:
        return []
    shown = rows[:limit] if limit else rows
    out = ["| problem | chosen | fastest | chosen / fastest | baseline / chosen | why |", "|---|---|---|---|---|---|"]
    for o in shown:
        base = o.problem.baseline
        vs = base[1] / o.chosen_ms if base and o.chosen_ms else None
        chosen = o.choice.variant if o.choice.variant is not None else "(other path)"
        if o.status == "not measured":
            chosen += " (not measured)"
        out.append(f"| {o.problem.label} | {chosen} | {o.fastest[0]} | {_x(o.over_fastest)} | {_x(vs)} | "
                   f"{o.choice.why.replace('|', '/')} |")
    if len(shown) < len(rows):
        out.append(f"\n{len(rows) - len(shown)} more (--per-problem lists every problem).")
    return out


def render(rule_: Rule, sources: list[str], runs: list[tuple[str, list[Outcome], list[Group]]],
           tolerance: float, per_problem: bool) -> str:
    out = [f"# tileq replay --rule {rule_.name}", "", rule_.help, "",
           f"Data: {', '.join(sources)}. A problem: a (shape, M, N, K, case) with at least one timed "
           f"`{rule_.prefix}*` row. Chosen / fastest: the dispatch layer's variant's time over the "
           f"fastest timed variant's (1.000: it picks the fastest). Baseline: the fastest same-math "
           f"torch or peer implementation of the same run (speedup > 1: the variant is faster). "
           f"Not measured: the chosen variant (or its config) was not timed; other path: the dispatch "
           f"layer picks none of these variants.", ""]
    for title, outcomes, groups in runs:
        out += [f"## {title}", ""] + render_groups(groups, tolerance) + [""]
        listing = render_problems(outcomes, tolerance, only_beyond=not per_problem, limit=None if per_problem else 20)
        if listing:
            out += ["Every problem:" if per_problem else f"Problems beyond {tolerance:.0%}, worst first:", ""]
            out += listing + [""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- the rules


@rule("gluon-tiles", prefix="tileq_gluon:",
      help="The sm_90 Gluon prefill kernel's tiling: `dispatch.gluon.choose_tiles` (the wave model of "
           "`tile_costs`, its constants GLUON_* in dispatch/thresholds.py) against every candidate tiling "
           "timed by `tileq bench --gluon-tilings` (rows tileq_gluon:<tiling>).")
def gluon_tiles(p: Problem) -> Choice:
    from ..dispatch import thresholds
    from ..dispatch.gluon import GLUON_ARCH, choose_tiles, gluon_serves
    from ..dispatch.heuristic import choose_pipeline
    from ..kernels.gluon.config import instance_tag
    from .variants import tiling_name

    spec = p.spec
    decode_max_m = thresholds.for_arch(GLUON_ARCH).DECODE_MAX_M
    why = gluon_serves(spec, choose_pipeline(spec, decode_max_m), decode_max_m)
    if why is not None:
        return Choice(None, why=why)
    cfg, why = choose_tiles(spec, p.num_sms)
    name = tiling_name(spec, cfg, p.num_sms)
    if name is None:  # (choose_tiles picks among tile_costs' candidates: never)
        return Choice(None, why=f"{cfg.tag} is none of the wave model's candidates")
    return Choice(name, config=instance_tag(spec, cfg), why=why)


# ----------------------------------------------------------------------------- int4 rules

INT4_EDGES = (16, 64, 255)  # decode tiles of 16 tokens, the small-M prefill range, the prefill paths
W4A16_GROUP = "bquant:bf16xi4p:rcr"  # the case the tuned decode table is measured on


def _int4(p: Problem):
    """(case, facts, plan) of a prepacked int4 problem: the plan ``dispatch.plan.make_plan`` makes
    for the call described on an sm_90 GPU with the run's SM count, and those facts; None for
    another kind of case."""
    from .cases import parse_case
    from .int4 import plan_of

    case = parse_case(p.case)
    if not case.prepacked:
        return None
    plan = plan_of(case, p.m, p.n, p.k, num_sms=p.num_sms)
    return case, plan.facts, plan


def _prefixed(p: Problem, head: str) -> list[str]:
    return [v for v in p.times if v.startswith(head)]


@rule("int4-decode", prefix="tileq_int4:", edges=INT4_EDGES,
      help="The prepacked int4 decode kernel's config: `dispatch.int4.config_for` (the tuned table, else "
           "`decode_rule`: tiles, split over K, occupancy band, stream-K for a wave tail; INT4_DECODE_*) and, "
           "for W4A8, `compute_type` (fp8 activations in the kernel or cast to bf16), through `make_plan`, "
           "against every decode config timed by `tileq bench --int4-variants` (rows tileq_int4:decode:<config>"
           "[:cast]; a sweep up to M = 32). `--write-table FILE` writes the tuned table from the same rows.")
def int4_decode(p: Problem) -> Choice | None:
    from .int4 import variant_name

    got = _int4(p)
    among = tuple(_prefixed(p, "decode:"))
    if got is None or not among:
        return None
    _, _, plan = got
    if plan.route.path != "decode":
        return Choice(None, why=f"the plan runs {plan.route.path}: {plan.route.reason}", among=among)
    return Choice(variant_name(plan), why=plan.route.reason, among=among)


@rule("int4-prefill", prefix="tileq_int4:", edges=INT4_EDGES,
      help="The prepacked int4 path and tiling from INT4_PREFILL_MIN_M tokens: the decode kernel or the Gluon "
           "prefill kernel (`prefill_tiling`: `prefers`, `tokens_for`, `split_for`; then `streamk_for`), W4A16's "
           "dequantize + cuBLAS and W4A8's fp8 GEMM or fused build (`problem_reason`, `fused_for`) through "
           "`make_plan`, against every timed path and tiling of `tileq bench --int4-variants` (the decode "
           "kernel at the plan's own config: the decode config is int4-decode's).")
def int4_prefill(p: Problem) -> Choice | None:
    from ..dispatch import int4 as D
    from ..dispatch import thresholds
    from .int4 import decode_name, variant_name

    got = _int4(p)
    others = [v for v in p.times if not v.startswith("decode:")]
    if got is None or not others:
        return None
    _, facts, plan = got
    T = thresholds.for_arch(facts.arch.name)
    if p.m < T.INT4_PREFILL_MIN_M:
        return Choice(None, why=f"M < INT4_PREFILL_MIN_M = {T.INT4_PREFILL_MIN_M}: the decode kernel only")
    ct = D.compute_type(p.m, p.n, p.k, plan.spec.x_type, facts)
    decode = decode_name(D.config_for(p.m, p.n, p.k, ct, facts)[0].tag, cast=ct != plan.spec.x_type)
    return Choice(variant_name(plan), why=plan.route.reason, among=tuple(others) + (decode,))


@rule("int4-streamk", prefix="tileq_int4:", edges=INT4_EDGES,
      help="W4A16 stream-K on the Gluon prefill kernel (`dispatch.int4.streamk_for`: INT4_STREAMK_*, its cost "
           "against the tiling's) through `make_plan`, where the plan runs that kernel: the tiling "
           "`prefill_tiling` gives against stream-K with 128- and 256-token tiles (rows tileq_int4:gluon:t128:stk, "
           "gluon:t256:stk).")
def int4_streamk(p: Problem) -> Choice | None:
    from ..dispatch import int4 as D
    from .int4 import gluon_name, variant_name

    got = _int4(p)
    if got is None or got[2].spec.x_kind != "none" or not any(v.endswith(":stk") for v in p.times):
        return None
    _, facts, plan = got
    if plan.route.path != "gluon-prefill":
        return Choice(None, why=f"the plan runs {plan.route.path}: {plan.route.reason}")
    t, split = D.prefill_tiling(p.m, p.n, p.k, facts)
    among = (gluon_name(t, split), gluon_name(D.T128, streamk=True), gluon_name(D.T256, streamk=True))
    return Choice(variant_name(plan), why=plan.route.reason, among=among)


@rule("int4-w4a8", prefix="tileq_int4:", edges=INT4_EDGES,
      help="W4A8's route on prepacked int4 weights (fp8 activations, per-token scales): the decode kernel on "
           "them or on activations cast to bf16 (`compute_type`), the Gluon prefill kernel's 16-bit build on cast "
           "activations or its fused fp8 build (`fused_for`), or the fp8 GEMM on the int4 values "
           "(INT4_W4A8_MAX_M), through `make_plan`: each route at the plan's config or tiling.")
def int4_w4a8(p: Problem) -> Choice | None:
    from ..dispatch import int4 as D
    from ..dispatch import thresholds
    from .int4 import decode_name, gluon_name, variant_name

    got = _int4(p)
    if got is None or got[2].spec.x_kind == "none":
        return None
    _, facts, plan = got
    m, n, k = p.m, p.n, p.k
    among = [decode_name(D.config_for(m, n, k, plan.spec.x_type, facts)[0].tag),
             decode_name(D.config_for(m, n, k, "bf16", facts)[0].tag, cast=True), "fp8-gemm"]
    tiling = D.prefill_tiling(m, n, k, facts, x_scale=True)
    if tiling is None and m >= thresholds.for_arch(facts.arch.name).INT4_PREFILL_MIN_M:
        tiling = (D.tokens_for(m, n, facts, x_scale=True), 1)
    if tiling is not None:
        among += [gluon_name(*tiling), gluon_name(*tiling, fused=True)]
    return Choice(variant_name(plan), why=plan.route.reason, among=tuple(among))


def write_tuned_table(problems: list[Problem], path: str, *, margin: float, about_run: str,
                      arch: str = "sm_90") -> list[str]:
    """Write the prepacked int4 decode kernel's tuned table (``dispatch.tuned.int4_decode_table``'s file
    format) from the ``W4A16_GROUP`` problems' decode configs (rows tileq_int4:decode:<config>):
    per weight (shape, N, K), for M = 1 and for M 2..INT4_TUNED_MAX_M, the config with the least
    total time over the M values timed in that range (timed at every one of them) where it beats
    the heuristic's (``decode_rule``, with the run's SM count) by more than ``margin`` in the same
    run. Returns what it chose and why, a line per weight and range."""
    from ..device import for_arch
    from ..dispatch import int4 as D
    from ..dispatch import thresholds

    T = thresholds.for_arch(arch)
    top = int(T.INT4_TUNED_MAX_M)
    ranges = {1: (1, 1), top: (2, top)}  # table key -> the M values it serves
    weights: dict = {}
    for p in problems:
        if p.case != W4A16_GROUP or p.m > top:
            continue
        per_m = weights.setdefault((p.shape, p.n, p.k), {})
        for v, ms in p.times.items():
            if v.startswith("decode:") and not v.endswith(":cast"):
                cfgs = per_m.setdefault(p.m, {})
                cfgs[v[len("decode:"):]] = min(ms, cfgs.get(v[len("decode:"):], math.inf))
    lines, entries, seen = [], [], set()
    for (shape, n, k), per_m in weights.items():
        for key, (lo, hi) in ranges.items():
            ms = sorted(m for m in per_m if lo <= m <= hi)
            if not ms:
                continue
            if (n, k, key) in seen:
                lines.append(f"{shape} m={key}: N={n} K={k} already has an entry (another shape); skipped")
                continue
            facts = replace(for_arch(arch), num_sms=next(p.num_sms for p in problems if p.shape == shape))
            heuristic = {m: D.decode_rule(m, n, k, "bf16", facts)[0].tag for m in ms}
            common = set.intersection(*(set(per_m[m]) for m in ms))
            if not common or any(heuristic[m] not in per_m[m] for m in ms):
                lines.append(f"{shape} m={key}: the heuristic's config or a config common to M {ms} was not "
                             "timed; skipped")
                continue
            totals = {c: sum(per_m[m][c] for m in ms) for c in common}
            best = min(sorted(totals), key=totals.get)
            heur_ms = sum(per_m[m][heuristic[m]] for m in ms)
            gain = heur_ms / totals[best]
            keep = gain > 1 + margin
            heur = "/".join(sorted(set(heuristic.values())))
            lines.append(f"{shape} m={key} (M {ms}): best {best} {totals[best] * 1e3:.1f} us, heuristic {heur} "
                         f"{heur_ms * 1e3:.1f} us: {gain:.3f}x -> {'table' if keep else 'heuristic'}")
            if keep:
                seen.add((n, k, key))
                entries.append({"n": n, "k": k, "m": key, "config": best, "us": round(totals[best] * 1e3 / len(ms), 2),
                                "heuristic": heur, "heuristic_us": round(heur_ms * 1e3 / len(ms), 2), "shape": shape,
                                "measured_m": ms})
    about = (f"Prepacked-int4 decode configs measured on {about_run}, W4A16 group 128, bf16 activations "
             f"({W4A16_GROUP}), by tileq bench --int4-variants and written by tileq replay --rule int4-decode "
             f"--write-table: per weight, for M = 1 and for M 2-{top}, the timed config with the least total time "
             f"over the M values measured in that range, where it beat the heuristic's "
             f"(tileq.dispatch.int4.decode_rule) by more than {margin:.0%} in the same run ('us': mean per M). "
             f"Entry m=1 serves M = 1, m={top} serves M 2-{top}; other sizes use the heuristic. Used for bf16 and "
             f"fp16 activations only (tileq.dispatch.int4.config_for).")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"about": about, "arch": arch, "entries": entries}, f, indent=1)
        f.write("\n")
    return lines + [f"{len(entries)} entries -> {path}"]


def _about_run(csv_paths: list[str]) -> str:
    """The GPU, driver, torch, Triton and date of the runs (their env.json), and their CSVs."""
    said = []
    for path in csv_paths:
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        try:
            with open(os.path.join(folder, "env.json"), encoding="utf-8") as f:
                env = json.load(f)["env"]
        except (OSError, KeyError, TypeError, ValueError):
            said.append(f"an unrecorded GPU ({path})")
            continue
        driver = f" (driver {env['driver_version']})" if env.get("driver_version") else ""
        said.append(f"one {env.get('device', 'unknown device')}{driver}, torch {env.get('torch', '?')}, Triton "
                    f"{env.get('triton', '?')}, {str(env.get('date', '?'))[:10]} ({path})")
    return "; ".join(dict.fromkeys(said))


# ----------------------------------------------------------------------------- CLI


def register_cli(subparsers) -> None:
    """``tileq replay`` running ``run_replay``; its options are tileq.bench.cli.add_replay's
    (importable without torch, for ``--help``)."""
    from .cli import add_replay

    add_replay(subparsers).set_defaults(func=run_replay)


def _list_rules() -> int:
    from ..dispatch import thresholds

    for r in RULES.values():
        print(f"{r.name} (rows {r.prefix}<variant>; thresholds of {r.arch}):\n  {r.help}")
    table = thresholds.for_arch("sm_90")
    print(f"\nthresholds ({table!r}):")
    for name, t in table.entries.items():
        print(f"  {name} = {t.value}: {t.decides}")
    return 0


def run_replay(args) -> int:
    from ..errors import TileqError

    if args.list:
        return _list_rules()
    try:
        if args.rule not in RULES:
            raise UnsupportedError(expect("--rule", f"one of {', '.join(RULES)}", repr(args.rule)))
        if not args.csv:
            raise ShapeError(expect("csv", "at least one results.csv (or its folder)", "none"))
        rule_ = RULES[args.rule]
        if args.write_table and rule_.name != "int4-decode":
            raise UnsupportedError(expect("--write-table", "--rule int4-decode", repr(rule_.name)))
        edges = rule_.edges
        if args.m_edges is not None:
            try:
                edges = tuple(int(x) for x in args.m_edges.split(",") if x.strip())
            except ValueError:
                raise ShapeError(expect("--m-edges", "comma-separated integers", repr(args.m_edges))) from None
            if list(edges) != sorted(set(edges)):
                raise ShapeError(expect("--m-edges", "increasing integers", repr(args.m_edges)))
        try:
            keep = re.compile(args.shapes) if args.shapes else None
        except re.error as e:
            raise ShapeError(expect("--shapes", "a regular expression", f"{args.shapes!r} ({e})")) from None
        overrides = parse_overrides(args.threshold)
        problems = []
        for path in args.csv:
            problems += read_problems(path, rule_, args.sms)
        if keep is not None:
            problems = [p for p in problems if keep.search(p.shape)]
        current = replay(problems, rule_)
        if not current:
            raise ShapeError(expect("csv", f"timed '{rule_.prefix}*' rows of the rule's problems (tileq bench "
                                    f"with the flag that writes them{', --shapes' if keep else ''})", "none"))
        runs = [("Current thresholds", current, summarize(current, edges))]
        if overrides:
            with thresholds_overridden(overrides, rule_.arch) as table:
                changed = replay(problems, rule_)
            said = ", ".join(f"{n}={table.entries[n].value}" for n in overrides)
            runs.append((f"With {said}", changed, summarize(changed, edges, before=current)))
        table_lines = None
        if args.write_table:
            about = _about_run(args.csv) + (f"; shapes matching {args.shapes!r}" if args.shapes else "")
            with thresholds_overridden(overrides, rule_.arch):
                table_lines = write_tuned_table(problems, args.write_table, margin=args.table_margin,
                                                about_run=about, arch=rule_.arch)
    except (TileqError, ValueError, OSError) as e:
        print(f"tileq replay: error: {e}", file=sys.stderr)
        return 2
    text = render(rule_, args.csv, runs, args.tolerance, args.per_problem)
    if table_lines is not None:
        listed = "\n".join(f"- {x}" for x in table_lines)
        text += f"\n## Tuned table written to {args.write_table}\n\n{listed}\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0
