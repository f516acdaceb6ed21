"""Per-token activation quantization inside the rowcol decode GEMM (one launch): bit for bit
``quantize_activation`` then ``linear`` (int8 and fp8, bf16 and fp16 activations, odd shapes,
bias, swapped and split configs, a NaN row), the layer path's choice (``dispatch.fused_quant``,
TILEQ_FUSED_QUANT) and the sm_90 build. The kernels run on Triton's interpreter here; the GPU test
at real sizes is marked ``gpu``."""

import json
import os
import pathlib
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from tileq import quant_linear as ql
from tileq.activation import quantize_activation
from tileq.api import linear_call
from tileq.dispatch import thresholds
from tileq.dispatch.fused_quant import choose_fused_quant
from tileq.dtypes import OperandType as OT
from tileq.errors import DTypeError, UnsupportedError
from tileq.kernels.fused_quant import FusedQuantLaunch
from tileq.kernels.launch import GemmLaunch

ROOT = pathlib.Path(__file__).resolve().parents[1]
ACT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("TILEQ_BACKEND", "triton")  # CPU tensors through the interpreter
    monkeypatch.delenv("TILEQ_FUSED_QUANT", raising=False)


def _weights(act, n, k, gen, device="cpu"):
    if act == "int8":
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        w = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    ws = torch.rand(n, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(n, generator=gen)
    return w.to(device), ws.to(device), bias.to(device)


def _two_launches(x, act, w, ws, bias, cfg_change=None):
    """(the GEMM launch of the quantized problem, its output): what the fused launch must equal."""
    q, s = quantize_activation(x, act, granularity="row", backend="triton")
    call = linear_call(q, w, s, ws, scheme="rowcol", out_dtype=x.dtype, bias=bias, group_k=128, group_n=1)
    launch = call.launch
    if cfg_change is not None:  # the same problem on another config (swapped, split over K)
        from tileq.dispatch.plan import make_plan, with_config
        from tileq.problem import build_problem

        problem = build_problem(q, w.t(), s, ws, scheme="rowcol", out_dtype=x.dtype, bias=bias)
        plan = make_plan(problem.spec, problem.device, backend="triton")
        launch = GemmLaunch(problem, with_config(plan, replace(plan.config, **cfg_change)))
    return launch, launch(q, w, s.float(), ws, bias, None, None)


CASES = [  # (act, x dtype, M, K, N, config change)
    ("int8", torch.bfloat16, 1, 200, 40, None),
    ("int8", torch.float16, 3, 1000, 96, None),
    ("int8", torch.bfloat16, 16, 200, 96, None),
    ("fp8", torch.bfloat16, 3, 200, 40, None),
    ("fp8", torch.float16, 16, 1000, 40, None),
    ("fp8", torch.bfloat16, 1, 1000, 96, None),
    ("int8", torch.bfloat16, 3, 200, 96, dict(swap_ab=True, block_m=64, block_n=16, block_k=64)),
    ("fp8", torch.float16, 16, 200, 40, dict(swap_ab=True, block_m=64, block_n=16, block_k=64)),
    ("int8", torch.float16, 16, 1000, 40, dict(split_k=3, block_k=128)),
    ("fp8", torch.bfloat16, 1, 200, 96, dict(swap_ab=True, block_m=64, block_n=16, block_k=64, split_k=2)),
]


@pytest.mark.parametrize("act,xdt,m,k,n,change", CASES)
def test_equals_quantize_then_linear_bit_for_bit(triton_backend, act, xdt, m, k, n, change):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = (torch.randn(m, k, generator=gen) * 3).to(xdt)
    w, ws, bias = _weights(act, n, k, gen)
    launch, ref = _two_launches(x, act, w, ws, bias, change)
    y = FusedQuantLaunch(launch, xdt, x.stride(0))(x, w, ws, bias)
    assert y.dtype == xdt and y.shape == (m, n)
    assert ref.float().abs().max() > 10  # far from all zeros
    assert torch.equal(y, ref)


def test_strided_rows_and_nan_row(triton_backend):
    """A sliced x (row stride above K) is read in place; a row holding NaN gives NaN outputs in
    that row only, as quantize_activation's NaN scale does, and the other rows stay exact."""
    gen = torch.Generator().manual_seed(7)
    big = (torch.randn(3, 260, generator=gen) * 2).to(torch.bfloat16)
    x = big[:, :200]
    x[1, 17] = float("nan")
    w, ws, bias = _weights("int8", 40, 200, gen)
    launch, ref = _two_launches(x, "int8", w, ws, bias)
    y = FusedQuantLaunch(launch, x.dtype, x.stride(0))(x, w, ws, bias)
    assert torch.isnan(y[1]).all() and torch.isnan(ref[1]).all()
    assert torch.equal(y[[0, 2]], ref[[0, 2]])


def test_refuses_what_it_cannot_run(triton_backend):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    w, ws, bias = _weights("int8", 40, 128, gen)
    launch, _ = _two_launches(x, "int8", w, ws, bias)
    with pytest.raises(DTypeError, match=r"x: expected dtype bfloat16 or float16, got torch.float32"):
        FusedQuantLaunch(launch, torch.float32, 128)
    # group scales (aquant): not a per-token problem
    q, s = quantize_activation(x, "int8", granularity="group", group_k=64, backend="triton")
    grouped = linear_call(q, w, s, torch.ones(2, 40), scheme="abquant", out_dtype=x.dtype, bias=None,
                          group_k=64, group_n=1)
    assert grouped.launch.fusable is None
    with pytest.raises(UnsupportedError, match=r"gemm: expected the portable kernel's launch of a rowcol"):
        FusedQuantLaunch(grouped.launch, x.dtype, 128)


# ----------------------------------------------------------------------------- the choice


def _choose(**kw):
    args = dict(m=1, scheme="rowcol", act_type=OT.I8, weight_type=OT.I8, granularity="row",
                x_dtype=torch.bfloat16, portable=True)
    return choose_fused_quant(**{**args, **kw})


DESIGNED_MAX_M = 16  # the rule's tests run with a positive threshold (sm_90 ships 0: measured slower)


@pytest.fixture
def designed_limit(monkeypatch):
    monkeypatch.setattr(thresholds.for_arch("sm_90"), "FUSED_QUANT_MAX_M", DESIGNED_MAX_M)
    return DESIGNED_MAX_M


def test_sm90_ships_it_off(monkeypatch):
    monkeypatch.delenv("TILEQ_FUSED_QUANT", raising=False)
    assert thresholds.for_arch("sm_90").FUSED_QUANT_MAX_M == 0
    assert not _choose(m=1).fused and "FUSED_QUANT_MAX_M=0" in _choose(m=1).reason


def test_rule(monkeypatch, designed_limit):
    monkeypatch.delenv("TILEQ_FUSED_QUANT", raising=False)
    limit = designed_limit
    assert _choose(m=limit).fused and not _choose(m=limit + 1).fused
    assert _choose(act_type=OT.FP8, weight_type=OT.FP8).fused
    for bad in (dict(scheme="abquant"), dict(granularity="tensor"), dict(weight_type=OT.FP8),
                dict(act_type=OT.BF8, weight_type=OT.BF8), dict(x_dtype=torch.float32), dict(portable=False)):
        assert not _choose(**bad).fused, bad
    monkeypatch.setenv("TILEQ_FUSED_QUANT", "0")
    assert _choose().reason == "TILEQ_FUSED_QUANT=0" and not _choose().fused
    monkeypatch.setenv("TILEQ_FUSED_QUANT", "1")
    assert _choose(m=4096).fused and not _choose(m=4096, portable=False).fused
    monkeypatch.setenv("TILEQ_FUSED_QUANT", "maybe")
    with pytest.raises(UnsupportedError, match=r"TILEQ_FUSED_QUANT: expected auto, 0 or 1, got 'maybe'"):
        _choose()


def _layer(act, n, k, seed=0):
    from tileq.nn.configs import A8W8Config, FP8RowConfig
    from tileq.nn.linear import QuantLinear

    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=True).to(torch.bfloat16)
    return QuantLinear.from_linear(lin, A8W8Config() if act == "int8" else FP8RowConfig())


