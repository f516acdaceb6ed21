"""The benchmark harness on CPU: suites, cases, the correctness gate, outputs, the CLI end to end.

Timing needs CUDA; here every row is gated (tileq through Triton's interpreter) and marked not
measured. Report, plots and --compare are exercised on a small synthetic result set.
"""

import io
import math
import os
import sys

import pytest
import torch

import tileq.cli
from tileq.bench import results as R
from tileq.bench.baselines import BY_NAME, REGISTRY, select
from tileq.bench.cases import HEADLINE, aquant28, parse_case, parse_case_list
from tileq.bench.gate import REL_TOL, gate, poisoned, sqnr_db
from tileq.bench.progress import Progress
from tileq.bench.report import render
from tileq.bench.suites import BUILTIN_SUITES, SuiteError, load_suite
from tileq.dtypes import OperandType
from tileq.errors import ShapeError, UnsupportedError
from tileq.problem import Scheme

# ----------------------------------------------------------------------------- suites


def test_builtin_suites_load():
    for name in BUILTIN_SUITES:
        assert load_suite(name), name
    llm = load_suite("llm")
    assert len({(s.n, s.k) for s in llm}) == 18
    assert sorted({s.m for s in llm}) == [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 4096, 8192]
    assert len(llm) == len(load_suite("llm-decode")) + len(load_suite("llm-prefill"))
    halves = load_suite("llm-prefill-a") + load_suite("llm-prefill-b")
    assert [(s.name, s.m, s.n, s.k) for s in load_suite("llm-prefill")] == [(s.name, s.m, s.n, s.k) for s in halves]
    assert [s.m for s in load_suite("square")] == [512, 1024, 2048, 4096, 8192, 16384]
    ck = load_suite("ck28")
    assert len(ck) == 28 and all(len(s.cases) == 28 for s in ck)
    # The smoke suite must stay interpreter-sized.
    assert all(s.m <= 128 and s.n <= 128 and s.k <= 384 for s in load_suite("smoke"))


def test_aliases_used_by_gpu_run_script():
    assert load_suite("decode") == load_suite("llm-decode")


def test_user_suite_file(tmp_path):
    p = tmp_path / "mine.csv"
    p.write_text(
        "# my shapes\n"
        "name,m,n,k,schemes,cases\n"
        "\n"
        "proj,1;8,256,512,,\n"
        "only_rowcol,4,64,128,rowcol;tensor,\n"
        "custom,2,64,128,,aquant:fp8xfp8:crr;headline\n"
    )
    shapes = load_suite(str(p))
    assert [(s.name, s.m) for s in shapes] == [("proj", 1), ("proj", 8), ("only_rowcol", 4), ("custom", 2)]
    assert shapes[0].suite == "mine" and shapes[0].line == 4
    assert {c.scheme for c in shapes[2].cases_to_run(HEADLINE)} == {Scheme.ROWCOL, Scheme.TENSOR}
    custom = shapes[3].cases_to_run(HEADLINE)
    assert custom[0] == parse_case("aquant:fp8xfp8:crr") and len(custom) == 1 + len(HEADLINE)


@pytest.mark.parametrize(
    "text, line, match",
    [
        ("name,m,n\nx,1,2\n", 1, "header: expected columns name, m, n, k"),
        ("name,m,n,k,flavour\nx,1,2,3,y\n", 1, "header"),
        ("# c\nname,m,n,k\nok,1,2,3\nbad,one,2,3\n", 4, "m: expected a positive integer, got 'one'"),
        ("name,m,n,k\nbad,1,-2,3\n", 2, "n: expected a positive integer, got '-2'"),
        ("name,m,n,k\nbad,1;0,2,3\n", 2, "m: expected a positive integer, got '0'"),
        ("name,m,n,k\nbad,1,2,3,4\n", 2, "row: expected at most 4 cells"),
        ("name,m,n,k\n,1,2,3\n", 2, "name: expected a non-empty label"),
        ("name,m,n,k,schemes\nbad,1,2,3,rowcolx\n", 2, "scheme: expected one of"),
        ("name,m,n,k,cases\nbad,1,2,3,rowcol:i8xfp8:rcr\n", 2, "a, b: expected a legal operand pair"),
        ("name,m,n,k,cases\nbad,1,2,3,rowcol:i8xi8:xyz\n", 2, "case layout: expected one of"),
    ],
)
def test_malformed_suite_names_file_and_line(tmp_path, text, line, match):
    p = tmp_path / "broken.csv"
    p.write_text(text)
    with pytest.raises(SuiteError, match=rf"broken\.csv, line {line}: {match}"):
        load_suite(str(p))


def test_empty_and_unknown_suites(tmp_path):
    p = tmp_path / "empty.csv"
    p.write_text("# nothing\n")
    with pytest.raises(SuiteError, match="empty.csv: expected a header line"):
        load_suite(str(p))
    p.write_text("name,m,n,k\n")
    with pytest.raises(SuiteError, match="expected at least one shape"):
        load_suite(str(p))
    with pytest.raises(SuiteError, match="suite: expected a built-in suite .* got 'nope' \\(no such file\\)"):
        load_suite("nope")
    assert issubclass(SuiteError, ShapeError) and issubclass(SuiteError, ValueError)


# ----------------------------------------------------------------------------- cases


