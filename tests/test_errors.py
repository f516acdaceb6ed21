"""Bad inputs: each raises the right subclass, naming the argument (pytest.raises with match=)."""

import pytest
import torch

import tileq
from tileq.errors import (ArchError, DTypeError, LayoutError, ScaleError, ShapeError, TileqError,
                          UnsupportedError)
from tileq.device import get_arch
from tileq.dispatch.plan import make_plan
from tileq.problem import build_problem
from tileq.quant import pack_int4, quantize

i8 = lambda *s: torch.randint(-5, 5, s, dtype=torch.int8)
f8 = lambda *s: torch.randn(*s).to(torch.float8_e4m3fn)


def gemm_rowcol(**over):
    kw = dict(a=i8(37, 64), b=i8(64, 5), a_scale=torch.ones(37), b_scale=torch.ones(5),
              scheme="rowcol")
    kw.update(over)
    a, b, sa, sb = kw.pop("a"), kw.pop("b"), kw.pop("a_scale"), kw.pop("b_scale")
    return tileq.gemm(a, b, sa, sb, **kw)


BAD = [
    ("wrong a dtype", lambda: gemm_rowcol(a=torch.randn(37, 64)), DTypeError, r"^a: expected"),
    ("raw uint8", lambda: gemm_rowcol(b=torch.zeros(64, 5, dtype=torch.uint8)), DTypeError, r"b: .*PackedInt4"),
    ("illegal pair", lambda: gemm_rowcol(b=f8(64, 5)), DTypeError, r"a, b: expected a legal operand pair.*got i8xfp8"),
    ("wrong rank", lambda: gemm_rowcol(a=i8(2, 37, 64)), ShapeError, r"a: expected a 2-D matrix"),
    ("K mismatch", lambda: gemm_rowcol(b=i8(63, 5)), ShapeError, r"b: expected K=64 rows"),
    ("a_scale for another scheme", lambda: gemm_rowcol(a_scale=torch.ones(37, 2)), ShapeError,
     r"a_scale: expected shape \(M,\) or \(M, 1\) or a scalar for scheme 'rowcol' with M=37.*got \(37, 2\)"),
    ("b_scale rank-1 wrong length", lambda: gemm_rowcol(b_scale=torch.ones(37)), ShapeError, r"b_scale: expected .*N=5"),
    ("missing scale", lambda: gemm_rowcol(a_scale=None), ScaleError, r"a_scale: expected a scale for scheme 'rowcol'"),
    ("scale dtype", lambda: gemm_rowcol(a_scale=torch.ones(37, dtype=torch.int32)), DTypeError, r"a_scale: expected dtype float32"),
    ("non-unit inner stride", lambda: gemm_rowcol(a=i8(37, 128)[:, ::2]), LayoutError, r"a: expected .*unit stride"),
    ("overlapping rows", lambda: gemm_rowcol(a=torch.as_strided(i8(200), (37, 64), (1, 1))), LayoutError,
     r"a: expected a \[M, K\] matrix .* got shape \(37, 64\) with strides \(1, 1\)"),
    ("unknown scheme", lambda: gemm_rowcol(scheme="perrow"), UnsupportedError, r"scheme: expected one of tensor, rowcol"),
    ("out wrong shape", lambda: gemm_rowcol(out=torch.empty(37, 6, dtype=torch.bfloat16)), ShapeError, r"out: expected shape \(M, N\) = \(37, 5\)"),
    ("out wrong dtype", lambda: gemm_rowcol(out=torch.empty(37, 5)), DTypeError, r"out: expected dtype torch.bfloat16"),
    ("out transposed", lambda: gemm_rowcol(out=torch.empty(5, 37, dtype=torch.bfloat16).t()), LayoutError, r"out: expected a row-major"),
    ("out_dtype", lambda: gemm_rowcol(out_dtype=torch.int8), DTypeError, r"out_dtype: expected"),
    ("bias shape", lambda: gemm_rowcol(bias=torch.ones(6)), ShapeError, r"bias: expected shape \(N,\) = \(5,\)"),
    ("acc dtype", lambda: gemm_rowcol(acc=torch.zeros(37, 5)), DTypeError, r"acc: expected dtype torch.int32"),
    ("acc shape", lambda: gemm_rowcol(acc=torch.zeros(5, 37, dtype=torch.int32)), ShapeError, r"acc: expected shape \(M, N\)"),
    ("group_k", lambda: gemm_rowcol(group_k=0), ShapeError, r"group_k: expected a positive int"),
    ("unknown backend", lambda: gemm_rowcol(backend="cuda"), UnsupportedError, r"backend: expected one of auto, triton, reference"),
    ("int32 overflow", lambda: tileq.gemm(torch.zeros(1, 131072, dtype=torch.int8), torch.zeros(131072, 1, dtype=torch.int8),
                                          1.0, 1.0, scheme="tensor"), UnsupportedError, r"int32 accumulation span of at most 131071"),
    ("aquant b group scale", lambda: tileq.gemm(f8(4, 256), f8(256, 8), torch.ones(4, 2), torch.ones(2, 8), scheme="aquant"),
     ShapeError, r"b_scale: expected None or a scalar|b_scale: expected a scalar or None"),
    ("aquant a_scale wrong Gk", lambda: tileq.gemm(f8(4, 256), f8(256, 8), torch.ones(4, 3), None, scheme="aquant"),
     ShapeError, r"a_scale: expected shape \(M, Gk\) for scheme 'aquant' with M=4, Gk=2"),
    ("bquant b_scale width", lambda: tileq.gemm(f8(4, 256), f8(256, 8), None, torch.ones(2, 3), scheme="bquant"),
     ShapeError, r"b_scale: expected shape \(Gk, N \(group_n=1\) or ceil\(N/128\)"),
    ("int4 odd packed extent", lambda: tileq.PackedInt4(torch.zeros(4, 3, dtype=torch.uint8), (4, 5), 1),
     ShapeError, r"PackedInt4.shape: expected an even extent"),
    ("int4 wrong data shape", lambda: tileq.PackedInt4(torch.zeros(4, 3, dtype=torch.uint8), (4, 8), 1),
     ShapeError, r"PackedInt4.data: expected shape \(4, 4\)"),
    ("NaN to quantize", lambda: quantize(torch.tensor([[1.0, float("nan")]]), "int8"), ScaleError, r"^x:"),
    ("int4 value range", lambda: pack_int4(torch.tensor([[8, 0]])), ScaleError, r"x:"),
    ("seed op dtype", lambda: tileq.a8w8_matmul_dequant(f8(3, 4), i8(4, 5), 1.0, 1.0, out_dtype=torch.bfloat16),
     DTypeError, r"lhs: expected dtype torch.int8"),
    ("unknown arch", lambda: get_arch("sm_75"), ArchError,
     r"arch: expected one of sm_80, sm_89, sm_90, sm_100, sm_120"),
    ("fp8 on sm_80", lambda: make_plan(build_problem(f8(4, 64), f8(64, 8), 1.0, 1.0, scheme="tensor").spec,
                                       torch.device("cuda"), backend="triton", arch="sm_80"),
     UnsupportedError, r"a, b: expected a pair without fp8/bf8 on sm_80"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_bad_input(case):
    _, fn, exc, match = case
    with pytest.raises(exc, match=match) as info:
        fn()
    assert isinstance(info.value, TileqError)
    assert isinstance(info.value, (ValueError, TypeError))


def test_triton_backend_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UnsupportedError, match=r"backend: expected CUDA tensors for 'triton'"):
        gemm_rowcol(backend="triton")


def test_env_backend_is_validated(monkeypatch):
    monkeypatch.setenv("TILEQ_BACKEND", "fast")
    with pytest.raises(UnsupportedError, match=r"TILEQ_BACKEND: expected one of"):
        gemm_rowcol()


def test_mixed_devices_are_refused():
    if not torch.cuda.is_available():
        a = i8(4, 64)
        with pytest.raises(UnsupportedError, match=r"b: expected a tensor on cpu"):
            tileq.gemm(a, i8(64, 5).to("meta"), 1.0, 1.0, scheme="tensor")
    else:
        with pytest.raises(UnsupportedError, match=r"b: expected a tensor on cuda"):
            tileq.gemm(i8(4, 64).cuda(), i8(64, 5), 1.0, 1.0, scheme="tensor")


def test_errors_are_value_or_type_errors():
    assert issubclass(ShapeError, ValueError) and issubclass(DTypeError, TypeError)
    assert issubclass(LayoutError, ValueError) and issubclass(ArchError, ValueError)


# ----------------------------------------------------------------------------- the caller's names

def linear_rowcol(**over):
    """tileq.linear(x [8, 64], w [5, 64] (nn.Linear's [N, K]), x_scale [8], w_scale [5])."""
    kw = dict(x=i8(8, 64), w=i8(5, 64), x_scale=torch.ones(8), w_scale=torch.ones(5), scheme="rowcol")
    kw.update(over)
    x, w, sx, sw = kw.pop("x"), kw.pop("w"), kw.pop("x_scale"), kw.pop("w_scale")
    return tileq.linear(x, w, sx, sw, **kw)


LINEAR_BAD = [
    ("weight transposed", lambda: linear_rowcol(w=i8(5, 64).t()), ShapeError,
     r"^w: expected an nn.Linear weight \[N, K\] with K=64 \(x's last dimension\), got shape \(64, 5\); "
     r"did you mean w.t\(\)\?"),
    ("weight of another K", lambda: linear_rowcol(w=i8(5, 63)), ShapeError,
     r"^w: expected an nn.Linear weight \[N, K\] with K=64 \(x's last dimension\), got shape \(5, 63\)$"),
    ("x dtype", lambda: linear_rowcol(x=torch.randn(8, 64)), DTypeError, r"^x: expected"),
    ("w dtype", lambda: linear_rowcol(w=torch.randn(5, 64)), DTypeError, r"^w: expected"),
    ("pair", lambda: linear_rowcol(w=f8(5, 64)), DTypeError, r"^x, w: expected a legal operand pair"),
    ("x_scale shape", lambda: linear_rowcol(x_scale=torch.ones(5)), ShapeError, r"^x_scale: expected shape \(M,\)"),
    ("w_scale shape", lambda: linear_rowcol(w_scale=torch.ones(8)), ShapeError, r"^w_scale: expected .*N=5"),
    ("w_scale missing", lambda: linear_rowcol(w_scale=None), ScaleError, r"^w_scale: expected a scale"),
    ("w layout", lambda: linear_rowcol(w=torch.as_strided(i8(400), (5, 64), (1, 1))), LayoutError,
     r"^w: expected a \[N, K\] matrix .* got shape \(5, 64\) with strides \(1, 1\)"),
    ("w device", lambda: linear_rowcol(w=i8(5, 64).to("meta")), UnsupportedError,
     r"^w: expected a tensor on cpu \(the device of x\)"),
    ("group_n", lambda: tileq.linear(f8(4, 256), f8(8, 256), None, torch.ones(2, 8), scheme="bquant", group_n=7),
     ShapeError, r"^group_n: expected 1 or 128"),
]


@pytest.mark.parametrize("case", LINEAR_BAD, ids=lambda c: c[0])
def test_linear_errors_name_its_own_arguments(case):
    """tileq.linear's errors say x, w, x_scale, w_scale (and w's own [N, K] shape), never gemm's
    a, b, a_scale, b_scale of the logical B = w.t()."""
    _, fn, exc, match = case
    with pytest.raises(exc, match=match) as info:
        fn()
    words = str(info.value).replace("a scale", "").replace("a legal", "").replace("a tensor", "")
    for gemm_name in ("a_scale", "b_scale", "(a is", "b:"):
        assert gemm_name not in words


def test_gemm_suggests_the_transpose_that_fits():
    with pytest.raises(ShapeError, match=r"^b: expected K=64 rows \(a is \[37, 64\]\), got shape \(5, 64\); "
                                         r"did you mean b.t\(\)\? .*tileq.linear takes an nn.Linear weight"):
        gemm_rowcol(b=i8(5, 64))
    with pytest.raises(ShapeError, match=r"^group_n: expected 1 or 128 .*got 7"):
        gemm_rowcol(scheme="bquant", b_scale=torch.ones(1, 5), group_n=7)
    # The seed op transposes with b_trans: no b.t() advice in its words.
    with pytest.raises(ShapeError, match=r"^rhs: expected K=64 rows") as info:
        tileq.a8w8_matmul_dequant(i8(3, 64), i8(5, 64), 1.0, 1.0, out_dtype=torch.bfloat16)
    assert "did you mean" not in str(info.value)


def test_prepacked_linear_names_x_and_w():
    w = tileq.prepack_int4(torch.zeros(64, 256, dtype=torch.int8))
    for x in (torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)):
        with pytest.raises(ShapeError, match=r"^x: expected shape \[\.\.\., 256\] \(K: w is a PrepackedInt4 "
                                             r"\[N, K\] = \[64, 256\]\)") as info:
            tileq.linear(x, w, None, torch.ones(2, 64), scheme="bquant")
    assert "prepacked from a transposed weight" in str(info.value)  # x's K is w's N
    with pytest.raises(ShapeError, match=r"^w_scale: expected"):
        tileq.linear(torch.zeros(2, 256, dtype=torch.bfloat16), w, None, torch.ones(3, 64), scheme="bquant")