def _runner_output(layer, x):
    """quant_linear_cached's output once its runner is built (third call), and the runner."""
    ql._OP_RUNNERS.clear()
    for _ in range(3):
        y = ql.quant_linear_cached(layer.spec, x, layer.weight, layer.weight_scale, layer.bias, None)
    runners = [r for r in ql._OP_RUNNERS.values() if isinstance(r, ql.LayerRunner)]
    assert len(runners) == 1
    return y, runners[0]


@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_layer_path_takes_it_up_to_the_threshold(triton_backend, monkeypatch, act, designed_limit):
    limit = designed_limit
    layer = _layer(act, 32, 136)
    for m, fused in ((limit, True), (limit + 1, False)):
        x = (torch.randn(m, 136) * 2).to(torch.bfloat16)
        monkeypatch.delenv("TILEQ_FUSED_QUANT", raising=False)
        y, runner = _runner_output(layer, x)
        assert (runner.fused is not None) == fused and (runner.aq is None) == fused, m
        monkeypatch.setenv("TILEQ_FUSED_QUANT", "0")
        y0, runner0 = _runner_output(layer, x)
        assert runner0.fused is None and runner0.aq is not None
        assert torch.equal(y, y0), m  # the one-launch path changes no bit
    monkeypatch.setenv("TILEQ_FUSED_QUANT", "1")
    _, forced = _runner_output(layer, (torch.randn(limit + 1, 136)).to(torch.bfloat16))
    assert forced.fused is not None


