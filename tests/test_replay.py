"""``tileq replay`` and the Gluon tilings of ``tileq bench --gluon-tilings`` on CPU: a synthetic
results CSV replayed through the dispatch layer (its arithmetic, a threshold override that
changes the choice, a config the CSV did not time), and the tilings' configs against the planner's."""

import json
import statistics
from dataclasses import replace

import pytest
import torch

import tileq.cli
from tileq.bench import replay as RP
from tileq.bench import results as R
from tileq.bench.cases import parse_case
from tileq.bench.variants import TILING_PREFIX, gluon_tilings, tiling_name
from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.dispatch import thresholds
from tileq.dispatch.gluon import choose_tiles
from tileq.kernels.gluon.config import instance_tag

SMS = 132
ROWCOL = "rowcol:fp8xfp8:rcr"


# ----------------------------------------------------------------------------- the tilings


@pytest.mark.parametrize("family", [
    "rowcol_fp8xfp8_rcr_prefill", "tensor_fp8xfp8_rcr_prefill", "rowcol_i8xi8_rcr_prefill",
    "abquant_fp8xfp8_rcr_prefill", "aquant_fp8xfp8_rcr_preshufflequant", "bquant_fp8xfp8_rcr_prefill",
])
def test_the_planners_tiling_is_one_of_the_benched_candidates(family):
    """variants.gluon_tilings finishes each candidate of tile_costs as choose_tiles does: the one
    the planner picks is exactly its config (so the bench times what the plan runs)."""
    kws = [{}, dict(fast_accum=True), dict(has_acc=True), dict(has_bias=True, out_dtype=torch.float32)]
    if family.startswith("bquant"):
        kws = [dict(group_n=1), dict(group_n=1, has_bias=True), dict(group_n=128)]
    for kw in kws:
        for m, n, k in ((65, 5120, 5120), (128, 7168, 18432), (512, 4096, 4096), (2048, 32768, 5120),
                        (8192, 14336, 4096), (300, 1000, 600)):
            spec = replace(family_spec(parse_family(family), m, n, k), **kw)
            cfg, _ = choose_tiles(spec, SMS)
            tilings = gluon_tilings(spec, SMS)
            name = tiling_name(spec, cfg, SMS)
            assert name is not None and tilings[name][0] == cfg, (family, kw, m, n, k)
            assert len({c for c, _, _ in tilings.values()}) == len(tilings)  # distinct configs


def test_tiling_entries_force_each_candidate_on_a_gluon_plan(monkeypatch):
    """What --gluon-tilings runs on an sm_90 GPU, without one: the plan (made Gluon here) forced to
    each candidate's config, named tileq_gluon:<tiling>, the plan's own choice marked."""
    from tileq.bench import variants as V
    from tileq.bench.baselines import Context
    from tileq.bench.cases import (
        build_operands,
        draw_activation,
        draw_weight,
        quantize_weight_side,
    )

    cpu = torch.device("cpu")
    case = parse_case("abquant:fp8xfp8:rcr")
    m, n, k = 256, 2048, 1024
    ops = build_operands(case, draw_activation(m, k, 0, cpu), quantize_weight_side(case, draw_weight(n, k, 0, cpu)))
    real = V._plan
    spec = case.spec(m, n, k)
    chosen_cfg, why = choose_tiles(spec, SMS)

    def gluon_plan(problem, ctx, gluon=None):
        plan = real(problem, ctx, gluon)
        return replace(plan, route=replace(plan.route, impl="gluon", impl_reason="on", gluon=chosen_cfg,
                                           gluon_reason=why))

    monkeypatch.setattr(V, "_plan", gluon_plan)
    ran = []
    monkeypatch.setattr(V, "plan_runnable", lambda ops, problem, plan, note, kernel: ran.append((plan, note, kernel)))
    impls = V.tiling_impls(ops, Context(cpu, "triton"))
    tilings = gluon_tilings(spec, SMS)
    assert [i.name for i in impls] == [TILING_PREFIX + name for name in tilings]
    for impl in impls:
        assert impl.kind == "variant" and impl.unavailable(case, m, n, k, cpu) is None
        impl.build(ops, Context(cpu, "triton"))
    chosen = tiling_name(spec, chosen_cfg, SMS)
    for (plan, note, kernel), (name, (cfg, cost, text)) in zip(ran, tilings.items()):
        assert plan.route.impl == "gluon" and plan.route.gluon == cfg and "forced tiling" in plan.route.gluon_reason
        assert note.startswith(text) and f"{cost:.0f} K steps" in note
        assert note.endswith("; the plan's choice") == (name == chosen)
        assert kernel == f"abquant_fp8xfp8_rcr_prefill__gluon_{instance_tag(spec, cfg)}_sm90"


