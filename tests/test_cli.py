"""The ``tileq`` command line through its real entry point (``tileq.cli.main``, and ``python -m
tileq`` where the process matters): help that answers at once and names every option, every
argument checked before any work, refusals that end in one line, the plan here and on the target,
progress without carriage returns in logs."""

from __future__ import annotations

import argparse
import io
import pathlib
import subprocess
import sys
import time

import pytest

import tileq.cli
from tileq import commands
from tileq.cli import build_parser, main

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
EXPLAIN = ["explain", "--scheme", "rowcol", "--a", "int8", "--b", "int8", "--m", "16", "--n", "64", "--k", "256"]


def _run(argv, capsys):
    """(exit status, stdout, stderr) of ``tileq ARGV`` run in this process."""
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# ----------------------------------------------------------------------------- help


def test_help_answers_at_once(capsys):
    """``python -m tileq --help`` (a fresh interpreter) in well under the 2 s bound; measured on the
    dev machine: about 0.1-0.2 s, where importing torch alone takes 2-3 s."""
    for argv in (["--help"], ["explain", "--help"]):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tileq", *argv], capture_output=True, text=True, timeout=60)
        wall = time.perf_counter() - t0
        assert proc.returncode == 0, proc.stderr
        assert "usage: tileq" in proc.stdout
        assert wall < 2.0, f"tileq {' '.join(argv)} took {wall:.2f} s"
    assert main(["--help"]) == 0 and "explain" in capsys.readouterr().out