def test_static_scale_layers_keep_two_launches(triton_backend):
    """A calibrated per-tensor activation scale is not a per-token quantization: not fused."""
    layer = _layer("int8", 40, 128)
    ql._OP_RUNNERS.clear()
    x = torch.randn(2, 128).to(torch.bfloat16)
    scale = torch.tensor(0.05)
    for _ in range(3):
        ql.quant_linear_cached(layer.spec, x, layer.weight, layer.weight_scale, layer.bias, scale)
    (runner,) = [r for r in ql._OP_RUNNERS.values() if isinstance(r, ql.LayerRunner)]
    assert runner.fused is None and runner.aq is not None


# ----------------------------------------------------------------------------- sm_90 build

_COMPILE = r'''
import json, re, triton
from triton.backends.compiler import GPUTarget
from tileq.build import instance_for
from tileq.catalog.names import parse_family
from tileq.device import get_arch
from tileq.kernels import launch as gl
from tileq.kernels.gemm_kernel import _gemm_kernel
out = {}
for fam in ("rowcol_i8xi8_rcr_decode", "rowcol_fp8xfp8_rcr_decode"):
    for swap in (False, True):
        for x in ("bf16", "fp16"):
            inst, spec = instance_for(parse_family(fam), get_arch("sm_90"), swap)
            sig, consts, attrs = gl.signature(spec, inst.config, fused_x=x)
            c = triton.compile(triton.compiler.ASTSource(fn=_gemm_kernel, signature=sig, constexprs=consts,
                               attrs=attrs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": inst.config.num_warps, "num_stages": inst.config.num_stages})
            ptx = c.asm["ptx"]
            out[f"{fam}_{'swap' if swap else 'direct'}_{x}"] = {p: len(re.findall(re.escape(p), ptx)) for p in (
                "wgmma.mma_async", "div.rn.f32", "div.full.f32", "div.approx", "max.NaN.f32", "0f4B400000",
                "cvt.rn.satfinite.e4m3x2.f32", "ld.global.nc.b16", "ld.global")}
print(json.dumps(out))
'''


def test_sm90_build():
    """The fused kernel compiles to sm_90 code on a CPU: wgmma, IEEE scale divisions only per token
    (Markstein's fma pair per element), the int8 rounding add or the e4m3 conversion, the
    NaN-propagating max of the scales."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 8
    for name, c in res.items():
        assert c["wgmma.mma_async"] > 0 and c["max.NaN.f32"] > 0, (name, c)
        assert c["div.full.f32"] == 0 and c["div.approx"] == 0 and c["div.rn.f32"] >= 1, (name, c)
        if "_i8x" in name:
            assert c["0f4B400000"] > 0, (name, c)
        else:
            assert c["cvt.rn.satfinite.e4m3x2.f32"] > 0, (name, c)


# ----------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["int8", "fp8"])
@pytest.mark.parametrize("n", [27648, 5120, 17408])
def test_gpu_bit_for_bit_at_real_sizes(act, n):
    """K = 5120 (Qwen3-14B's hidden size), the decode Ms, bf16 activations, on the plan's own
    config (swapped where the decode rule swaps): the one launch equals the two bit for bit."""
    torch.manual_seed(n)
    dev = torch.device("cuda")
    k = 5120
    w, ws, bias = _weights(act, n, k, torch.Generator().manual_seed(1), dev)
    for m in (1, 2, 5, 16):
        x = (torch.randn(m, k, device=dev) * 3).to(torch.bfloat16)
        q, s = quantize_activation(x, act, granularity="row")
        call = linear_call(q, w, s, ws, scheme="rowcol", out_dtype=x.dtype, bias=bias, group_k=128, group_n=1)
        ref = call.run(q, w, s, ws, bias, None, None)
        fused = FusedQuantLaunch(call.launch, x.dtype, x.stride(0))
        y = fused(x, w, ws, bias)
        torch.cuda.synchronize()
        assert torch.equal(y, ref), (act, m, n)