# ----------------------------------------------------------------------------- a synthetic CSV


def _rows(problems, baseline_ms=None):
    """results.csv rows: per (m, n, k, {tiling: ms}) the tiling rows, as bench writes them."""
    case = parse_case(ROWCOL)
    rows = []
    for m, n, k, times in problems:
        spec = case.spec(m, n, k)
        tilings = gluon_tilings(spec, SMS)

        def row(impl, kind, ms, kernel="", m=m, n=n, k=k):
            return R.Result("syn", f"w{n}x{k}", m, n, k, case.name, case.scheme.value, case.dtypes, "rcr",
                            impl, kind, R.OK, time_ms=ms, kernel=kernel)

        rows.append(row("tileq", "tileq", min(times.values())))
        for name, ms in times.items():
            tag = instance_tag(spec, tilings[name][0]) if name in tilings else "other"
            rows.append(row(TILING_PREFIX + name, "variant", ms, f"rowcol_fp8xfp8_rcr_prefill__gluon_{tag}_sm90"))
        if baseline_ms is not None:
            rows.append(row("torch_scaled_mm_rowwise", "fused", baseline_ms))
            rows.append(row("torch_bf16_matmul", "unquantized", baseline_ms / 2))  # never the baseline
        rows.append(R.Result("syn", f"w{n}x{k}", m, n, k, case.name, case.scheme.value, case.dtypes, "rcr",
                             TILING_PREFIX + "256", "variant", R.NA, note="not a candidate"))
    return rows


def _chosen(m, n, k):
    spec = parse_case(ROWCOL).spec(m, n, k)
    return tiling_name(spec, choose_tiles(spec, SMS)[0], SMS)


# Three problems: the model picks 64 at M=128 N=K=5120 (24 K steps against 128+split's 26), 128+split
# at M=2048 N=32768 K=5120, 128 at M=4096 N=K=5120 (no partial wave).
P1, P2, P3 = (128, 5120, 5120), (2048, 32768, 5120), (4096, 5120, 5120)


def test_synthetic_problems_pick_what_the_model_says():
    assert [_chosen(*p) for p in (P1, P2, P3)] == ["64", "128+split", "128"]


def _write(tmp_path, rows, sms=None):
    path = tmp_path / "results.csv"
    R.write_csv(rows, path)
    if sms is not None:
        (tmp_path / "env.json").write_text(json.dumps({"env": {"multiprocessors": str(sms)}}))
    return str(path)


def _problems(tmp_path):
    # chosen / fastest: P1 1.10 (64 chosen at 1.10, 128+split fastest at 1.00), P2 1.00, P3 1.02
    return [(*P1, {"128": 1.5, "128+split": 1.0, "64": 1.1}),
            (*P2, {"128": 2.2, "128+split": 2.0, "64": 2.6}),
            (*P3, {"128": 5.1, "128+split": 5.0, "64": 6.0})]


