"""tileq.silu_mul_quantize: the fused SiLU·mul + activation quantization kernel (the interpreter on
CPU) against ``quantize_activation(silu(gate) * up)``, its refusals, its sm_90 build, the
``tileq::silu_mul_quantize`` custom op and the fused MLP of ``tileq.integrations.hf`` using it.

Exactness: on the interpreter the kernel's exp is numpy's and torch's CPU silu uses its own
vectorized exp; both are within an ulp of exact, so h rounds to the same bf16/fp16 value except in
rare ties, and the tests on these seeds find every q and s identical. A GPU's expf differs from
torch's CPU exp the same way: tests/test_moe_gpu.py allows one quantization step there.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tileq.activation import quantize_activation, silu_mul_quantize
from tileq.errors import DTypeError, LayoutError, ScaleError, ShapeError
from tileq.quant import is_preshuffled, unshuffle_scale

pytestmark = pytest.mark.transformers

ROOT = Path(__file__).resolve().parents[1]


def _expected(x, dtype, granularity, group_k=128):
    gate, up = x.chunk(2, dim=-1)
    h = (torch.nn.functional.silu(gate) * up).contiguous()
    return quantize_activation(h, dtype, granularity=granularity, group_k=group_k, backend="reference")


def _bits(q):
    return q.view(torch.uint8) if q.dtype != torch.int8 else q


@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", ["int8", "fp8", "bf8"])
@pytest.mark.parametrize("granularity", ["row", "group"])
def test_kernel_equals_unfused(xdt, dtype, granularity):
    torch.manual_seed(0)
    for shape in ((1, 2), (3, 10), (7, 600), (2, 2 * 1000)):  # I = 1, 5, 300 (group tail), 1000
        x = (torch.randn(shape) * 4).to(xdt)
        q, s = silu_mul_quantize(x, dtype, granularity=granularity, backend="triton")
        qr, sr = _expected(x, dtype, granularity)
        assert q.shape == (shape[0], shape[1] // 2) and q.is_contiguous()
        assert torch.equal(_bits(q), _bits(qr)), shape
        assert torch.equal(s, sr), shape
        assert (s > 1e-9).all() and (_bits(q) != 0).any()  # real scales (not the 1e-12 floor), q not all 0


def test_leading_dims_strided_rows_preshuffled_group_k():
    torch.manual_seed(1)
    big = (torch.randn(2, 5, 2 * 300 + 64) * 3).to(torch.bfloat16)
    x = big[..., : 2 * 300]  # rows of stride 664: read in place, never copied
    q, s = silu_mul_quantize(x, "fp8", granularity="group", group_k=64, preshuffled=True, backend="triton")
    qr, sr = _expected(x.reshape(10, 600), "fp8", "group", group_k=64)
    assert q.shape == (2, 5, 300)
    assert torch.equal(_bits(q.reshape(10, 300)), _bits(qr))
    assert is_preshuffled(s) and torch.equal(unshuffle_scale(s), sr)
    # The reference backend gives the same outputs and layout.
    q2, s2 = silu_mul_quantize(x, "fp8", granularity="group", group_k=64, preshuffled=True, backend="reference")
    assert torch.equal(_bits(q2), _bits(q)) and s2.stride() == s.stride() and torch.equal(s2, s)


def test_reference_equals_unfused_and_empty():
    torch.manual_seed(2)
    x = torch.randn(9, 2 * 200).to(torch.bfloat16)
    for gran in ("row", "group"):
        q, s = silu_mul_quantize(x, "int8", granularity=gran, backend="reference")
        qr, sr = _expected(x, "int8", gran)
        assert torch.equal(q, qr) and torch.equal(s, sr)
    q, s = silu_mul_quantize(torch.empty(0, 8, dtype=torch.bfloat16), "int8", backend="triton")
    assert q.shape == (0, 4) and s.shape == (0,)


def test_non_finite_rows():
    x = torch.randn(4, 2 * 130).to(torch.bfloat16)
    x[1, 3] = float("nan")      # gate of row 1
    x[2, 130 + 7] = float("inf")  # up of row 2
    q, s = silu_mul_quantize(x, "int8", backend="triton")
    assert torch.isnan(s[1]) and torch.isnan(s[2]) and torch.isfinite(s[[0, 3]]).all()
    assert (q[1] == 0).all() and (q[2] == 0).all() and (q[0] != 0).any()
    _, sg = silu_mul_quantize(x, "int8", granularity="group", backend="triton")
    assert torch.isnan(sg[1, 0]) and torch.isfinite(sg[1, 1]) and torch.isnan(sg[2, 0])
    with pytest.raises(ScaleError, match="silu"):
        silu_mul_quantize(x, "int8", check=True)


def test_refusals():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match=r"gate_up: expected an even last dimension"):
        silu_mul_quantize(torch.randn(3, 7, dtype=torch.bfloat16), "int8")
    with pytest.raises(DTypeError, match=r"gate_up: expected dtype bfloat16, float16 or float32"):
        silu_mul_quantize(x.to(torch.int32), "int8")
    with pytest.raises(ScaleError, match=r"granularity: expected one of 'row', 'group'"):
        silu_mul_quantize(x, "int8", granularity="tensor")
    with pytest.raises(ScaleError, match=r"preshuffled: expected False for granularity 'row'"):
        silu_mul_quantize(x, "int8", preshuffled=True)
    with pytest.raises(DTypeError, match=r"dtype: expected 'int8', 'fp8' or 'bf8'"):
        silu_mul_quantize(x, "int4")
    with pytest.raises(LayoutError, match="unit stride"):
        silu_mul_quantize(torch.randn(8, 3, dtype=torch.bfloat16).t(), "int8")


_COMPILE_SCRIPT = r"""
import json, re, torch, triton
from triton.backends.compiler import GPUTarget
from tileq.dispatch.act_quant import act_quant_config
from tileq.dtypes import OperandType as OT
from tileq.kernels.silu_quant import SiluMulQuantLaunch, aot_source
out = {}
for name, (i, g, ot) in {"row_i8_768": (768, "row", OT.I8), "group_fp8_2048": (2048, "group", OT.FP8),
                         "row_fp8_18432": (18432, "row", OT.FP8)}.items():
    m = 16
    gk = -(-i // 128)
    launch = SiluMulQuantLaunch(q_shape=(m, i), device=torch.device("cpu"), m=m, i=i, row_stride=2 * i,
        x_dtype=torch.bfloat16, otype=ot, granularity=g, group_k=128,
        s_shape=(m,) if g == "row" else (m, gk), s_strides=(1,) if g == "row" else (gk, 1),
        interpreted=False, cfg=act_quant_config(i, g, 128, fused=g == "row", m=m))
    src, options = aot_source(launch)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    out[name] = {p: len(re.findall(re.escape(p), ptx)) for p in (
        "div.rn.f32", "div.full.f32", "div.approx", "max.NaN.f32", "0f4B400000",
        "cvt.rn.satfinite.e4m3x2.f32", "ld.global.v4", "ex2.approx")}
print(json.dumps(out))
"""


def test_compiles_for_sm90():
    """The kernel builds for sm_90 on a CPU: IEEE divisions only (silu's and the scale's), libdevice's
    expf (whose ex2.approx is after its own range reduction), vectorized loads, NaN-propagating max."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, c in res.items():
        assert c["div.full.f32"] == 0 and c["div.approx"] == 0 and c["div.rn.f32"] >= 2, name
        assert c["max.NaN.f32"] > 0 and c["ld.global.v4"] > 0 and c["ex2.approx"] > 0, name
        assert (c["0f4B400000"] if "_i8_" in name else c["cvt.rn.satfinite.e4m3x2.f32"]) > 0, name


# ----------------------------------------------------------------------------- the op and the dense MLP


def test_opcheck():
    from tileq.integrations import hf  # registers tileq::silu_mul_quantize

    x = torch.randn(5, 2 * 136).to(torch.bfloat16)
    for args in ((x, "int8", "row", 128, False), (x, "fp8", "group", 128, True)):
        torch.library.opcheck(torch.ops.tileq.silu_mul_quantize.default, args)
    q, s = hf.silu_mul_quantize_op(x, "fp8", "group", 128, True)
    assert q.shape == (5, 136) and s.shape == (5, 2) and s.stride() == (1, 5)


transformers = pytest.importorskip("transformers")


def _fused_tiny(config):
    import tileq.nn as tnn
    from tileq.integrations.hf import fuse_decoder_

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   vocab_size=256, max_position_embeddings=64)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    tnn.quantize_(model, config)
    fuse_decoder_(model)
    return model.model.layers[0].mlp