def test_cases():
    assert [c.name for c in HEADLINE] == [
        "rowcol:i8xi8:rcr", "tensor:fp8xfp8:rcr", "rowcol:fp8xfp8:rcr", "aquant:fp8xfp8:rcr",
        "abquant:fp8xfp8:rcr", "bquant:fp8xi4:rcr", "bquant:bf16xi4:rcr",
    ]
    ck = aquant28()
    assert len(ck) == 28 and sum(c.name.endswith(":preshuffled") for c in ck) == 12
    assert parse_case_list("headline,aquant:i4xfp8:crr:preshuffled")[-1].name == "aquant:i4xfp8:crr:preshuffled"
    for bad, err, match in [
        ("rowcol", ShapeError, "case: expected scheme:AxB:layout"),
        ("rowcol:i8xi8:rcr:preshuffled", UnsupportedError, "only with aquant or abquant"),
        ("nope:i8xi8:rcr", UnsupportedError, "scheme: expected one of"),
    ]:
        with pytest.raises(err, match=match):
            parse_case(bad)
    odd = parse_case("aquant:i4xfp8:crr")
    assert "packs pairs along M: M=7 is odd" in odd.unsupported_reason(7, 64, 128)
    assert odd.unsupported_reason(8, 64, 128) is None
    assert "along K" in parse_case("bquant:fp8xi4:rcr").unsupported_reason(1, 64, 129)


# ----------------------------------------------------------------------------- gate


def _ref():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(8, 16, generator=g) * 3).to(torch.bfloat16)


def test_gate_accepts_a_close_result():
    ref = _ref()
    res = gate(ref.float() * (1 + 1e-3), ref)
    assert res.ok and res.rel_err < REL_TOL and res.reason == ""


def test_gate_catches_a_planted_wrong_value():
    ref = _ref()
    out = ref.clone()
    out[3, 5] += 0.1 * ref.float().abs().max().to(out.dtype)
    res = gate(out, ref)
    assert not res.ok and res.rel_err > REL_TOL and "max error" in res.reason


def test_gate_catches_all_zero_and_partly_zero_results():
    ref = _ref()
    res = gate(torch.zeros_like(ref), ref)
    assert not res.ok and "output is all zero" in res.reason
    out = ref.clone()
    out[2:4] = 0  # two rows never computed
    res = gate(out, ref)
    assert not res.ok and "are zero where |expected| > 0.02 x max|expected|" in res.reason
    assert res.rel_err > REL_TOL or "non-zero values" in res.reason


def test_gate_tolerates_exact_cancellation_inside_the_band():
    # Measured on an H200: exact zeros on one side only, for outputs far below max|expected|.
    ref = _ref().float()
    ref[0, 0] = 0.0
    ref[1, 1] = 1e-4
    out = ref.clone()
    out[0, 0] = 1e-9  # split-K partials scaled before their sum
    out[1, 1] = 0.0  # an fp8 sum that cancelled exactly
    assert gate(out, ref).ok
    out[1, 2] = 0.0  # a value well outside the band lost
    assert not gate(out, ref).ok


def test_gate_catches_nan_left_by_poisoning():
    ref = _ref()
    out = poisoned(8, 16, torch.bfloat16, "cpu")
    out[:, :15] = ref[:, :15]  # one column never written
    res = gate(out, ref)
    assert not res.ok and "8 of 128 outputs are NaN/inf" in res.reason
    assert torch.isnan(poisoned(2, 2, torch.float32, "cpu")).all()


def test_gate_other_refusals():
    ref = _ref()
    assert "expected shape (8, 16)" in gate(ref[:4], ref).reason
    assert "all zeros" in gate(ref, torch.zeros_like(ref)).reason
    raw = torch.randint(-100, 100, (4, 4), dtype=torch.int32)
    sentinel = poisoned(4, 4, torch.int32, "cpu")
    assert "poison value" in gate(sentinel, raw).reason
    assert gate(raw.clone(), raw).ok


def test_sqnr():
    x = torch.randn(100, dtype=torch.float64)
    assert math.isinf(sqnr_db(x, x))
    assert abs(sqnr_db(x * 1.1, x) - 20.0) < 1e-6  # noise = 0.1 x signal -> 20 dB


# ----------------------------------------------------------------------------- registry


def test_registry_on_cpu():
    cpu = torch.device("cpu")
    names = [i.name for i in REGISTRY]
    assert names[0] == "tileq" and len(set(names)) == len(names)
    rowcol = parse_case("rowcol:i8xi8:rcr")
    assert BY_NAME["torch_int_mm_dequant"].unavailable(rowcol, 1, 64, 128, cpu) == "needs CUDA"
    assert BY_NAME["torch_scaled_mm_rowwise"].unavailable(rowcol, 1, 64, 128, cpu).startswith("fp8")
    assert BY_NAME["torch_bf16_matmul"].unavailable(rowcol, 1, 64, 128, cpu) is None
    cuda = torch.device("cuda")
    assert "multiple of 8" in BY_NAME["torch_int_mm"].unavailable(rowcol, 32, 60, 128, cuda)
    assert "nn.Linear layout" in BY_NAME["torch_int_mm"].unavailable(parse_case("rowcol:i8xi8:rrr"), 32, 64, 128, cuda)
    for peer in ("vllm_cutlass_scaled_mm", "deep_gemm_fp8", "torchao"):
        why = BY_NAME[peer].unavailable(rowcol, 1, 64, 128, cpu)
        assert why  # never silently applicable on CPU
    assert "reference" not in [i.name for i in select(None)]
    assert [i.name for i in select(["reference"])] == ["tileq", "reference"]
    with pytest.raises(UnsupportedError, match="baselines: expected names from"):
        select(["cublas_magic"])


