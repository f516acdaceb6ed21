"""The model layer on CPU: configs, QuantLinear (forward, state_dict, .to), quantize_, the custom ops
(opcheck, torch.compile with fullgraph) and their refusals. QuantLinear on CPU tensors runs the
torch reference, so these tests are about the layer's logic, not the kernels (test_act_quant.py
and test_kernels.py run those in the interpreter)."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import tileq
from tileq.errors import DTypeError, ShapeError, TileqError, UnsupportedError
from tileq.nn import (
    A8W8Config,
    FP8BlockConfig,
    FP8RowConfig,
    QuantLinear,
    W4A8Config,
    W4A16Config,
    W8A16Config,
    quantize_,
)

CONFIGS = [A8W8Config(), FP8RowConfig(), FP8BlockConfig(), W8A16Config(), W4A16Config(), W4A8Config(),
           W4A16Config(group_size=None), W4A16Config(group_size=64)]
# Relative error of the layer against the bf16 linear, per weight type (random N(0,1) data).
TOL = {"int8": 0.02, "fp8": 0.08, "int4": 0.15}


def _linear(k=320, n=200, bias=True, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(dtype)


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.name}-{getattr(c, 'group_size', '')}")
def test_quant_linear_matches_linear_and_round_trips(config):
    lin = _linear()
    x = torch.randn(2, 3, 320, dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(lin, config)
    y, want = layer(x), lin(x)
    assert y.shape == want.shape and y.dtype == torch.bfloat16
    assert torch.isfinite(y).all() and want.abs().max() > 0.5  # expected values far above the tolerance
    assert _rel(y, want) < TOL[config.weight_dtype]
    # state_dict round trip: a fresh layer loads it and computes exactly the same.
    fresh = QuantLinear(320, 200, bias=True, config=config)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x), y)
    for name in ("weight", "weight_scale", "bias"):
        assert torch.equal(_bits(getattr(fresh, name)), _bits(getattr(layer, name)))
    assert config.name in repr(layer) and "scheme" in repr(layer)


def test_quant_linear_weight_layouts():
    lin = _linear(k=256, n=130)
    a8 = QuantLinear.from_linear(lin, A8W8Config())
    assert a8.weight.dtype == torch.int8 and a8.weight.shape == (130, 256) and a8.weight_scale.shape == (130,)
    blk = QuantLinear.from_linear(lin, FP8BlockConfig())
    assert blk.weight.dtype == torch.float8_e4m3fn and blk.weight_scale.shape == (2, 2)  # [Gk, Gn]
    w4 = QuantLinear.from_linear(lin, W4A16Config())
    # int4 weights are held prepacked by default (tileq.prepacked: int32 words, K padded to 512);
    # packed_weight() and the state dict give tileq's pk_int4 of the quantized weight.
    assert w4.is_prepacked and w4.weight.dtype == torch.int32 and w4.weight.shape == (130, 64)
    pk = w4.packed_weight()
    assert pk.dtype == torch.uint8 and pk.shape == (130, 128) and w4.weight_scale.shape == (2, 130)
    assert torch.equal(w4.state_dict()["weight"], pk)
    w4pk = QuantLinear.from_linear(lin, W4A16Config(int4_layout="pk_int4"))
    assert not w4pk.is_prepacked and torch.equal(w4pk.weight, pk)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.equal(w4(x), w4pk(x))  # the same values either way
    assert not QuantLinear.from_linear(lin, W4A16Config(group_size=64)).is_prepacked  # 64 % 128 != 0
    w4pk.set_int4_layout("prepacked")  # converts in place, exactly
    assert w4pk.is_prepacked and torch.equal(w4pk.weight, w4.weight) and w4pk.config == w4.config
    assert torch.equal(w4pk.set_int4_layout("pk_int4").weight, pk)
    with pytest.raises(tileq.errors.UnsupportedError, match="int4"):
        a8.set_int4_layout("prepacked")
    with pytest.raises(tileq.errors.UnsupportedError, match="int4_layout"):
        W4A16Config(int4_layout="marlin")
    # The stored int4 bytes are tileq's pk_int4 of the quantized weight (element 2j high nibble).
    q = tileq.quant.unpack_int4(tileq.PackedInt4(pk, (130, 256), 1))
    assert q.min() >= -8 and q.max() <= 7
    deq = q.float().reshape(130, 2, 128) * w4.weight_scale.t().reshape(130, 2, 1)
    assert _rel(deq.reshape(130, 256), lin.weight) < 0.15


def test_output_follows_input_dtype_and_fp32_models():
    lin = _linear(dtype=torch.float32)
    x = torch.randn(4, 320)
    for config in (A8W8Config(), W4A16Config()):
        layer = QuantLinear.from_linear(lin, config)
        y = layer(x)
        assert y.dtype == torch.float32 and _rel(y, lin(x)) < TOL[config.weight_dtype]


def test_to_dtype_keeps_quantized_tensors():
    layer = QuantLinear.from_linear(_linear(), FP8RowConfig())
    w, s = layer.weight.clone(), layer.weight_scale.clone()
    model = nn.Sequential(layer)
    model.to(torch.float16)
    assert layer.weight.dtype == torch.float8_e4m3fn and torch.equal(layer.weight.view(torch.uint8), w.view(torch.uint8))
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, s)
    assert layer.dtype == torch.float16
    model.float()
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.dtype == torch.float32


def test_static_input_scale():
    lin = _linear()
    x = torch.randn(5, 320, dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(lin, A8W8Config())
    amax = x.float().abs().max()
    layer.set_input_scale(amax / 127)
    y = layer(x)
    assert _rel(y, lin(x)) < 0.03
    assert "static activation scale" in repr(layer)
    fresh = QuantLinear(320, 200, config=A8W8Config())
    fresh.load_state_dict(layer.state_dict())  # input_scale travels with the state dict
    assert fresh.input_scale is not None and torch.equal(fresh(x), y)
    with pytest.raises(UnsupportedError, match="input_scale: expected no activation scale"):
        QuantLinear.from_linear(lin, W8A16Config()).set_input_scale(1.0)


@pytest.mark.parametrize("key, bad, err, match", [
    ("weight", lambda t: t.float(), DTypeError, r"weight: expected dtype torch.int8 for A8W8"),
    ("weight", lambda t: t[:, :-1], ShapeError, r"weight: expected shape \(200, 320\)"),
    ("weight_scale", lambda t: t[:-1], ShapeError, r"weight_scale: expected shape \(200,\)"),
    ("weight_scale", lambda t: t.to(torch.int32), DTypeError, r"weight_scale: expected dtype torch.float32"),
])
def test_bad_state_dicts_are_refused(key, bad, err, match):
    layer = QuantLinear.from_linear(_linear(), A8W8Config())
    sd = layer.state_dict()
    sd[key] = bad(sd[key])
    with pytest.raises(err, match=match):
        QuantLinear(320, 200, config=A8W8Config()).load_state_dict(sd)


def test_missing_keys_are_reported():
    layer = QuantLinear.from_linear(_linear(), A8W8Config())
    sd = layer.state_dict()
    del sd["weight_scale"]
    with pytest.raises(RuntimeError, match="Missing key"):
        QuantLinear(320, 200, config=A8W8Config()).load_state_dict(sd)


def test_invalid_configs_and_layers():
    with pytest.raises(ShapeError, match="group_size: expected None .per channel. or an even int"):
        W4A16Config(group_size=7)
    with pytest.raises(UnsupportedError, match="block_size: expected 128"):
        FP8BlockConfig(block_size=64)
    with pytest.raises(UnsupportedError, match="skip_modules: expected a tuple of module names"):
        A8W8Config(skip_modules="lm_head")
    with pytest.raises(UnsupportedError, match="config: expected a tileq quantization config"):
        QuantLinear(8, 8, config="A8W8")
    with pytest.raises(UnsupportedError, match="in_features=9 is odd"):
        QuantLinear(9, 8, config=W4A16Config())
    with pytest.raises(UnsupportedError, match="config: expected one of A8W8"):
        tileq.nn.config_from_name("int3")
    assert isinstance(tileq.nn.config_from_name("a8w8config"), A8W8Config)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 512)
        self.odd = nn.Linear(255, 64)  # odd K: int4 cannot pack it
        self.down = nn.Linear(512, 256, bias=False)
        self.lm_head = nn.Linear(256, 100, bias=False)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))))


def test_quantize_summary_lists_what_stays_and_why(caplog):
    model = _Block().to(torch.bfloat16)
    with caplog.at_level("INFO", logger="tileq"):
        summary = quantize_(model, W4A16Config())
    assert summary.converted == ["up", "down"]
    kept = dict(summary.skipped)
    assert kept["lm_head"] == "in config.skip_modules"
    assert "in_features=255 is odd" in kept["odd"]
    assert isinstance(model.up, QuantLinear) and isinstance(model.odd, nn.Linear)
    assert "2 layers converted, 2 left unquantized" in caplog.text
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.isfinite(model(x)).all()


def test_quantize_filter_fn_and_refusals():
    model = _Block().to(torch.bfloat16)
    summary = quantize_(model, A8W8Config(skip_modules=()), filter_fn=lambda mod, name: name != "up")
    assert ("up", "filter_fn returned False") in summary.skipped
    assert "lm_head" in summary.converted and "odd" in summary.converted
    with pytest.raises(UnsupportedError, match="config: expected a tileq quantization config"):
        quantize_(model, "A8W8")
    with pytest.raises(UnsupportedError, match="model: expected a torch.nn.Module"):
        quantize_(object(), A8W8Config())
    with pytest.raises(UnsupportedError, match="filter_fn: expected None or a callable"):
        quantize_(_Block(), A8W8Config(), filter_fn=3)


def test_a_layer_that_cannot_be_quantized_stays_listed():
    model = _Block().to(torch.bfloat16)
    with torch.no_grad():
        model.up.weight[0, 0] = float("nan")  # the offline quantizer refuses non-finite weights
    summary = quantize_(model, A8W8Config())
    kept = dict(summary.skipped)
    assert "up" in kept and "finite" in kept["up"]
    assert isinstance(model.up, nn.Linear) and isinstance(model.down, QuantLinear)


def _opcheck(op, args):
    """torch.library.opcheck; with fp8 tensors in or out, without its schema test, which compares
    tensors with ops torch has no fp8 CPU kernel for ("mul" on Float8_e4m3fn, torch 2.13)."""
    from torch.library import opcheck

    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    op = getattr(op, "op", op)  # a tileq.ops.TileqOp: its OpOverload
    outs = op(*args)
    tensors = [t for t in (*args, *(outs if isinstance(outs, tuple) else (outs,))) if isinstance(t, torch.Tensor)]
    if any(t.dtype in fp8 for t in tensors):
        return opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor"))
    return opcheck(op, args)


def test_custom_ops_pass_opcheck():
    from tileq import ops

    x = torch.randn(3, 256, dtype=torch.bfloat16)
    for config in (A8W8Config(), FP8BlockConfig(), W4A16Config(), W4A8Config()):
        layer = QuantLinear.from_linear(_linear(k=256, n=64), config)
        _opcheck(ops.quant_linear_op, (x, layer.weight, layer.weight_scale, layer.bias, None, layer.spec.key))
        # with the layer's tile counters, an argument the op may write (and leaves at zero)
        _opcheck(ops.quant_linear_op, (x, layer.weight, layer.weight_scale, layer.bias, None, layer.spec.key,
                                       layer.tile_counters))
        assert not layer.tile_counters.any()
    for dtype, gran, pre in (("int8", "row", False), ("int8", "group", True), ("fp8", "group", False)):
        _opcheck(ops.quantize_activation_op, (x, dtype, gran, 128, None, pre))
    q, s = tileq.activation.quantize_activation(x, "int8")
    w = QuantLinear.from_linear(_linear(k=256, n=64), A8W8Config())
    _opcheck(ops.linear_op, (q, w.weight, s, w.weight_scale, w.bias, "rowcol", torch.bfloat16, 128, 0, 0))
    _opcheck(ops.linear_op, (q, w.weight, s, w.weight_scale, w.bias, "rowcol", torch.bfloat16, 128, 0, 0,
                             w.tile_counters))
    w4 = QuantLinear.from_linear(_linear(k=256, n=64), W4A16Config())
    _opcheck(ops.linear_op, (x, w4.weight, None, w4.weight_scale, None, "bquant", torch.bfloat16, 128, 1, 256))


def test_fake_impls_match_real_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tileq import ops

    x = torch.randn(5, 256, dtype=torch.bfloat16)
    real = ops.quantize_activation_op(x, "fp8", "group", 128, None, True)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fake = ops.quantize_activation_op(fx, "fp8", "group", 128, None, True)
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.dtype == f.dtype and r.stride() == f.stride()


def test_compile_fullgraph_matches_eager():
    model = nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 128)).to(torch.bfloat16)
    quantize_(model, A8W8Config())
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    eager = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), eager)


def test_static_input_scale_on_block_weights():
    """FP8Block with a calibrated per-tensor activation scale: one scale per row against 128x128
    weight blocks (scheme bquant), as close to the bf16 layer as the dynamic per-group version."""
    lin = _linear(k=256, n=256)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(lin, FP8BlockConfig())
    dynamic = layer(x)
    layer.set_input_scale(x.float().abs().max() / 448)
    static = layer(x)
    assert _rel(static, lin(x)) < TOL["fp8"] and _rel(dynamic, lin(x)) < TOL["fp8"]
    assert not torch.equal(static, dynamic)


def test_gptq_rounds_int4_for_the_calibration_inputs():
    """GPTQ's int4 weights give smaller output error on inputs like the calibration ones than
    round-to-nearest, on the same grid (q in [-8, 7], scale [Gk, N])."""
    from tileq.nn.gptq import HessianCollector, gptq_int4

    torch.manual_seed(0)
    lin = nn.Linear(256, 64, bias=False)
    mix = torch.randn(256, 256) * torch.linspace(0.1, 3.0, 256)  # correlated, uneven inputs
    xs = torch.randn(512, 256) @ mix
    col = HessianCollector({"lin": lin})
    with torch.no_grad():
        lin(xs)
    col.remove()
    q, s = gptq_int4(lin.weight, col.h["lin"], 128)
    assert q.dtype == torch.int8 and q.min() >= -8 and q.max() <= 7 and s.shape == (2, 64)
    deq = q.float() * s.t().repeat_interleave(128, dim=1)
    rtn = QuantLinear.from_linear(lin, W4A16Config())
    q_rtn = tileq.quant.unpack_int4(tileq.PackedInt4(rtn.packed_weight(), (64, 256), 1)).float()
    deq_rtn = q_rtn * rtn.weight_scale.t().repeat_interleave(128, dim=1)
    test = torch.randn(256, 256) @ mix
    want = test @ lin.weight.detach().t()
    assert _rel(test @ deq.t(), want) < 0.97 * _rel(test @ deq_rtn.t(), want)


def test_quantize_with_calibration_and_its_refusals():
    model = _Block().to(torch.float32)
    x = torch.randn(64, 256)
    summary = quantize_(model, W4A16Config(), calibration=lambda m: m(x))
    assert summary.converted == ["up", "down"] and torch.isfinite(model(x)).all()
    with pytest.raises(UnsupportedError, match="calibration: expected a callable, with an int4 config"):
        quantize_(_Block(), A8W8Config(), calibration=lambda m: m(x))
    with pytest.raises(UnsupportedError, match="hessian: expected an int4 config"):
        QuantLinear.from_linear(_linear(), A8W8Config(), hessian=torch.eye(320))


def test_compiled_op_reaches_a_runner(monkeypatch):
    """tileq::quant_linear (what torch.compile calls) takes the validating path on a signature's
    first call only: the second builds a runner shared by every layer of that signature, later
    calls only launch (the Triton kernels, through the interpreter here), with the same outputs."""
    from tileq import quant_linear

    monkeypatch.setenv("TILEQ_BACKEND", "triton")
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 128)).to(torch.bfloat16)
    quantize_(model, A8W8Config())
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    eager = model(x)
    validating = []
    real = quant_linear.quant_linear_forward
    # (calls on fake tensors are torch.compile tracing the op, not running it)
    monkeypatch.setattr(quant_linear, "quant_linear_forward",
                        lambda *a: (is_fake(a[1]) or validating.append(1)) and None or real(*a))
    quant_linear._OP_RUNNERS.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for step in range(3):
        before = len(validating)
        assert torch.equal(compiled(x), eager)
        # two signatures (256 -> 256 twice, 256 -> 128), each validated on its first two calls only
        assert len(validating) - before == (3, 1, 0)[step], (step, validating)
    runners = [r for r in quant_linear._OP_RUNNERS.values() if type(r) is quant_linear.LayerRunner]
    assert len(runners) == 2
