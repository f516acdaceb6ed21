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