def test_replay_arithmetic(tmp_path):
    path = _write(tmp_path, _rows(_problems(tmp_path), baseline_ms=3.0), sms=SMS)
    rule = RP.RULES["gluon-tiles"]
    problems = RP.read_problems(path, rule)
    assert [(p.m, p.num_sms, sorted(p.times)) for p in problems] == [
        (128, SMS, ["128", "128+split", "64"]), (2048, SMS, ["128", "128+split", "64"]), (4096, SMS, ["128", "128+split", "64"])]
    assert problems[0].baseline == ("torch_scaled_mm_rowwise", 3.0)  # bf16 matmul is never the baseline
    outcomes = RP.replay(problems, rule)
    assert [(o.choice.variant, o.status, o.fastest[0]) for o in outcomes] == [
        ("64", "replayed", "128+split"), ("128+split", "replayed", "128+split"), ("128", "replayed", "128+split")]
    assert [round(o.over_fastest, 6) for o in outcomes] == [1.1, 1.0, 1.02]
    groups = RP.summarize(outcomes, edges=(64, 512))
    assert [(g.case, g.m_range, g.problems) for g in groups] == [
        (ROWCOL, "65-512", 1), (ROWCOL, "> 512", 2), ("all", "all", 3)]
    total = groups[-1]
    assert statistics.median(total.over_fastest) == pytest.approx(1.02) and max(total.over_fastest) == pytest.approx(1.1)
    assert total.beyond(0.03) == 1 and total.beyond(0.01) == 2
    assert sorted(total.vs_baseline) == pytest.approx(sorted([3 / 1.1, 3 / 2.0, 3 / 5.1]))
    assert sorted(total.best_vs_baseline) == pytest.approx(sorted([3 / 1.0, 3 / 2.0, 3 / 5.0]))
    text = "\n".join(RP.render_groups(groups, 0.03))
    assert f"| {ROWCOL} | > 512 | 2 | 2 | 0 | 0 | 1.010 | 1.020 | 0 | 1.044 | 1.050 |" in text  # (3 / 2.0 + 3 / 5.1) / 2, (3 / 2.0 + 3 / 5.0) / 2
    assert "| all | all | 3 | 3 | 0 | 0 | 1.020 | 1.100 | 1 | 1.500 | 1.500 |" in text


def test_a_threshold_override_changes_the_choice_and_is_restored(tmp_path):
    rule = RP.RULES["gluon-tiles"]
    problems = RP.read_problems(_write(tmp_path, _rows(_problems(tmp_path))), rule, num_sms=SMS)
    before = RP.replay(problems, rule)
    # 128+split at M=128 costs ceil(40 / 3) + SPLIT_FIXED_STEPS = 14 + 12 against 64's 24: with 8 it wins.
    with RP.thresholds_overridden({"GLUON_SPLIT_FIXED_STEPS": "8"}) as table:
        assert table.GLUON_SPLIT_FIXED_STEPS == 8.0 and thresholds.for_arch("sm_90") is table
        after = RP.replay(problems, rule)
    assert thresholds.for_arch("sm_90").GLUON_SPLIT_FIXED_STEPS == 12.0 and _chosen(*P1) == "64"
    assert [o.choice.variant for o in after] == ["128+split", "128+split", "128"]
    assert after[0].over_fastest == pytest.approx(1.0)
    groups = RP.summarize(after, edges=(64, 512), before=before)
    assert [g.changed for g in groups] == [1, 0, 1]
    assert groups[-1].beyond(0.03) == 0
    # A changed split over K: '128+split' is another config than the one timed: not measured.
    with RP.thresholds_overridden({"GLUON_MAX_SPLIT_K": "2"}):
        capped = RP.replay(problems, rule)
    assert capped[1].choice.variant == "128+split" and capped[1].status == "not measured"
    # The Gluon kernel no longer serves M = 128 (decode up to 256): another path.
    with RP.thresholds_overridden({"DECODE_MAX_M": "256"}):
        decode = RP.replay(problems, rule)
    assert decode[0].status == "other path" and "prefill only" in decode[0].choice.why
    assert [o.status for o in decode[1:]] == ["replayed", "replayed"]


def test_threshold_overrides_are_checked():
    with pytest.raises(ValueError, match="NAME=VALUE"):
        RP.parse_overrides(["GLUON_SPLIT_FIXED_STEPS"])
    with pytest.raises(ValueError, match="names of tileq.dispatch.thresholds"):
        with RP.thresholds_overridden({"NO_SUCH_THRESHOLD": "1"}):
            pass
    with pytest.raises(ValueError, match="an integer"):
        with RP.thresholds_overridden({"GLUON_MAX_SPLIT_K": "2.5"}):
            pass
    assert thresholds.for_arch("sm_90").GLUON_MAX_SPLIT_K == 16


