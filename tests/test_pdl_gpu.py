"""Programmatic dependent launch on the GPU: decode chains (activation quantization -> GEMM ->
activation quantization -> GEMM ...) captured in CUDA graphs give the same bits with and without
PDL over many replays, with layers of one signature sharing one runner and its scratch (the
custom op's runners: each quantization overwrites the scratch the previous GEMM read, the hazard
PDL's wait must order). Plus a timing table (printed, run with -s): per layer, the two launches
with and without PDL, under CUDA graphs.

    TILEQ_TEST_GPU=1 python -m pytest -m gpu tests/test_pdl_gpu.py -s
"""

import pytest
import torch

from tileq import quant_linear as ql

pytestmark = pytest.mark.gpu

K = 5120
LAYERS = 6
REPLAYS = 40


def _layers(config: str, n_layers: int, k: int, n: int, seed: int = 0):
    from tileq.nn import QuantLinear, config_from_name

    torch.manual_seed(seed)
    out = []
    for _ in range(n_layers):
        lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02)
        out.append(QuantLinear.from_linear(lin, config_from_name(config)))
    return out


def _chain(layers, x):
    for layer in layers:  # the custom op's path: one runner (and scratch) per signature
        x = ql.quant_linear_cached(layer.spec, x, layer.weight, layer.weight_scale, layer.bias, None)
    return x


def _graph_outputs(monkeypatch, layers, inputs, pdl: str):
    monkeypatch.setenv("TILEQ_PDL", pdl)
    ql._OP_RUNNERS.clear()
    static = inputs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # runners are keyed by the stream: build them on the capture's
        for _ in range(3):
            _chain(layers, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = _chain(layers, static)
    runners = [r for r in ql._OP_RUNNERS.values() if isinstance(r, ql.LayerRunner)]
    assert runners, "no runner was built"
    outs = []
    for x in inputs:
        static.copy_(x)
        graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    return outs, runners


@pytest.mark.parametrize("config", ["A8W8", "FP8Row", "FP8Block"])
@pytest.mark.parametrize("m", [1, 16])
def test_graph_chain_is_bit_identical_with_pdl(monkeypatch, config, m):
    layers = _layers(config, LAYERS, K, K)
    gen = torch.Generator(device="cuda").manual_seed(m)
    inputs = [torch.randn(m, K, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(REPLAYS)]
    with_pdl, runners = _graph_outputs(monkeypatch, layers, inputs, "1")
    assert runners[0].gemm.launch.main.kwargs.get("launch_pdl") is True  # the launches really carried PDL
    without, runners0 = _graph_outputs(monkeypatch, layers, inputs, "0")
    assert "launch_pdl" not in runners0[0].gemm.launch.main.kwargs
    for i, (a, b) in enumerate(zip(with_pdl, without)):
        assert torch.isfinite(b).all() and b.abs().max() > 0, i
        assert torch.equal(a, b), (config, m, i)
    # and the graphs compute what eager calls compute
    monkeypatch.setenv("TILEQ_PDL", "0")
    assert torch.equal(_chain(layers, inputs[-1]), without[-1])


def _time_graph(fn, reps: int = 50) -> float:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph (warmed up on the
    capture stream, so the runners it uses are the captured ones)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


@pytest.mark.perf
def test_timing_table(monkeypatch, capsys):
    """Per layer of an 8-layer graph (8 distinct weights: more bytes than L2), microseconds, for
    the two launches with and without PDL. Printed; asserts nothing about speed (a measurement,
    for docs/performance.md)."""
    rows = []
    for config in ("A8W8", "FP8Row"):
        for name, k, n in (("qo", 5120, 5120), ("gate_up", 5120, 17408), ("down", 17408, 5120)):
            layers = _layers(config, 8, k, n)
            for m in (1, 4, 16):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                times = {}
                for pdl in ("0", "1"):
                    monkeypatch.setenv("TILEQ_PDL", pdl)
                    ql._OP_RUNNERS.clear()
                    times[pdl] = _time_graph(lambda x=x, layers=layers: [
                        ql.quant_linear_cached(la.spec, x, la.weight, la.weight_scale, la.bias, None)
                        for la in layers]) / len(layers)
                rows.append((config, name, m, times))
    with capsys.disabled():
        print("\nconfig  shape    M   2 launches  2 launches+PDL   (us per layer, CUDA graph)")
        for config, name, m, t in rows:
            print(f"{config:7} {name:8} {m:3} {t['0']:10.2f} {t['1']:14.2f}")
    assert all(v > 0 for *_, t in rows for v in t.values())