def test_help_of_every_subcommand_imports_nothing_heavy():
    """The parsers (and every subcommand's --help) import no torch, Triton, transformers or
    kernel module: only a command that runs does."""
    code = (
        "import contextlib, io, sys\n"
        "import tileq.cli as c\n"
        "subs = [a for a in c.build_parser()._actions if hasattr(a, 'choices') and isinstance(a.choices, dict)]\n"
        "for name in subs[0].choices:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert c.main([name, '--help']) == 0, name\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers', 'numpy')\n"
        "               or m.startswith(('tileq.kernels', 'tileq.dispatch', 'tileq.api')))\n"
        "print(len(subs[0].choices), heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(maxsplit=1) == ["15", "[]\n"], proc.stdout


def test_every_option_of_every_subcommand_has_help():
    subs = _subcommands(build_parser())
    assert set(subs) == {"list", "build", "explain", "selftest", "tune", "demo", "bench", "replay", "overhead",
                         "e2e", "layerbench", "sass", "moebench", "tpbench", "loadbench"}
    missing = [f"{name} {a.option_strings[-1] if a.option_strings else a.dest}"
               for name, p in subs.items() for a in p._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, missing
    # the heavy modules' own register_cli (kept for their callers) build the same options
    from tileq.bench import e2e, layers, overhead, replay
    from tileq import tune

    for module, name in ((tune, "tune"), (e2e, "e2e"), (layers, "layerbench"), (overhead, "overhead"),
                         (replay, "replay")):
        sub = argparse.ArgumentParser(prog="tileq").add_subparsers()
        module.register_cli(sub)
        assert [a.dest for a in sub.choices[name]._actions] == [a.dest for a in subs[name]._actions]
        assert sub.choices[name].get_default("func") is not None


def test_value_lists_spelled_out_for_the_parsers_are_the_librarys():
    """tileq.commands and tileq.bench.cli name these values without importing their modules."""
    from tileq.bench import cli as bench_cli
    from tileq.bench import e2e, layers, load, replay, timing
    from tileq.catalog.names import PIPELINES
    from tileq.device import ARCHS
    from tileq.nn.configs import CONFIGS
    from tileq.problem import LAYOUTS, Scheme
    from tileq.tune import CASES

    assert commands.SCHEMES == tuple(s.value for s in Scheme)
    assert commands.LAYOUTS == LAYOUTS
    assert commands.ARCH_NAMES == tuple(ARCHS)
    assert commands.PIPELINES == PIPELINES
    assert commands.TUNE_CASES == tuple(CASES)
    assert bench_cli.FLUSH_MODES == timing.FLUSH_MODES
    assert bench_cli.NN_CONFIGS == tuple(CONFIGS)
    assert e2e.ALL_CONFIGS == ("bf16", *bench_cli.NN_CONFIGS)
    assert bench_cli.E2E_CHECKPOINT_CONFIGS == e2e.CHECKPOINT_CONFIGS
    assert bench_cli.E2E_MODES == e2e.MODES
    assert bench_cli.E2E_PEERS == tuple(e2e.TORCHAO_PEERS)
    assert bench_cli.LAYERBENCH_CONFIGS == layers.CONFIGS
    assert bench_cli.E2E_MODELS == tuple(e2e.MODELS)
    assert bench_cli.LOADBENCH_CONFIGS == load.DEFAULT_CONFIGS
    assert bench_cli.LOADBENCH_TARGETS == (load.PEAK_TARGET, load.TIME_TARGET)
    assert bench_cli.REPLAY_RULES == tuple(replay.RULES)
    assert bench_cli.REPLAY_TOLERANCE == replay.TOLERANCE


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("argv, option", [
    (EXPLAIN + ["--m", "0"], "--m"),
    (EXPLAIN + ["--m", "-3"], "--m"),
    (EXPLAIN + ["--n", "x"], "--n"),
    (EXPLAIN + ["--k", "0"], "--k"),
    (EXPLAIN + ["--group-k", "0"], "--group-k"),
    (["build", "--arch", "sm_90", "--jobs", "0"], "--jobs"),
    (["selftest", "--jobs", "-1"], "--jobs"),
    (["tune", "--out", "t.json", "--reps", "0"], "--reps"),
    (["tune", "--out", "t.json", "--warmup", "-1"], "--warmup"),
    (["tune", "--out", "t.json", "--m", "1,0"], "--m"),
    (["tune", "--out", "t.json", "--nk", "5120"], "--nk"),
    (["tune", "--out", "t.json", "--max-seconds", "0"], "--max-seconds"),
    (["tune", "--out", "t.json", "--jobs", "0"], "--jobs"),
    (["tune", "--out", "t.json", "--cases", "i8_rowcol,nope"], "--cases"),
    (["bench", "--runs", "0"], "--runs"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["bench", "--rounds", "0"], "--rounds"),
    (["bench", "--max-shapes", "0"], "--max-shapes"),
    (["bench", "--m-min", "-1"], "--m-min"),
    (["bench", "--time-budget", "0"], "--time-budget"),
    (["bench", "--time-budget", "nan"], "--time-budget"),
    (["bench", "--precompile-jobs", "-1"], "--precompile-jobs"),
    (["bench", "--threshold", "-0.1"], "--threshold"),
    (["replay", "--sms", "0"], "--sms"),
    (["replay", "--tolerance", "-1"], "--tolerance"),
    (["replay", "--table-margin", "x"], "--table-margin"),
    (["overhead", "--m", "0"], "--m"),
    (["overhead", "--k", "-8"], "--k"),
    (["overhead", "--calls", "0"], "--calls"),
    (["e2e", "--layers", "0"], "--layers"),
    (["e2e", "--batches", "1,0"], "--batches"),
    (["e2e", "--prompt", "0"], "--prompt"),
    (["e2e", "--tokens", "0"], "--tokens"),
    (["layerbench", "--m", "16,x"], "--m"),
    (["layerbench", "--runs", "0"], "--runs"),
    (["layerbench", "--configs", "A8W8,W3A3"], "--configs"),
    (["loadbench", "--layers", "8,0"], "--layers"),
    (["loadbench", "--configs", "A8W8,W3A3"], "--configs"),
    (["loadbench", "--repeats", "0"], "--repeats"),
    (["sass", "rowcol_i8xi8_rcr_prefill", "0"], "m"),
    (["sass", "rowcol_i8xi8_rcr_prefill", "16", "64", "0", "m64n16k256_w4_s4"], "k"),
    (["sass", "--prepacked", "bf16", "16", "--warps", "6"], "--warps"),
    (["sass", "--prepacked", "bf16", "16", "--split-k", "0"], "--split-k"),
])
def test_numeric_options_are_checked_before_any_work(argv, option, capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert _last_line(err).startswith(f"tileq {argv[0]}: error: argument {option}: "), err


def test_parsed_lists(tmp_path):
    args = build_parser().parse_args(["tune", "--out", "t.json", "--m", "1,16", "--nk", "5120x4096,7168x2048",
                                      "--cases", "fp8_rowcol"])
    assert (args.m, args.nk, args.cases) == ([1, 16], [(5120, 4096), (7168, 2048)], ["fp8_rowcol"])
    args = build_parser().parse_args(["layerbench", "--m", "1, 4096", "--configs", "W4A16"])
    assert (args.m, args.configs) == ([1, 4096], ["W4A16"])


def _api_error(**kw) -> str:
    """The message tileq.gemm's own validation gives for a real call (build_problem)."""
    import torch

    from tileq.errors import TileqError
    from tileq.problem import build_problem

    m, n, k = kw.pop("m"), kw.pop("n"), kw.pop("k")
    a = torch.zeros(m, k, dtype=kw.pop("a_dtype"))
    b = torch.zeros(n, k, dtype=kw.pop("b_dtype")).t()  # rcr: B column-major
    with pytest.raises(TileqError) as e:
        build_problem(a, b, kw.pop("a_scale"), kw.pop("b_scale"), **kw)
    return str(e.value)


def test_explain_refuses_what_gemm_refuses_with_gemms_words(capsys):
    import torch

    # int8 x int8 accumulates in int32: K = 131072 can overflow it
    rc, out, err = _run(["explain", "--scheme", "rowcol", "--a", "int8", "--b", "int8", "--m", "1", "--n", "1",
                         "--k", "131072"], capsys)
    want = _api_error(m=1, n=1, k=131072, a_dtype=torch.int8, b_dtype=torch.int8, a_scale=torch.ones(1),
                      b_scale=torch.ones(1), scheme="rowcol")
    assert "131071" in want
    assert (rc, out) == (2, "") and _last_line(err) == f"tileq explain: error: {want}"
    # a b_scale group is 1 or 128 columns wide
    rc, out, err = _run(["explain", "--scheme", "bquant", "--a", "fp8", "--b", "fp8", "--m", "4", "--n", "14",
                         "--k", "256", "--group-n", "7"], capsys)
    want = _api_error(m=4, n=14, k=256, a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn,
                      a_scale=torch.ones(4), b_scale=torch.ones(2, 2), scheme="bquant", group_n=7)
    assert (rc, out) == (2, "") and _last_line(err) == f"tileq explain: error: {want}"
    # an operand pair gemm does not take
    rc, out, err = _run(EXPLAIN[:4] + ["int4"] + EXPLAIN[5:6] + ["int4"] + EXPLAIN[7:], capsys)
    assert (rc, out) == (2, "") and "expected a legal operand pair" in _last_line(err)


def test_explain_checks_group_k_like_gemm(capsys):
    rc, out, err = _run(["explain", "--scheme", "aquant", "--a", "int8", "--b", "int8", "--m", "4", "--n", "8",
                         "--k", "256", "--group-k", "200000"], capsys)
    assert (rc, out) == (2, "") and "got group_k=200000" in _last_line(err)


# ----------------------------------------------------------------------------- explain: here and target


def _no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def test_explain_says_what_runs_here_and_on_the_target(capsys):
    if not _no_gpu():
        pytest.skip("this machine has a CUDA GPU: explain prints the local plan")
    import torch

    import tileq

    rc, out, err = _run(EXPLAIN, capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("here      : CPU tensors (no CUDA GPU): the torch reference (backend 'auto'")
    assert lines[1].startswith("target    : sm_90 (the default; --arch picks one of sm_80, ")
    # (the tests set TRITON_INTERPRET=1, which the plan names: "triton (Triton interpreter)")
    assert any(ln.startswith("executor  : triton") for ln in lines)
    assert "family    : rowcol_i8xi8_rcr_decode" in lines
    # what the API says for CPU tensors here: the reference, as the first line said
    a, b = torch.zeros(16, 256, dtype=torch.int8), torch.zeros(64, 256, dtype=torch.int8).t()
    here = tileq.explain(a, b, torch.ones(16), torch.ones(64), scheme="rowcol")
    assert "executor  : reference" in here.splitlines()

    rc, out, _ = _run(EXPLAIN + ["--arch", "sm_89", "--backend", "reference"], capsys)
    lines = out.splitlines()
    assert rc == 0 and lines[0] == "here      : CPU tensors (no CUDA GPU): the torch reference (backend 'reference')"
    assert lines[1] == "target    : sm_89 (--arch), CUDA tensors: the plan below"
    assert "executor  : reference" in lines


def test_explain_refuses_a_plan_the_target_cannot_run(capsys):
    rc, out, err = _run(["explain", "--scheme", "rowcol", "--a", "fp8", "--b", "fp8", "--m", "16", "--n", "64",
                         "--k", "256", "--arch", "sm_80"], capsys)
    assert (rc, out) == (2, "") and "fp8 runs on sm_89" in _last_line(err)


# ----------------------------------------------------------------------------- families and arches


def _arch_error(name: str) -> str:
    from tileq.device import ARCHS

    return f"arch: expected one of {', '.join(ARCHS)}, got {name!r}"


@pytest.mark.parametrize("argv", [
    ["build", "--arch", "sm_75"],
    ["selftest", "--arch", "sm_75"],
    ["list", "--arch", "sm_75"],
    EXPLAIN + ["--arch", "sm_75"],
])
def test_unknown_arch_is_refused_before_any_work(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (a build or selftest would write build/ here)
    t0 = time.perf_counter()
    rc, out, err = _run(argv, capsys)
    assert time.perf_counter() - t0 < 10
    assert (rc, out) == (2, "") and not any(tmp_path.iterdir())
    assert _last_line(err) == f"tileq {argv[0]}: error: {_arch_error('sm_75')}"


def test_unknown_family_is_refused_before_any_work(capsys, tmp_path):
    from tileq.catalog.families import catalog

    total = len(catalog())
    out_dir = tmp_path / "kernels"
    rc, out, err = _run(["build", "--arch", "sm_90", "--out", str(out_dir), "--family", "nope"], capsys)
    assert (rc, out) == (2, "") and not out_dir.exists() and "Traceback" not in err
    last = _last_line(err)
    assert last.startswith(f"tileq build: error: --family: expected one of the {total} families of the kernel "
                           "catalog") and "`tileq list --names` lists them" in last and last.endswith("got 'nope'")
    rc, out, err = _run(["build", "--arch", "sm_90", "--out", str(out_dir), "--family", "rowcol_i8xi8_rcr_prefil"],
                        capsys)
    assert rc == 2 and "the closest: rowcol_i8xi8_rcr_prefill," in _last_line(err)
    rc, out, err = _run(["sass", "nope", "1", "2", "3", "m64n16k256_w4_s4"], capsys)
    assert rc == 2 and _last_line(err).startswith("tileq sass: error: family: expected one of the")


# ----------------------------------------------------------------------------- failures


def test_selftest_failure_names_its_reasons_last(capsys, monkeypatch):
    monkeypatch.setattr(commands, "correctness_pass", lambda device: 1)
    rc, out, err = _run(["selftest", "--skip-build"], capsys)
    assert rc == 1
    assert _last_line(out) == ("selftest: FAILED (1 problem): the correctness pass found results that differ "
                               "from the reference (its FAILED lines above)")


def test_tileq_errors_end_in_one_line_and_bugs_keep_their_traceback(capsys, monkeypatch):
    from tileq.errors import UnsupportedError

    def refuse(args):
        print("some output first")
        raise UnsupportedError("thing: expected this,\n  got that")

    monkeypatch.setattr(commands, "cmd_list", refuse)
    rc, out, err = _run(["list"], capsys)
    assert (rc, out) == (2, "some output first\n")
    assert err == "tileq list: error: thing: expected this, got that\n"

    def bug(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(commands, "cmd_list", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["list"])


def test_missing_command_and_unknown_choice(capsys):
    rc, out, err = _run([], capsys)
    assert rc == 2 and "the following arguments are required" in _last_line(err)
    rc, out, err = _run(EXPLAIN[:2] + ["nope"] + EXPLAIN[3:], capsys)
    assert rc == 2 and "argument --scheme: invalid choice: 'nope'" in _last_line(err)


def test_refusal_through_python_m_tileq():
    """The process: exit status 2, the error last on the combined output, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "tileq", "explain", "--scheme", "rowcol", "--a", "int8", "--b",
                           "int8", "--m", "16", "--n", "64", "--k", "131072"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stdout
    assert _last_line(proc.stdout).startswith("tileq explain: error: b: expected an int32 accumulation span of "
                                              "at most 131071 for i8xi8")


# ----------------------------------------------------------------------------- progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_plain_lines_off_a_terminal():
    from tileq.bench.progress import end_status, status_line

    log = io.StringIO()
    status_line("precompiling 10/20", log)
    status_line("precompiling 20/20", log)
    end_status(log)
    assert log.getvalue() == "precompiling 10/20\nprecompiling 20/20\n"
    tty = _Tty()
    status_line("precompiling 10/20", tty)
    end_status(tty)
    assert tty.getvalue().startswith("\rprecompiling 10/20") and tty.getvalue().endswith("\n")

    # tileq build's progress: failures said as they come, in a log as plain lines
    class R:
        def __init__(self, name, ok, error=None):
            self.name, self.ok, self.error = name, ok, error

    for stream, has_cr in ((io.StringIO(), False), (_Tty(), True)):
        progress = commands._BuildProgress("build sm_90")
        sys_stderr, sys.stderr = sys.stderr, stream
        try:
            for i, r in enumerate([R("k1", True), R("k2", False, "CompilationError: boom"), R("k3", True)], 1):
                progress(i, 3, r)
        finally:
            sys.stderr = sys_stderr
        text = stream.getvalue()
        assert ("\r" in text) == has_cr and text.endswith("\n")
        assert "FAILED k2: CompilationError: boom" in [ln.strip() for ln in text.replace("\r", "\n").splitlines()]


def test_no_other_module_writes_a_carriage_return():
    """Progress text goes through tileq.bench.progress, which writes a carriage return only to a
    terminal."""
    writers = [str(p.relative_to(SRC)) for p in (SRC / "tileq").rglob("*.py")
               if "\\r" in p.read_text() and p.name != "progress.py"]
    assert not writers, writers


def test_the_entry_point_module():
    assert tileq.cli.main is main