# ----------------------------------------------------------------------------- outputs


def _row(shape, m, case, impl, kind, t=None, status=R.OK, **kw):
    flops = 2 * m * 256 * 512
    return R.Result(suite="syn", shape=shape, m=m, n=256, k=512, case=case, scheme=case.split(":")[0],
                    dtypes=case.split(":")[1], layout="rcr", impl=impl, kind=kind, status=status,
                    time_ms=t, time_min_ms=t, runs=100 if t else None,
                    tflops=flops / (t * 1e-3) / 1e12 if t else None,
                    tbps=1e6 / (t * 1e-3) / 1e12 if t else None, bytes=1_000_000,
                    rel_err=0.004, sqnr_db=30.0, **kw)


def synthetic_rows(scale=1.0):
    rows = []
    for shape, m in (("p", 1), ("p", 16), ("p", 4096), ("q", 16)):
        case = "rowcol:i8xi8:rcr"
        rows += [
            _row(shape, m, case, "tileq", "tileq", 0.010 * m**0.5 * scale),
            _row(shape, m, case, "torch_bf16_matmul", "unquantized", 0.020 * m**0.5),
            _row(shape, m, case, "torch_int_mm_dequant", "unfused", 0.011 * m**0.5),
            _row(shape, m, case, "torch_int_mm", "raw", 0.008 * m**0.5),
            _row(shape, m, case, "torch_scaled_mm_rowwise", "fused", status=R.NA,
                 note="fp8 (e4m3 x e4m3) row-wise scaling only"),
        ]
        case = "bquant:fp8xi4:rcr"
        rows += [
            _row(shape, m, case, "tileq", "tileq", 0.006 * m**0.5 * scale),
            _row(shape, m, case, "torch_bf16_matmul", "unquantized", 0.020 * m**0.5),
            _row(shape, m, case, "torch_dequant_matmul", "unfused", 0.05 * m**0.5),
        ]
    rows.append(_row("q", 64, "bquant:fp8xi4:rcr", "tileq", "tileq", status=R.FAIL,
                     note="max error 0.5 of max|expected| is not below 0.02"))
    return rows


def test_csv_round_trip(tmp_path):
    rows = synthetic_rows()
    path = tmp_path / "results.csv"
    R.write_csv(rows, path)
    back = R.read_csv(path)
    assert len(back) == len(rows)
    assert back[0].time_ms == pytest.approx(rows[0].time_ms, rel=1e-5)
    assert back[4].status == R.NA and back[4].time_ms is None and back[4].note.startswith("fp8")
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ShapeError, match="missing suite"):
        R.read_csv(bad)


def test_compare_finds_regressions():
    old = synthetic_rows()
    changes, notes = R.compare_runs(old, synthetic_rows(), threshold=0.05)
    assert changes == [] and notes[0].startswith("8 tileq rows compared")
    changes, _ = R.compare_runs(old, synthetic_rows(scale=1.2), threshold=0.05)
    assert len(changes) == 8 and all(c.change == pytest.approx(0.2) for c in changes)
    # Relative metric: a uniformly slower GPU (everything 1.3x) is not a regression...
    slow = synthetic_rows()
    for r in slow:
        if r.time_ms:
            r.time_ms *= 1.3
    assert R.compare_runs(old, slow)[0] == []
    # ... but it is when absolute times are compared.
    assert len(R.compare_runs(old, slow, metric="absolute")[0]) == 8
    assert "+20.0%" in R.format_changes(changes)


def test_report_markdown():
    text = render(synthetic_rows(), title="syn", env={"device": "a GPU"}, method="median of 100",
                  operands="seeded", command="tileq bench --suite syn")
    assert "## rowcol:i8xi8:rcr" in text and "## bquant:fp8xi4:rcr" in text
    # tileq 0.010 vs torch_int_mm_dequant 0.011 -> 1.10x, within ±15%; torch_int_mm (raw) and
    # bf16 matmul (unquantized) are never "the best baseline".
    assert "| rowcol:i8xi8:rcr | 4 | 4 | 1.10× | 100% | 0% | 0% | 0 | 2.00× |" in text
    assert "| bquant:fp8xi4:rcr | 5 | 4 | 8.33× | 0% | 100% | 0% | 0 | 3.33× |" in text
    assert "fp8 (e4m3 x e4m3) row-wise scaling only" in text
    assert "Worst" in text and "## Failures and errors" in text and "not below 0.02" in text
    cpu_rows = [R.Result(**{**r.__dict__, "status": R.NOT_MEASURED, "time_ms": None})
                for r in synthetic_rows()]
    cpu = render(cpu_rows, title="cpu", env={}, method="correctness only", operands="seeded")
    assert "Timings need a GPU" in cpu and "median speedup" not in cpu


