"""The seed op (a8w8_matmul_dequant), linear, out=, keyword-only options."""

import inspect

import pytest
import torch

import tileq
from tileq.errors import DTypeError, ShapeError
from tileq.dispatch.plan import make_plan
from tileq.problem import build_problem

gen = torch.Generator().manual_seed(7)


def ri8(*s):
    return torch.randint(-127, 128, s, generator=gen, dtype=torch.int8)


def expected(a, b, sa, sb, acc=None):
    raw = a.long() @ b.long()
    if acc is not None:
        raw = raw + acc.long()
    return raw.double() * sa.double().reshape(-1, 1) * sb.double().reshape(1, -1)


@pytest.mark.parametrize("a_trans", [False, True])
@pytest.mark.parametrize("b_trans", [False, True])
@pytest.mark.parametrize("scale_form", ["1d", "2d", "scalar"])
def test_seed_op(a_trans, b_trans, scale_form):
    m, n, k = 33, 33, 70  # M == N: a rank-1 act_scale must scale rows, not columns
    a, b = ri8(m, k), ri8(k, n)
    sa = torch.rand(m, generator=gen) * 3 + 0.1
    sb = torch.rand(n, generator=gen) * 3 + 0.1
    acc = torch.randint(-9999, 9999, (m, n), generator=gen, dtype=torch.int32)
    lhs = a.t().contiguous() if a_trans else a
    rhs = b.t().contiguous() if b_trans else b
    if scale_form == "2d":
        act, wgt = sa.reshape(m, 1), sb.reshape(1, n)
    elif scale_form == "scalar":
        sa, sb = torch.tensor(0.5), torch.tensor(2.0)
        act, wgt = sa, sb
    else:
        act, wgt = sa, sb
    y = tileq.a8w8_matmul_dequant(lhs, rhs, act, wgt, out_dtype=torch.float32, a_trans=a_trans,
                                  b_trans=b_trans, acc=acc)
    want = expected(a, b, sa.expand(m) if sa.dim() == 0 else sa, sb.expand(n) if sb.dim() == 0 else sb, acc)
    assert want.abs().max() > 1e4
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-2)
    # rows scale rows: swapping the roles of the two scale vectors must change the answer
    if scale_form == "1d":
        swapped = expected(a, b, sb, sa, acc)
        assert (swapped - want).abs().max() > 1e3


def test_seed_op_gemv_decided_from_logical_m():
    # lhs stored [K, M] = [4096, 1]: logical M = 1 -> the decode (GEMV) pipeline, not K = 4096.
    lhs = ri8(4096, 1)
    rhs = ri8(64, 4096)
    p = build_problem(lhs.t(), rhs.t(), torch.ones(1), torch.ones(64), scheme="rowcol")
    assert p.spec.m == 1 and p.spec.k == 4096
    plan = make_plan(p.spec, torch.device("cuda"), backend="triton", arch="sm_90")
    assert plan.route.pipeline == "decode"
    p2 = build_problem(ri8(4096, 8), ri8(8, 64), torch.ones(4096), torch.ones(64), scheme="rowcol")
    assert make_plan(p2.spec, torch.device("cuda"), backend="triton", arch="sm_90").route.pipeline == "prefill"


def test_linear_flattens_leading_dims_and_uses_weight_convention():
    x = ri8(2, 3, 40)
    w = ri8(24, 40)  # nn.Linear weight [N, K]
    sx = torch.rand(2, 3, 1, generator=gen) + 0.5
    sw = torch.rand(24, generator=gen) + 0.5
    bias = torch.randn(24, generator=gen)
    y = tileq.linear(x, w, sx, sw, scheme="rowcol", out_dtype=torch.float32, bias=bias)
    assert y.shape == (2, 3, 24)
    want = (x.reshape(6, 40).double() @ w.double().t()) * sx.reshape(6, 1).double() * sw.double() + bias.double()
    torch.testing.assert_close(y.reshape(6, 24).double(), want, rtol=1e-5, atol=1e-3)


