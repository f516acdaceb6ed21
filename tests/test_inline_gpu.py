"""Inductor launching tileq's kernels itself (``tileq.ops``' inline twins) on a GPU
(scripts/gpu_run.sh tests-inline): compiled outputs equal the eager ones bit for bit, the
generated code launches the decode kernels directly (no tileq op, no copy of a weight), and a
compiled call's host time against the opaque op's. Skipped without CUDA; the tracing itself is
tested on the CPU (tests/test_inline.py)."""

import time

import pytest
import torch
from torch import nn

from tileq.nn import config_from_name, quantize_

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model(name, k=5120, n=3072, layers=2, seed=0):
    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(k if i % 2 == 0 else n, n if i % 2 == 0 else k, bias=i == 0))
    model = nn.Sequential(*mods).to("cuda", torch.bfloat16)
    quantize_(model, config_from_name(name))
    return model


def _compiled_code(fn, x) -> tuple[torch.Tensor, str]:
    from torch._inductor.utils import run_and_get_code

    out, code = run_and_get_code(fn, x)
    return out, "\n".join(code)


@pytest.mark.parametrize("name", ["A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A8"])
@pytest.mark.parametrize("m", [1, 5, 16, 300])
def test_inductor_output_equals_eager(name, m):
    model = _model(name, seed=m)
    x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
    eager = model(x)
    torch._dynamo.reset()
    got, code = _compiled_code(torch.compile(model, fullgraph=True), x)
    torch.cuda.synchronize()
    assert torch.equal(got, eager)
    if name in ("A8W8", "FP8Row", "FP8Block") and m <= 16:
        # decode: both kernels launched from inductor's code, no tileq op, no weight copied; the
        # split FP8Block GEMMs write the layer's tile counters in place (no copy of them either)
        assert "_gemm_kernel" in code and "_quantize_activation_kernel" in code
        assert "tileq.quant_linear" not in code
    assert "clone" not in code and ".copy_(" not in code.split("def call(")[-1]
    for layer in model:  # a kernel that counted on them put them back to zero
        assert not layer.tile_counters.any()


@pytest.mark.parametrize("name", ["A8W8", "FP8Block"])
def test_reduce_overhead_mode_captures_the_layers(name):
    """torch.compile's own CUDA graphs (mode="reduce-overhead") accept the layers' tile counters
    (buffers the graph writes in place): no cudagraph skip, replays equal eager on new inputs."""
    from torch._dynamo.utils import counters

    model = _model(name, layers=4)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # warm-up, recording, then replays
        torch.manual_seed(seed)
        x = torch.randn(1, 5120, device="cuda", dtype=torch.bfloat16)
        got = compiled(x).clone()
        torch.cuda.synchronize()
        assert torch.equal(got, model(x)), seed
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    for layer in model:
        assert not layer.tile_counters.any()


@pytest.mark.perf
@pytest.mark.parametrize("name", ["A8W8", "FP8Block"])
def test_compiled_decode_host_time(name, monkeypatch, capsys):
    """Host time of a compiled 8-layer decode call (batch 1, no CUDA graph) with the launches
    inlined against every op opaque (TILEQ_INLINE_LAUNCH=0), and bf16 through inductor."""
    model = _model(name, layers=8)
    ref = nn.Sequential(*[nn.Linear(5120 if i % 2 == 0 else 3072, 3072 if i % 2 == 0 else 5120)
                          for i in range(8)]).to("cuda", torch.bfloat16)
    x = torch.randn(1, 5120, device="cuda", dtype=torch.bfloat16)

    big = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def host_us(fn):
        for _ in range(20):
            fn(x)
        # ~0.2 s of GPU work first: after a compilation the GPU idles at a low clock, and a slow
        # GPU would fill the launch queue and hold the host back
        t_end = time.perf_counter() + 0.2
        while time.perf_counter() < t_end:
            big @ big
            torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(50):
                fn(x)
            best = min(best, (time.perf_counter() - t0) / 50 * 1e6)  # host time: calls are async
            torch.cuda.synchronize()
        return best

    times = {}
    for label, switch in (("inline", "1"), ("opaque", "0")):
        monkeypatch.setenv("TILEQ_INLINE_LAUNCH", switch)
        torch._dynamo.reset()
        times[label] = host_us(torch.compile(model, fullgraph=True))
    torch._dynamo.reset()
    times["bf16"] = host_us(torch.compile(ref, fullgraph=True))
    line = f"compiled 8-layer call, {name}, host us: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
    with capsys.disabled():
        print("\n" + line)
    assert times["inline"] <= 1.1 * times["opaque"], line