def _unfused(mlp, gate_up):
    gate, up = gate_up.split(mlp._tileq_split, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


@pytest.mark.parametrize("name", ["A8W8", "FP8Block", "FP8Row"])
def test_fused_mlp_equals_unfused(name, monkeypatch):
    import tileq.nn as tnn
    from tileq.integrations import hf

    mlp = _fused_tiny(tnn.config_from_name(name))
    gate_up = (torch.randn(2, 5, 768) * 2).to(torch.bfloat16)
    calls = []
    real = hf.silu_mul_quantize
    monkeypatch.setattr(hf, "silu_mul_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        got, want = mlp.act_down(gate_up), _unfused(mlp, gate_up)
    assert calls and got.shape == (2, 5, 256)
    assert torch.equal(got, want)  # reference executor: the same quantized values, the same GEMM
    # The Triton kernels (interpreter): the fused kernel and the separate quantization agree here
    # too; a differing exp ulp would move a quantized value by one step (module docstring).
    monkeypatch.setenv("TILEQ_BACKEND", "triton")
    with torch.no_grad():
        got_t, want_t = mlp.act_down(gate_up[:1, :3]), _unfused(mlp, gate_up[:1, :3])
    assert (got_t.float() - want_t.float()).abs().max() <= 0.02 * want_t.float().abs().max()
    assert want_t.float().std() > 0.1 * want_t.float().abs().max()


def test_weight_only_mlp_keeps_act_fn(monkeypatch):
    import tileq.nn as tnn
    from tileq.integrations import hf

    mlp = _fused_tiny(tnn.W8A16Config())
    monkeypatch.setattr(hf, "silu_mul_quantize", lambda *a, **k: pytest.fail("weight-only fused"))
    gate_up = torch.randn(3, 768).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(mlp.act_down(gate_up), _unfused(mlp, gate_up))


def test_fused_mlp_compiles_with_the_op():
    import tileq.nn as tnn

    torch._dynamo.reset()
    mlp = _fused_tiny(tnn.A8W8Config())
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(mlp.act_down, fullgraph=True, backend=backend)
    gate_up = torch.randn(4, 768).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(compiled(gate_up), mlp.act_down(gate_up))
    # (each op through its inline twin, tileq.ops)
    assert "tileq.silu_mul_quantize_inline.default" in seen and "tileq.linear_inline.default" in seen