def test_out_is_written_and_returned():
    a, b = ri8(5, 64), ri8(64, 7)
    buf = torch.full((5, 16), float("nan"), dtype=torch.bfloat16)
    out = buf[:, :7]  # leading dimension 16 > N
    y = tileq.gemm(a, b, torch.ones(5), torch.ones(7), scheme="rowcol", out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.isnan(buf[:, 7:]).all() and not torch.isnan(out).any()


def test_new_options_are_keyword_only():
    for fn in (tileq.gemm, tileq.linear, tileq.a8w8_matmul_dequant, tileq.explain):
        params = inspect.signature(fn).parameters
        positional = [p.name for p in params.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert len(positional) == 4, (fn.__name__, positional)



def test_the_deterministic_knob_is_gone():
    """Every path sums in a fixed order: the knob that recorded a request for it was removed (a
    caller passing it gets Python's TypeError), not kept and ignored."""
    from tileq.settings import SWITCHES

    for fn in (tileq.gemm, tileq.linear, tileq.explain):
        assert "deterministic" not in inspect.signature(fn).parameters, fn.__name__
    assert "TILEQ_DETERMINISTIC" not in SWITCHES

def test_scheme_is_required():
    with pytest.raises(TypeError, match="scheme"):
        tileq.gemm(ri8(2, 4), ri8(4, 2), 1.0, 1.0)


def test_explain_lists_the_lowering_in_epilogue_order():
    text = tileq.explain(ri8(2, 64), ri8(64, 5), torch.ones(2), torch.ones(5), scheme="rowcol",
                         bias=torch.ones(5), backend="reference")
    assert "mma(i8xi8->i32) -> cast f32 -> row_scale[M] -> col_scale[N] -> + bias[N] -> cast bf16" in text


def test_warmup_needs_cuda_and_describe_builds_specs():
    spec = tileq.describe(scheme="abquant", a="fp8", b="fp8", m=3, n=256, k=512)
    assert spec.gk == 4 and spec.group_n == 128 and spec.a_scale_kind.value == "group"
    if not torch.cuda.is_available():
        with pytest.raises(tileq.errors.UnsupportedError, match="device: expected a CUDA device"):
            tileq.warmup([spec], device="cpu")


def test_linear_with_packed_int4_activations():
    """aquant with int4 activations through linear: x is a PackedInt4 [M, K], the output [M, N]."""
    from tileq.quant import pack_int4

    xq = torch.randint(-8, 8, (3, 256), generator=gen, dtype=torch.int8)
    w = (torch.randn(16, 256, generator=gen) * 64).to(torch.float8_e4m3fn)
    sx = torch.rand(3, 2, generator=gen) + 0.5
    y = tileq.linear(pack_int4(xq, dim=1), w, sx, 1.0, scheme="aquant", out_dtype=torch.float32)
    assert y.shape == (3, 16)
    xg = xq.double().reshape(3, 2, 128)  # [M, Gk, 128]
    wg = w.double().reshape(16, 2, 128)  # [N, Gk, 128]
    per_group = torch.einsum("mgk,ngk->mng", xg, wg)  # exact group sums
    want = (per_group * sx.double().unsqueeze(1)).sum(-1)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-2)


def test_explain_names_the_kernel_orientation_and_int4_loads():
    """The explain command (arch given, no GPU needed) says how the kernel runs the config."""
    import subprocess
    import sys

    def explain(*args):
        return subprocess.run([sys.executable, "-m", "tileq", "explain", "--arch", "sm_90", *args],
                              capture_output=True, text=True, check=True).stdout

    text = explain("--scheme", "bquant", "--a", "fp8", "--b", "int4", "--m", "16", "--n", "28672",
                   "--k", "8192")
    assert "kernel    : swapped" in text and "int4 read as 16-bit words" in text
    assert "no K masks" in text
    text = explain("--scheme", "bquant", "--a", "fp8", "--b", "int4", "--m", "4096", "--n", "5120",
                   "--k", "5000")
    assert "int4 read as bytes" in text and "last K tile masked" in text


@pytest.mark.parametrize("call, err, match", [
    (lambda lhs, rhs: tileq.a8w8_matmul_dequant(lhs, rhs, torch.ones(3, 2), torch.ones(5),
                                                 out_dtype=torch.bfloat16),
     ShapeError, r"^act_scale: expected"),
    (lambda lhs, rhs: tileq.a8w8_matmul_dequant(lhs, rhs, torch.ones(3), torch.ones(4, 4),
                                                 out_dtype=torch.bfloat16),
     ShapeError, r"^weight_scale: expected"),
    (lambda lhs, rhs: tileq.a8w8_matmul_dequant(lhs, rhs[:3], torch.ones(3), torch.ones(5),
                                                 out_dtype=torch.bfloat16),
     ShapeError, r"^rhs: expected K=4 rows \(lhs is \[logical 3, 4\]\)"),
    (lambda lhs, rhs: tileq.a8w8_matmul_dequant(lhs, rhs, torch.ones(3), torch.ones(5),
                                                 out_dtype=torch.bfloat16,
                                                 acc=torch.zeros(3, 5, dtype=torch.float32)),
     DTypeError, r"^acc: expected"),
])
def test_seed_op_errors_name_its_own_arguments(call, err, match):
    """a8w8_matmul_dequant's errors name lhs/rhs/act_scale/weight_scale/acc, never gemm's a/b."""
    lhs = torch.randint(-5, 5, (3, 4), dtype=torch.int8)
    rhs = torch.randint(-5, 5, (4, 5), dtype=torch.int8)
    with pytest.raises(err, match=match) as info:
        call(lhs, rhs)
    assert "a_scale" not in str(info.value) and "b_scale" not in str(info.value)