def test_plots(tmp_path):
    from tileq.bench.plots import write_plots
    from tileq.bench.timing import Ceilings

    pytest.importorskip("matplotlib")
    ceil = Ceilings(copy_tbps=4.0, peak_tflops={"int8": 900.0, "fp8": 1200.0})
    names, note = write_plots(synthetic_rows(), str(tmp_path), ceil, "syn")
    assert note is None
    assert names == ["rowcol_i8xi8_rcr.png", "bquant_fp8xi4_rcr.png", "speedup.png"]
    for n in names:
        with open(tmp_path / n, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_without_timings(tmp_path):
    from tileq.bench.plots import write_plots

    pytest.importorskip("matplotlib")  # (without it the note says so first: the test below)
    names, note = write_plots([R.Result(**{**r.__dict__, "status": R.NOT_MEASURED})
                               for r in synthetic_rows()], str(tmp_path))
    assert names == [] and "timings need a GPU" in note


def test_plots_without_matplotlib(tmp_path, monkeypatch):
    from tileq.bench.plots import write_plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError, installed or not
    names, note = write_plots(synthetic_rows(), str(tmp_path))
    assert names == [] and "matplotlib is not installed" in note


def test_progress_bar():
    s = io.StringIO()
    p = Progress(40, title="t", stream=s)
    for i in range(40):
        p.advance(f"item {i}")
    p.close()
    lines = s.getvalue().splitlines()
    assert 15 <= len(lines) <= 22  # about every 5%, not every item
    assert lines[-1].startswith("t [############################] 40/40 100%")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    s = Tty()
    p = Progress(3, stream=s)
    for _ in range(3):
        p.advance()
    p.close()
    assert s.getvalue().count("\r") == 3 and s.getvalue().endswith("\n")


# ----------------------------------------------------------------------------- end to end


def test_bench_smoke_end_to_end(tmp_path, capsys):
    out = tmp_path / "smoke"
    rc = tileq.cli.main(["bench", "--suite", "smoke", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "timings need a GPU" in captured.err
    rows = R.read_csv(out / "results.csv")
    tq = [r for r in rows if r.impl == "tileq"]
    assert len(tq) == len({(r.shape, r.m, r.case) for r in tq}) >= 35
    assert all(r.status == R.NOT_MEASURED and r.time_ms is None for r in tq)
    assert all(r.rel_err < REL_TOL and r.sqnr_db > 10 for r in tq)
    assert {r.status for r in rows if r.impl == "torch_scaled_mm_tensor" and r.case == "tensor:fp8xfp8:rcr"} == {R.NA}
    report = (out / "report.md").read_text()
    assert "Timings need a GPU" in report and "## bquant:bf16xi4:rcr" in report
    assert (out / "env.json").exists()


def test_bench_planted_wrong_kernel_fails(tmp_path, monkeypatch, capsys):
    from tileq.bench.cases import Operands

    real = Operands.gemm

    def wrong(self, **kw):
        y = real(self, **kw)
        if kw.get("backend") == "triton":
            y[0, 0] = y[0, 0] * 3 + 1  # one wrong element
        return y

    monkeypatch.setattr(Operands, "gemm", wrong)
    rc = tileq.cli.main(["bench", "--suite", "smoke", "--shapes", "gemv", "--cases", "rowcol:i8xi8:rcr",
                         "--out", str(tmp_path), "--no-progress"])
    assert rc == 1
    assert "FAILED the correctness gate" in capsys.readouterr().err
    (row,) = [r for r in R.read_csv(tmp_path / "results.csv") if r.impl == "tileq"]
    assert row.status == R.FAIL and "max error" in row.note


def test_bench_cli_errors(tmp_path, capsys):
    p = tmp_path / "bad.csv"
    p.write_text("name,m,n,k\nx,1,2,zz\n")
    assert tileq.cli.main(["bench", "--suite", str(p), "--out", str(tmp_path)]) == 2
    assert "bad.csv, line 2: k: expected a positive integer, got 'zz'" in capsys.readouterr().err
    assert tileq.cli.main(["bench", "--suite", "smoke", "--cases", "rowcol:i8", "--out", str(tmp_path)]) == 2
    assert tileq.cli.main(["bench", "--list"]) == 0
    assert "ck28" in capsys.readouterr().out


def test_bench_compare_cli(tmp_path, capsys):
    old = tmp_path / "old.csv"
    R.write_csv(synthetic_rows(), old)
    rc = tileq.cli.main(["bench", "--suite", "smoke", "--shapes", "gemv", "--cases", "rowcol:i8xi8:rcr",
                         "--out", str(tmp_path / "new"), "--no-progress", "--compare", str(old)])
    out = capsys.readouterr().out
    assert rc == 0 and "0 tileq rows compared" in out and "no regressions" in out
    assert os.path.exists(tmp_path / "new" / "report.md")


def test_render_folder_again(tmp_path, capsys):
    out = tmp_path / "run"
    assert tileq.cli.main(["bench", "--suite", "smoke", "--shapes", "gemv", "--out", str(out),
                           "--no-progress"]) == 0
    (out / "report.md").unlink()
    assert tileq.cli.main(["bench", "--render", str(out)]) == 0
    assert "## rowcol:i8xi8:rcr" in (out / "report.md").read_text()
    assert tileq.cli.main(["bench", "--render", str(tmp_path / "missing")]) == 2


def test_precompile_plans_each_distinct_kernel_once():
    from tileq.bench.precompile import kernel_jobs

    items = [(s, c) for s in load_suite("llm-decode") for c in s.cases_to_run(HEADLINE)]
    jobs = kernel_jobs(items, torch.device("cpu"))  # planned for sm_90, as the interpreter does
    assert 0 < len(jobs) < len(items) and len(set(jobs)) == len(jobs)
    assert {parse_case(j[0]) for j in jobs} == set(HEADLINE)


def test_rows_keep_their_shape_names_when_dimensions_repeat(tmp_path):
    suite = tmp_path / "twins.csv"
    suite.write_text("name,m,n,k\nfirst,16,64,128\nsecond,16,64,128\n")
    out = tmp_path / "out"
    assert tileq.cli.main(["bench", "--suite", str(suite), "--cases", "rowcol:i8xi8:rcr,tensor:fp8xfp8:rcr",
                           "--out", str(out), "--no-progress"]) == 0
    bf16 = [(r.shape, r.case) for r in R.read_csv(out / "results.csv") if r.impl == "torch_bf16_matmul"]
    assert sorted(bf16) == sorted((s, c) for s in ("first", "second")
                                  for c in ("rowcol:i8xi8:rcr", "tensor:fp8xfp8:rcr"))


def test_every_shipped_suite_file_is_registered_and_loads():
    from importlib import resources

    from tileq.bench.suites import BUILTIN_SUITES, load_suite

    shipped = sorted(f.name[:-4] for f in resources.files("tileq.bench").joinpath("suites").iterdir()
                     if f.name.endswith(".csv"))
    assert shipped == sorted(BUILTIN_SUITES)
    for name in shipped:
        assert load_suite(name), name


def test_fast_accumulation_cases():
    import pytest as _pytest

    from tileq.bench.cases import parse_case
    from tileq.errors import UnsupportedError

    case = parse_case("rowcol:fp8xfp8:rcr:fast")
    assert case.fast_accum and case.name == "rowcol:fp8xfp8:rcr:fast"
    with _pytest.raises(UnsupportedError, match="':fast' only with fp8/bf8 tensor or rowcol"):
        parse_case("abquant:fp8xfp8:rcr:fast")
    with _pytest.raises(UnsupportedError, match="':fast' only"):
        parse_case("rowcol:i8xi8:rcr:fast")


def test_host_overhead_helpers():
    import torch as _torch

    from tileq.bench.overhead import host_us_per_call
    from tileq.cli import main

    calls = []
    us = host_us_per_call(lambda: calls.append(1), calls=100, warmup=5)
    assert len(calls) == 105 and 0 < us < 1e4
    if not _torch.cuda.is_available():
        assert main(["overhead"]) == 2  # refused with a message: it needs a GPU


def test_dispatcher_check_section_counts_losses():
    from tileq.bench.report import _dispatcher_check, group_by_case

    rows = [
        _row("a", 16, "rowcol:i8xi8:rcr", "tileq", "tileq", t=1.0),
        _row("a", 16, "rowcol:i8xi8:rcr", "tileq_prefill", "pipeline", t=2.0),
        _row("b", 48, "rowcol:i8xi8:rcr", "tileq", "tileq", t=1.0),
        _row("b", 48, "rowcol:i8xi8:rcr", "tileq_prefill", "pipeline", t=0.5),
    ]
    text = "\n".join(_dispatcher_check(group_by_case(rows)))
    assert "| rowcol:i8xi8:rcr | 2 | 1 | 0.50× at M=48" in text
    # The forced-prefill row is no baseline: it never becomes "the best baseline".
    from tileq.bench.report import best_baseline

    assert best_baseline({r.impl: r for r in rows[:2]}) is None


def test_timing_flush_modes():
    from tileq.bench.timing import FLUSH_MODES, TimingConfig

    assert FLUSH_MODES == ("read", "write", "none") and TimingConfig().flush == "read"
    with pytest.raises(ValueError, match="flush: expected one of read, write, none"):
        TimingConfig(flush="zero")


# ----------------------------------------------------------------------------- --impls, --gluon-tilings, --rounds


def test_report_by_m_range_and_int_mm_alone():
    """Per M range and model: tileq against the best baseline and, for int8, against torch._int_mm
    alone (the medians a deleted gluon_report.py script gave); cases without a timed
    torch._int_mm get no row in that table."""
    from tileq.bench.report import _by_range, group_by_case

    rows = []
    int8, fp8 = "rowcol:i8xi8:rcr", "rowcol:fp8xfp8:rcr"
    for m, vs_base, vs_raw in ((1024, 2.5, 1.2), (4096, 3.0, 1.4), (8192, 2.8, 1.5), (128, 2.0, 1.0)):
        rows += [_row("qwen3-14b.q_o", m, int8, "tileq", "tileq", 1.0),
                 _row("qwen3-14b.q_o", m, int8, "torch_int_mm_dequant", "unfused", vs_base),
                 _row("qwen3-14b.q_o", m, int8, "torch_int_mm", "raw", vs_raw),
                 _row("llama3-8b.o", m, fp8, "tileq", "tileq", 1.0),
                 _row("llama3-8b.o", m, fp8, "torch_scaled_mm_rowwise", "fused", 0.9)]
    text = "\n".join(_by_range(group_by_case(rows)))
    best, raw = text.split("## By M range and model: tileq vs torch._int_mm alone")
    assert "| case | M | all shapes | qwen3-14b | llama3-8b |" in best
    assert f"| {int8} | > 512 | 2.80× (2.50–3.00, n=3) | 2.80× (n=3) | – |" in best
    assert f"| {int8} | 65-512 | 2.00× (2.00–2.00, n=1) |" in best
    assert f"| {fp8} | > 512 | 0.90× (0.90–0.90, n=3) | – | 0.90× (n=3) |" in best
    assert f"| {int8} | > 512 | 1.40× (1.20–1.50, n=3) |" in raw and fp8 not in raw
    no_raw = [r for r in rows if r.impl != "torch_int_mm"]
    assert "_int_mm alone" not in "\n".join(_by_range(group_by_case(no_raw)))


def test_report_variants_section():
    rows = synthetic_rows()
    case = "rowcol:i8xi8:rcr"
    rows += [_row("p", 4096, case, "tileq_triton", "variant", 0.010 * 64 * 1.25),
             _row("p", 4096, case, "tileq_gluon:128", "variant", 0.010 * 64 / 1.25),
             _row("p", 4096, case, "tileq_gluon:64", "variant", status=R.NA, note="x")]
    text = render(rows, title="syn", env={}, method="m", operands="o")
    assert "## tileq forced onto one kernel or tiling" in text
    assert f"| {case} | > 512 | tileq_triton | 1 | 0.80× (0.80–0.80, n=1) | 0.88× (0.88–0.88, n=1) |" in text
    assert f"| {case} | > 512 | tileq_gluon:128 | 1 | 1.25× (1.25–1.25, n=1) |" in text
    assert "tileq_gluon:64 |" not in text.split("## tileq forced")[1].split("## ")[0]  # not timed
    assert "## tileq forced" not in render(synthetic_rows(), title="syn", env={}, method="m", operands="o")


def test_forced_variants_count_as_tileq_failures():
    from tileq.bench.harness import tileq_failures

    rows = [_row("p", 16, "rowcol:i8xi8:rcr", "tileq_gluon:128", "variant", status=R.FAIL),
            _row("p", 16, "rowcol:i8xi8:rcr", "tileq_prefill", "pipeline", status=R.FAIL),
            _row("p", 16, "rowcol:i8xi8:rcr", "torch_int_mm", "raw", status=R.ERROR)]
    assert [r.impl for r in tileq_failures(rows)] == ["tileq_gluon:128"]


def test_timing_rounds_combine():
    from tileq.bench.timing import Timing, combine_rounds

    t = combine_rounds([Timing(1.0, 0.9, 10, "CUDA graph"), Timing(3.0, 0.8, 10, "CUDA graph"),
                        Timing(2.0, 0.95, 10, "CUDA graph")])
    assert (t.median_ms, t.min_ms, t.runs, t.note) == (2.0, 0.8, 30, "CUDA graph; 3 rounds")
    one = Timing(1.0, 0.9, 10)
    assert combine_rounds([one]) is one


def test_bench_impls_and_gluon_tilings_on_cpu(tmp_path, capsys):
    """On CPU: tileq_triton (the plan forced onto the portable kernel) is gated through the
    interpreter; the Gluon kernel and its tilings are N/A with the plan's reason, one row per
    candidate tiling where the kernel serves the problem (prefill), one N/A row where not."""
    out = tmp_path / "run"
    rc = tileq.cli.main(["bench", "--suite", "smoke", "--shapes", "gemv|prefill", "--cases",
                         "rowcol:fp8xfp8:rcr,abquant:fp8xfp8:rcr,bquant:fp8xi4:rcr", "--impls", "triton,gluon",
                         "--gluon-tilings", "--rounds", "3", "--baselines", "torch_bf16_matmul",
                         "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    rows = R.read_csv(out / "results.csv")
    by = {(r.shape, r.case, r.impl): r for r in rows}
    for case in ("rowcol:fp8xfp8:rcr", "abquant:fp8xfp8:rcr", "bquant:fp8xi4:rcr"):
        for shape in ("smoke.gemv", "smoke.prefill"):
            t, tri = by[(shape, case, "tileq")], by[(shape, case, "tileq_triton")]
            assert tri.kind == "variant" and tri.status == R.NOT_MEASURED and tri.rel_err < REL_TOL
            assert tri.kernel == t.kernel and "the plan runs the portable kernel itself" in tri.note
            assert by[(shape, case, "tileq_gluon")].status == R.NA
    assert "interpreter" in by[("smoke.prefill", "rowcol:fp8xfp8:rcr", "tileq_gluon")].note
    tilings = {case: [r.impl for r in rows if r.shape == "smoke.prefill" and r.case == case
                      and r.impl.startswith("tileq_gluon") and r.impl != "tileq_gluon"]
               for case in ("rowcol:fp8xfp8:rcr", "abquant:fp8xfp8:rcr", "bquant:fp8xi4:rcr")}
    assert tilings["rowcol:fp8xfp8:rcr"] == ["tileq_gluon:128", "tileq_gluon:64"]
    assert tilings["abquant:fp8xfp8:rcr"] == ["tileq_gluon:128", "tileq_gluon:64", "tileq_gluon:256"]
    assert tilings["bquant:fp8xi4:rcr"] == ["tileq_gluon_tilings"]  # int4: not the Gluon kernel's
    assert "8-bit rcr prefill only" in by[("smoke.prefill", "bquant:fp8xi4:rcr", "tileq_gluon_tilings")].note
    assert "prefill only" in by[("smoke.gemv", "rowcol:fp8xfp8:rcr", "tileq_gluon_tilings")].note
    forced = [r for r in rows if r.impl.startswith("tileq_gluon:")]
    assert len(forced) == 5 and all(r.status == R.NA and "Gluon needs a GPU" in r.note for r in forced)
    assert "## tileq forced" not in (out / "report.md").read_text()  # nothing timed on CPU
    assert tileq.cli.main(["bench", "--suite", "smoke", "--impls", "cuda", "--out", str(tmp_path)]) == 2
    assert "impls: expected names from gluon, triton, deep, got cuda" in capsys.readouterr().err
    assert tileq.cli.main(["bench", "--suite", "smoke", "--rounds", "0", "--out", str(tmp_path)]) == 2


def _gemv_variant_rows(tmp_path, capsys, impl: str) -> dict:
    """The smoke suite's gemv shape, int8 rowcol, fp8 block-scaled and prepacked int4, with
    ``--impls impl`` beside the plan: its rows by (case, impl)."""
    out = tmp_path / impl
    rc = tileq.cli.main(["bench", "--suite", "smoke", "--shapes", "gemv", "--cases",
                         "rowcol:i8xi8:rcr,abquant:fp8xfp8:rcr,bquant:bf16xi4p:rcr", "--impls", impl,
                         "--baselines", "tileq", "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    return {(r.case, r.impl): r for r in R.read_csv(out / "results.csv")}


def test_bench_deep_variant_on_cpu(tmp_path, capsys):
    """--impls deep: the plan's portable config with as many stages as one program's shared
    memory holds (gated through the interpreter; its kernel name says the stages), N/A where the
    plan's stages are already the most (a prepacked int4 weight: its own kernels)."""
    from tileq.bench.variants import deepest_stages
    from tileq.catalog.families import family_spec
    from tileq.catalog.names import parse_family
    from tileq.device import get_arch
    from tileq.kernels.config import TileConfig

    by = _gemv_variant_rows(tmp_path, capsys, "deep")
    for case in ("rowcol:i8xi8:rcr", "abquant:fp8xfp8:rcr"):
        deep, plan = by[(case, "tileq_deep")], by[(case, "tileq")]
        assert deep.rel_err < REL_TOL and "_s8_" in deep.kernel and "_s4_" in plan.kernel, (deep, plan)
    assert by[("bquant:bf16xi4p:rcr", "tileq_deep")].status == R.NA
    arch = get_arch("sm_90")
    spec = family_spec(parse_family("rowcol_i8xi8_rcr_decode"), 1, 5120, 5120)
    assert deepest_stages(spec, TileConfig(64, 16, 256, 4, 4, swap_ab=True), arch) == 8  # 160 KB
    assert deepest_stages(spec, TileConfig(64, 16, 512, 4, 4, swap_ab=True), arch) == 5  # 5 x 40 KB


def test_gluon_prefill_suite():
    shapes = load_suite("gluon-prefill")
    assert len({(s.n, s.k) for s in shapes}) == 11 and len(shapes) == 77
    assert sorted({s.m for s in shapes}) == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert [c.name for c in parse_case_list("gluon")] == [
        "rowcol:fp8xfp8:rcr", "rowcol:fp8xfp8:rcr:fast", "abquant:fp8xfp8:rcr", "rowcol:i8xi8:rcr", "bquant:fp8xfp8:rcr"]


# ----------------------------------------------------------------------------- prepacked int4, --int4-variants


def test_prepacked_int4_cases():
    """B type i4p: a prepacked int4 weight (tileq.PrepackedInt4) in the nn.Linear layout; the case
    computes the same product as its pk_int4 twin (whose reference it shares)."""
    case = parse_case("bquant:bf16xi4p:rcr")
    assert case.prepacked and case.b is OperandType.I4 and case.name == "bquant:bf16xi4p:rcr"
    assert case.dtypes == "bf16xi4p" and case.spec(16, 64, 256) == parse_case("bquant:bf16xi4:rcr").spec(16, 64, 256)
    assert case.prepacked_kinds == ("bf16", "none", "group")
    assert parse_case("bquant:fp8xi4p:rcr").prepacked_kinds == ("fp8", "vector", "group")
    assert parse_case("rowcol:fp16xi4p:rcr").prepacked_kinds == ("fp16", "none", "vector")
    assert parse_case("tensor:bf8xi4p:rcr").prepacked_kinds == ("bf8", "scalar", "scalar")
    assert [c.name for c in parse_case_list("int4")] == [
        "bquant:bf16xi4p:rcr", "bquant:fp8xi4p:rcr", "rowcol:i8xi8:rcr", "rowcol:fp8xfp8:rcr"]
    for bad, match in [("bquant:bf16xi4p:rrr", "layout rcr"), ("bquant:bf16xi4p:rcr:fast", "layout rcr"),
                       ("bquant:i8xi4p:rcr", "bf16, fp16, fp8 or bf8 activations"),
                       ("aquant:fp8xi4p:rcr", "bquant .group scales., rowcol")]:
        with pytest.raises(ValueError, match=match):
            parse_case(bad)


def test_int4_suite():
    shapes = load_suite("int4")
    assert len({(s.n, s.k) for s in shapes}) == 22 and len(shapes) == 22 * 11
    assert sorted({s.m for s in shapes}) == [1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert {s.name.split(".")[0] for s in shapes} == {"llm", "untuned", "fresh", "tails"}
    assert all(s.k % 128 == 0 and s.n % 128 == 0 for s in shapes)  # (whole groups; K padded to 512 by the layout)


def test_int4_variants_cover_every_plan():
    """What --int4-variants times holds the plan's own choice on every problem of the int4 suite
    (without adding it), whatever the SM count: a replay with the shipped thresholds measures it."""
    from tileq.bench import int4 as I

    shapes = [s for s in load_suite("int4") if s.name.startswith(("llm.", "tails."))]
    for sms in (132, 78):
        for name in ("bquant:bf16xi4p:rcr", "bquant:fp8xi4p:rcr", "rowcol:bf16xi4p:rcr"):
            case = parse_case(name)
            for s in shapes:
                plan = I.plan_of(case, s.m, s.n, s.k, num_sms=sms)
                assert plan.facts.num_sms == sms
                made = I.variants(plan, with_plan=False)
                assert I.variant_name(plan) in made, (name, s.label, sms, I.variant_name(plan))
                assert all(v.startswith(("decode:", "gluon:")) or v in ("fp8-gemm", "dequant+cublas") for v in made)


def test_bench_prepacked_int4_and_its_variants_on_cpu(tmp_path, capsys):
    """On CPU: the prepacked cases' tileq row runs tileq.linear on the PrepackedInt4 (the plan's
    kernel named), gated through the interpreter; --int4-variants adds one gated row per decode
    config (the plan's choice marked) and N/A rows for the Gluon kernel's tilings; cases that are
    not prepacked get one N/A row, and the pipeline / --impls rows are N/A on prepacked ones."""
    from tileq.bench import int4 as I

    out = tmp_path / "run"
    rc = tileq.cli.main(["bench", "--suite", "smoke", "--shapes", "gemv|prefill", "--cases",
                         "bquant:bf16xi4p:rcr,bquant:fp8xi4p:rcr,rowcol:i8xi8:rcr", "--int4-variants",
                         "--impls", "triton", "--baselines", "tileq_prefill,torch_bf16_matmul,torch_dequant_matmul",
                         "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    rows = R.read_csv(out / "results.csv")
    by = {(r.shape, r.case, r.impl): r for r in rows}
    for case in ("bquant:bf16xi4p:rcr", "bquant:fp8xi4p:rcr"):
        for shape in ("smoke.gemv", "smoke.prefill"):
            t = by[(shape, case, "tileq")]
            assert t.status == R.NOT_MEASURED and t.rel_err < REL_TOL and "xi4p_rcr_decode__" in t.kernel
            assert by[(shape, case, "torch_dequant_matmul")].status == R.NOT_MEASURED
            for impl in ("tileq_prefill", "tileq_triton"):
                assert by[(shape, case, impl)].status == R.NA
            forced = [r for r in rows if r.shape == shape and r.case == case and r.impl.startswith(I.PREFIX)]
            decode = [r for r in forced if r.impl.startswith(I.PREFIX + "decode:")]
            assert decode and all(r.status == R.NOT_MEASURED and r.rel_err < REL_TOL and r.kind == "variant"
                                  for r in decode)
            chosen = [r for r in decode if "the plan's choice" in r.note]
            assert len(chosen) == 1 and chosen[0].kernel == t.kernel
            assert all(r.kernel.endswith("_sm90") and r.impl.split(":")[2] in r.kernel for r in decode)
            gluon = [r for r in forced if r.impl.startswith(I.PREFIX + "gluon:")]
            assert all(r.status == R.NA and "needs a GPU" in r.note for r in gluon)
            assert bool(gluon) == (shape == "smoke.prefill")  # (from INT4_PREFILL_MIN_M = 33)
    gemv = [r.impl for r in rows if r.shape == "smoke.gemv" and r.case == "bquant:bf16xi4p:rcr"
            and r.impl.startswith(I.PREFIX)]
    assert len(gemv) == 4  # K = 256 splits nothing: three bands and stream-K
    w4a8 = [r.impl for r in rows if r.shape == "smoke.prefill" and r.case == "bquant:fp8xi4p:rcr"]
    assert any(v.endswith(":cast") for v in w4a8) and any(v.endswith(":fused") for v in w4a8)
    assert by[("smoke.gemv", "rowcol:i8xi8:rcr", I.NA_NAME)].status == R.NA
    assert "tileq_int4:<variant>" in (tileq.cli.main(["bench", "--list"]) == 0 and capsys.readouterr().out)


def test_report_prepacked_int4_against_int8_fp8_and_bf16():
    rows = []
    for m, (i4, i8, f8, bf) in {1: (1.0, 2.0, 1.5, 3.0), 4096: (2.0, 1.0, 1.0, 2.2)}.items():
        rows += [_row("llm.w", m, "bquant:bf16xi4p:rcr", "tileq", "tileq", i4),
                 _row("llm.w", m, "bquant:bf16xi4p:rcr", "torch_bf16_matmul", "unquantized", bf),
                 _row("llm.w", m, "rowcol:i8xi8:rcr", "tileq", "tileq", i8),
                 _row("llm.w", m, "rowcol:fp8xfp8:rcr", "tileq", "tileq", f8)]
    text = render(rows, title="syn", env={}, method="m", operands="o")
    int8 = text.split("## Prepacked int4 against tileq int8 rowcol")[1].split("## ")[0]
    assert "| bquant:bf16xi4p:rcr | 1-64 | 2.00× (2.00–2.00, n=1) | 2.00× (n=1) |" in int8
    assert "| bquant:bf16xi4p:rcr | > 512 | 0.50× (0.50–0.50, n=1) |" in int8
    assert "| bquant:bf16xi4p:rcr | 1-64 | 1.50×" in text.split("## Prepacked int4 against tileq fp8 rowcol")[1]
    assert "| bquant:bf16xi4p:rcr | > 512 | 1.10×" in text.split("## Prepacked int4 against bf16 cuBLAS")[1]
    assert "## Prepacked int4" not in render(synthetic_rows(), title="syn", env={}, method="m", operands="o")


def test_tools_options_all_have_help():
    """Every option of the bench, replay, sass and e2e commands says what it does."""
    import argparse

    parser = argparse.ArgumentParser(prog="tileq")
    sub = parser.add_subparsers()
    from tileq.bench.cli import register_cli as bench
    from tileq.bench.e2e import register_cli as e2e
    from tileq.bench.replay import register_cli as replay
    from tileq.sass import register_cli as sass

    for register in (bench, replay, sass, e2e):
        register(sub)
    for name, p in sub.choices.items():
        missing = [a.dest for a in p._actions if a.dest != "help" and not a.help]
        assert not missing, (name, missing)