def test_quant_linear_names_the_layer_and_in_features():
    from torch import nn

    model = nn.Sequential()
    model.add_module("up", nn.Linear(64, 32))
    model.add_module("down", nn.Linear(32, 16))
    tileq.quantize_(model, tileq.A8W8Config())
    with pytest.raises(ShapeError, match=r"^QuantLinear 'down': input: expected shape \[\.\.\., in_features\] = "
                                         r"\[\.\.\., 32\], got shape \(3, 64\)"):
        model.down(torch.randn(3, 64))
    alone = tileq.QuantLinear.from_linear(nn.Linear(64, 32), tileq.W8A16Config())
    with pytest.raises(ShapeError, match=r"^QuantLinear\(in_features=64, out_features=32.*\): input: expected "
                                         r"shape \[\.\.\., in_features\] = \[\.\.\., 64\], got shape \(2, 5, 48\)"):
        alone(torch.randn(2, 5, 48, dtype=torch.bfloat16))
    assert model.up(torch.randn(3, 64)).shape == (3, 32)


def test_from_pretrained_says_hub_ids_are_not_downloaded(tmp_path):
    from tileq.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"^Qwen/Qwen3-0.6B: no such directory\. .*downloads nothing from "
                                              r"the Hugging Face Hub.*snapshot_download\('Qwen/Qwen3-0.6B'\)"):
        tileq.from_pretrained("Qwen/Qwen3-0.6B")
    with pytest.raises(CheckpointError, match=r"^path: expected a checkpoint directory .*no such directory"):
        tileq.from_pretrained(tmp_path / "nothing" / "here" / "x")
    (tmp_path / "f").write_text("")
    with pytest.raises(CheckpointError, match=r"not a directory"):
        tileq.from_pretrained(tmp_path / "f")


def test_errors_module_exports_every_error():
    import tileq.errors as errors

    assert errors.CheckpointError.__mro__[1:3] == (TileqError, ValueError)
    for name in ("TileqError", "ShapeError", "DTypeError", "LayoutError", "ScaleError", "UnsupportedError",
                 "ArchError", "CheckpointError"):
        assert name in errors.__all__ and issubclass(getattr(errors, name), TileqError)


def test_linear_renames_planning_errors(monkeypatch):
    """Errors raised after validation (planning, execution) speak of gemm's a and b: linear says x, w."""
    import tileq.api as api

    def refuse(*args, **kwargs):
        raise UnsupportedError("a, b: expected a pair without fp8/bf8 on sm_80, got fp8xfp8")

    monkeypatch.setattr(api._plan, "make_plan", refuse)
    with pytest.raises(UnsupportedError, match=r"^x, w: expected a pair without fp8/bf8 on sm_80"):
        linear_rowcol()
    with pytest.raises(UnsupportedError, match=r"^a, b: expected"):  # gemm keeps its own names
        gemm_rowcol()