def test_replay_cli(tmp_path, capsys):
    path = _write(tmp_path, _rows(_problems(tmp_path), baseline_ms=3.0), sms=SMS)
    out = tmp_path / "replay.md"
    rc = tileq.cli.main(["replay", str(tmp_path), "--rule", "gluon-tiles", "--threshold",
                         "GLUON_SPLIT_FIXED_STEPS=8", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and text.strip() == out.read_text().strip()
    assert "## Current thresholds" in text and "## With GLUON_SPLIT_FIXED_STEPS=8.0" in text
    assert "| all | all | 3 | 3 | 0 | 0 | 1.020 | 1.100 | 1 |" in text  # current
    assert "| all | all | 3 | 3 | 0 | 0 | 1 | 1.000 | 1.020 | 0 |" in text  # overridden, 1 changed
    assert "Problems beyond 3%, worst first" in text and "w5120x5120 M=128" in text
    assert tileq.cli.main(["replay", path, "--rule", "gluon-tiles", "--per-problem"]) == 0
    assert "Every problem:" in capsys.readouterr().out
    assert tileq.cli.main(["replay", path, "--rule", "gluon-tiles", "--threshold", "NOPE=1"]) == 2
    assert tileq.cli.main(["replay", path, "--rule", "nope"]) == 2
    assert tileq.cli.main(["replay", path, "--rule", "gluon-tiles", "--m-edges", "512,64"]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    R.write_csv([r for r in R.read_csv(path) if not r.impl.startswith(TILING_PREFIX)], empty / "results.csv")
    assert tileq.cli.main(["replay", str(empty), "--rule", "gluon-tiles"]) == 2
    assert "timed 'tileq_gluon:*' rows" in capsys.readouterr().err
    assert tileq.cli.main(["replay", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "gluon-tiles" in listed and "GLUON_SPLIT_FIXED_STEPS = 12.0" in listed


def test_a_rule_is_one_function(tmp_path):
    """The API for further rules: a function from a problem to the dispatch layer's choice."""
    path = _write(tmp_path, _rows(_problems(tmp_path)))

    @RP.rule("test-widest", prefix=TILING_PREFIX, help="always 128 x 128 tiles")
    def widest(p):
        return RP.Choice("128", why=f"M={p.m}")

    try:
        rule = RP.RULES["test-widest"]
        outcomes = RP.replay(RP.read_problems(path, rule, num_sms=SMS), rule)
        assert [round(o.over_fastest, 3) for o in outcomes] == [1.5, 1.1, 1.02]
    finally:
        del RP.RULES["test-widest"]


# ----------------------------------------------------------------------------- prepacked int4

W4A16, W4A8 = "bquant:bf16xi4p:rcr", "bquant:fp8xi4p:rcr"


def _int4_rows(problems, default=2.0):
    """results.csv rows of ``tileq bench --int4-variants``: per (case, shape, m, n, k, {variant: ms})
    a row for every variant the bench times for the call (``default`` ms unless given), with the
    kernel its plan names, and bf16 cuBLAS."""
    from tileq.bench import int4 as I

    rows = []
    for case_name, shape, m, n, k, times in problems:
        case = parse_case(case_name)
        base = I.plan_of(case, m, n, k)
        made = I.variants(base)
        assert set(times) <= set(made), sorted(set(times) - set(made))

        def row(impl, kind, ms, kernel="", key=(shape, m, n, k), case=case):
            return R.Result("int4", *key, case.name, case.scheme.value, case.dtypes, "rcr", impl, kind, R.OK,
                            time_ms=ms, kernel=kernel)

        rows.append(row("tileq", "tileq", times.get(I.variant_name(base), default), base.route.kernel))
        for name, make in made.items():
            kernel = make().route.kernel if name != "fp8-gemm" else "dequant-fp8+tileq"
            rows.append(row(I.PREFIX + name, "variant", times.get(name, default), kernel))
        rows.append(row("torch_bf16_matmul", "unquantized", 4.0))
    return rows


# The plans (H200, 132 SMs): decode at M = 1, the Gluon kernel's 64-token tiles split 3 ways at
# M = 48, stream-K with 256-token tiles at M = 200 on a wide weight (its tiling: 128 tokens,
# unsplit), and W4A8 at M = 512 on the fp8 GEMM.
D1 = "decode:m64n16k512_w4_s2_sk4_r168_pf_fx_swap"
INT4_PROBLEMS = [
    (W4A16, "llm.a", 1, 5120, 5120, {D1: 1.1, "decode:m64n16k512_w4_s3_r168_pf_swap": 1.0}),
    (W4A16, "llm.a", 48, 5120, 5120, {"decode:m64n32k512_w4_s2_sk2_fx_swap": 3.0, "gluon:t64:sk3": 1.0}),
    (W4A16, "llm.b", 200, 28672, 8192, {"gluon:t128": 1.5, "gluon:t128:stk": 1.2, "gluon:t256:stk": 1.3,
                                        "dequant+cublas": 1.1}),
    (W4A8, "llm.a", 512, 5120, 5120, {"fp8-gemm": 1.2, "gluon:t128:fused": 1.0, "gluon:t128": 1.5}),
]


def _replayed(rows, name, overrides=None):
    """The rule replayed on ``rows`` (or on problems already loaded: the same objects, as
    summarize's ``before`` needs)."""
    rule = RP.RULES[name]
    problems = rows if rows and isinstance(rows[0], RP.Problem) else RP.load_problems(rows, rule, SMS)
    if overrides:
        with RP.thresholds_overridden(overrides):
            return RP.replay(problems, rule)
    return RP.replay(problems, rule)


def _summary(outcomes):
    return [(o.problem.m, o.choice.variant, o.status, round(o.over_fastest, 6) if o.over_fastest else None)
            for o in outcomes]


@pytest.mark.usefixtures("tested_triton")
def test_int4_rules_replay_the_plan_among_their_variants():
    rows = _int4_rows(INT4_PROBLEMS)
    # int4-decode: the decode configs (the W4A8 problem at 512 timed none: not its problem)
    assert _summary(_replayed(rows, "int4-decode")) == [
        (1, D1, "replayed", 1.1), (48, None, "other path", None), (200, None, "other path", None)]
    # int4-prefill: every path and tiling from INT4_PREFILL_MIN_M, the decode kernel at the plan's config
    assert _summary(_replayed(rows, "int4-prefill")) == [
        (48, "gluon:t64:sk3", "replayed", 1.0), (200, "gluon:t256:stk", "replayed", round(1.3 / 1.1, 6)),
        (512, "fp8-gemm", "replayed", 1.2)]
    # int4-streamk: W4A16 with stream-K timed (from INT4_STREAMK_MIN_M): its tiling against stream-K's
    out = _replayed(rows, "int4-streamk")
    assert _summary(out) == [(200, "gluon:t256:stk", "replayed", round(1.3 / 1.2, 6))]
    assert out[0].choice.among == ("gluon:t128", "gluon:t128:stk", "gluon:t256:stk")
    assert out[0].fastest[0] == "gluon:t128:stk"
    # int4-w4a8: each route at the plan's tiling
    out = _replayed(rows, "int4-w4a8")
    assert _summary(out) == [(512, "fp8-gemm", "replayed", 1.2)] and out[0].fastest == ("gluon:t128:fused", 1.0)
    groups = RP.summarize(out, edges=RP.INT4_EDGES)
    assert [(g.case, g.m_range, g.replayed) for g in groups] == [(W4A8, "> 255", 1), ("all", "all", 1)]
    assert groups[-1].vs_baseline == []  # (bf16 cuBLAS is never the same-math baseline)


@pytest.mark.usefixtures("tested_triton")
def test_int4_threshold_overrides_change_the_choice():
    rows = _int4_rows(INT4_PROBLEMS)
    # No split for a grid of 40 tiles: M = 48 then runs the decode kernel (3.0 against 1.0).
    problems = RP.load_problems(rows, RP.RULES["int4-prefill"], SMS)
    before, after = _replayed(problems, "int4-prefill"), _replayed(problems, "int4-prefill", {"INT4_SPLIT_FILL": "0"})
    assert _summary(after)[0] == (48, "decode:m64n32k512_w4_s2_sk2_fx_swap", "replayed", 3.0)
    assert [g.changed for g in RP.summarize(after, RP.INT4_EDGES, before=before)][-1] == 1
    # W4A8 on the Gluon kernel's fused build up to 1024 tokens: M = 512 takes it (the fastest).
    assert _summary(_replayed(rows, "int4-w4a8", {"INT4_W4A8_MAX_M": "1024"})) == [
        (512, "gluon:t128:fused", "replayed", 1.0)]
    # Stream-K only below 128 tokens: M = 200 keeps its tiling.
    assert _summary(_replayed(rows, "int4-streamk", {"INT4_STREAMK_MAX_M": "128"})) == [(
        200, "gluon:t128", "replayed", round(1.5 / 1.2, 6))]
    # 16-token decode tiles up to 32 tokens: a config the bench did not time at M = 1 is untouched,
    # and the shipped thresholds are back.
    assert _summary(_replayed(rows, "int4-decode", {"INT4_DECODE_TILE16_MAX_M": "32"}))[0] == (1, D1, "replayed", 1.1)
    assert thresholds.for_arch("sm_90").INT4_SPLIT_FILL == 0.65


def _table_rows():
    """W4A16 decode configs of two weights at M 1, 4, 16: on 5120 x 5120 the stream-K config beats the
    heuristic's by 10% at every M; on 7168 x 5120 the heuristic's is the fastest."""
    stk = "decode:m64n16k512_w4_s3_r168_pf_stk_swap"
    problems = []
    for m in (1, 4, 16):
        problems.append((W4A16, "llm.a", m, 5120, 5120, {D1: 1.1, stk: 1.0}))
        problems.append((W4A16, "untuned.b", m, 7168, 5120, {}))
    problems.append((W4A8, "llm.a", 1, 5120, 5120, {"decode:m64n16k512_w4_s2_sk4_r168_pf_h16_fx_swap": 0.1}))
    return _int4_rows(problems)


def test_tuned_table_writer(tmp_path):
    from tileq.device import for_arch
    from tileq.dispatch.int4 import decode_rule
    from tileq.kernels.int4p.config import Int4pConfig

    problems = RP.load_problems(_table_rows(), RP.RULES["int4-decode"], SMS)
    path = tmp_path / "tuned.json"
    lines = RP.write_tuned_table(problems, str(path), margin=0.03, about_run="one test GPU")
    doc = json.loads(path.read_text())
    assert sorted(doc) == ["about", "arch", "entries"] and doc["arch"] == "sm_90"
    assert "one test GPU" in doc["about"] and "more than 3%" in doc["about"] and "m=16 serves M 2-16" in doc["about"]
    entry = {"n": 5120, "k": 5120, "config": "m64n16k512_w4_s3_r168_pf_stk_swap", "us": 1000.0,
             "heuristic": D1[7:], "heuristic_us": 1100.0, "shape": "llm.a"}
    assert doc["entries"] == [{**entry, "m": 1, "measured_m": [1]}, {**entry, "m": 16, "measured_m": [4, 16]}]
    # what dispatch.tuned.int4_decode_table reads: {(n, k, 1 or 16): config}
    table = {(e["n"], e["k"], e["m"]): Int4pConfig.parse_tag(e["config"]) for e in doc["entries"]}
    assert table[(5120, 5120, 16)].streamk
    assert decode_rule(1, 7168, 5120, "bf16", for_arch("sm_90"))[0].tag in lines[2]
    assert lines[2].startswith("untuned.b m=1 (M [1]): best") and lines[2].endswith("1.000x -> heuristic")
    assert lines[-1] == f"2 entries -> {path}"
    # a margin above the gain: no entry
    RP.write_tuned_table(problems, str(path), margin=0.2, about_run="x")
    assert json.loads(path.read_text())["entries"] == []


def test_replay_cli_int4_and_the_table(tmp_path, capsys):
    R.write_csv(_table_rows(), tmp_path / "results.csv")
    (tmp_path / "env.json").write_text(json.dumps({"env": {"multiprocessors": "132", "device": "NVIDIA H200",
                                                           "driver_version": "580", "torch": "2.11",
                                                           "triton": "3.6", "date": "2026-12-03 10:00 UTC"}}))
    table = tmp_path / "tuned.json"
    rc = tileq.cli.main(["replay", str(tmp_path), "--rule", "int4-decode", "--shapes", "^llm\\.",
                         "--write-table", str(table)])
    text = capsys.readouterr().out
    assert rc == 0 and "## Tuned table written to" in text and f"- 2 entries -> {table}" in text
    assert "| bquant:bf16xi4p:rcr | 1-16 | 3 | 3 | 0 | 0 | 1.100 | 1.100 | 3 |" in text  # the plan's config, 10% off
    doc = json.loads(table.read_text())
    assert len(doc["entries"]) == 2
    assert "one NVIDIA H200 (driver 580), torch 2.11, Triton 3.6, 2026-12-03" in doc["about"]
    assert "shapes matching '^llm\\\\.'" in doc["about"]
    assert tileq.cli.main(["replay", str(tmp_path), "--rule", "int4-prefill", "--write-table", str(table)]) == 2
    assert "--write-table: expected --rule int4-decode" in capsys.readouterr().err
    assert tileq.cli.main(["replay", str(tmp_path), "--rule", "int4-decode", "--shapes", "^nothing"]) == 2
    assert tileq.cli.main(["replay", str(tmp_path), "--rule", "int4-decode", "--shapes", "("]) == 2
