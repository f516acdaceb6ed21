"""``tileq demo`` end to end on CPU (Triton's interpreter at reduced sizes)."""

import pytest

import tileq.cli
from tileq.bench import results as R
from tileq.bench.cases import HEADLINE, Operands


def test_demo_default_on_cpu(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = tileq.cli.main(["demo", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "TIMINGS NEED A GPU" in captured.out
    assert f"all {9 * len(HEADLINE)} tileq results match the reference" in captured.out
    rows = R.read_csv(out / "results.csv")
    tq = [r for r in rows if r.impl == "tileq"]
    assert {(r.shape, r.m) for r in tq} == {
        (s, m) for s in ("qwen3-14b.q_o/40", "qwen3-14b.gate_up/40", "qwen3-14b.down/40") for m in (1, 16, 64)
    }
    assert all(r.status == R.NOT_MEASURED for r in tq)
    # SQNR against the unquantized bf16 product: int8 keeps far more than int4.
    sq = {r.case: r.sqnr_db for r in tq if r.shape == "qwen3-14b.down/40" and r.m == 16}
    assert sq["rowcol:i8xi8:rcr"] > 35 and 12 < sq["bquant:fp8xi4:rcr"] < 25
    assert "Timings need a GPU" in (out / "report.md").read_text()
    # The model half: bf16's row to compare with, the agreement measured over every prompt
    # position and explained, and no CPU timings.
    model = captured.out.split("A tiny random Qwen3", 1)[1]
    rows = {line.split()[0]: line.split() for line in model.splitlines() if line.split()}
    assert rows["bf16"][1:5] == ["-", "1.0000", "1.00", "0.000"]
    for name in ("A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A8"):
        cos, top1 = float(rows[name][2]), float(rows[name][3])
        assert 0.9 < cos <= 1 and 0.25 <= top1 <= 1, rows[name]  # 32 positions, not 2: never 0.00
    assert "over the 32 prompt positions (the check)" in model and "near ties" in model
    assert "ms/token" not in model and "no timings" in model
    assert "all 6 configs pass their cosine floor" in model


def test_demo_fails_when_a_check_fails(tmp_path, monkeypatch, capsys):
    real = Operands.gemm

    def wrong(self, **kw):
        y = real(self, **kw)
        if kw.get("backend") == "triton" and self.case.scheme.value == "abquant":
            y.zero_()  # an all-zero result: the gate must catch it
        return y

    monkeypatch.setattr(Operands, "gemm", wrong)
    rc = tileq.cli.main(["demo", "--quick", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "FAILED: 2 of 14 tileq checks" in err and "output is all zero" in err


@pytest.mark.parametrize("bad", [["--cases", "tensor:i8xi8"], ["--device", "tpu"]])
def test_demo_bad_arguments(tmp_path, bad, capsys):
    assert tileq.cli.main(["demo", "--quick", "--out", str(tmp_path), *bad]) == 2
    assert "tileq demo: error:" in capsys.readouterr().err


def test_cli_on_cpu_restarts_itself_interpreted(tmp_path):
    """`import tileq` already compiles some @triton.jit kernels: on a machine without CUDA the
    tileq command (the README's `./dev/tileq demo`) restarts itself with TRITON_INTERPRET=1
    instead of failing in every kernel. Run without the variable, as a user's shell would."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if os.environ.get("TILEQ_TEST_GPU") == "1":
        pytest.skip("a CPU-machine behaviour")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "tileq", "demo", "--quick", "--no-model", "--device", "cpu",
                           "--cases", "rowcol:i8xi8:rcr", "--out", str(tmp_path / "demo")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "match the reference" in proc.stdout and "error" not in proc.stdout.split("shape", 1)[-1]
