"""GPU checks of the MoE layer and the fused SiLU·mul quantization (deselected without a GPU):

- silu_mul_quantize on CUDA against ``quantize_activation(silu(gate) * up)``: the GPU's expf and
  torch's may differ by an ulp, which can move a bf16 h and so one quantized value by one step;
- fused_moe on CUDA (both forms, every config) against the slot-by-slot reference on the CPU;
- a decode step and a prefill step captured in CUDA graphs, replayed with new hidden states and new
  routing written into the captured inputs: each replay equals an eager call on the same inputs
  bit for bit (the same kernels, no host synchronization in the captured work).
"""

import pytest
import torch

import tileq.nn as tnn
from tileq.activation import quantize_activation, silu_mul_quantize
from tileq.moe import QuantExperts, choose_form, fused_moe, fused_moe_ref, softmax_topk

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _step(q, qr, dtype):
    """Per element, how many quantization steps q is from qr (int8 values; fp8 by code distance)."""
    if dtype == "int8":
        return (q.int() - qr.int()).abs()
    a, b = q.view(torch.uint8).int(), qr.view(torch.uint8).int()
    same_sign = (a & 0x80) == (b & 0x80)
    return torch.where(same_sign, (a - b).abs(), (a & 0x7F) + (b & 0x7F))


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("granularity", ["row", "group"])
@pytest.mark.parametrize("m,i", [(1, 768), (16, 768), (4096, 768), (3, 18432), (7, 1000)])
def test_silu_mul_quantize_gpu(dtype, granularity, m, i):
    torch.manual_seed(0)
    x = (torch.randn(m, 2 * i, device=DEV) * 3).to(torch.bfloat16)
    q, s = silu_mul_quantize(x, dtype, granularity=granularity)
    gate, up = x.chunk(2, dim=-1)
    qr, sr = quantize_activation((torch.nn.functional.silu(gate) * up).contiguous(), dtype, granularity=granularity)
    steps = _step(q, qr, dtype)
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.999, (steps.max(), (steps == 0).float().mean())
    assert ((s - sr).abs() <= 1e-6 * sr.abs()).float().mean() > 0.99  # a scale moves only with its row's amax


def _experts(name, e=8, h=256, i=256):
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(e, 2 * i, h, generator=g) * 0.05).bfloat16()
    dn = (torch.randn(e, h, i, generator=g) * 0.05).bfloat16()
    return QuantExperts.from_weights(gu, dn, tnn.config_from_name(name))


@pytest.mark.parametrize("name", ["A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A8"])
def test_fused_moe_gpu_vs_reference(name):
    ex = _experts(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=g).bfloat16()
    ids, w = softmax_topk(torch.randn(5, 8, generator=g), 2, normalize=True)
    want = fused_moe_ref(x, ids, w, ex).float()
    ex_gpu = ex.to(DEV)
    for form in ("contiguous", "masked"):
        got = fused_moe(x.to(DEV), (ids.to(DEV), w.to(DEV)), ex_gpu, form=form).float().cpu()
        # fp32 summation in the grouped kernel vs float64 in the reference: gate_up may round one
        # bf16 ulp apart, and with it a quantized value by a step
        assert (got - want).abs().max() <= 0.03 * want.abs().max(), (form, (got - want).abs().max())


def _graph_replays_equal_eager(ex, t, k, form):
    e, h = ex.num_experts, ex.hidden_dim
    x = torch.empty(t, h, device=DEV, dtype=torch.bfloat16)
    ids = torch.empty(t, k, device=DEV, dtype=torch.int64)
    w = torch.empty(t, k, device=DEV, dtype=torch.float32)

    def fill(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x.copy_(torch.randn(t, h, device=DEV, generator=g))
        i, ww = softmax_topk(torch.randn(t, e, device=DEV, generator=g) * 3, k, normalize=True)
        ids.copy_(i)
        w.copy_(ww)

    fill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, (ids, w), ex, form=form)  # compile and cache outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_moe(x, (ids, w), ex, form=form)
    for seed in (1, 2, 3):
        fill(seed)
        graph.replay()
        torch.cuda.synchronize()
        want = fused_moe(x, (ids, w), ex, form=form)
        assert want.float().abs().max() > 1e-3
        assert torch.equal(y, want), (form, seed)


@pytest.mark.parametrize("name", ["FP8Block", "A8W8", "W4A16"])
def test_cuda_graph_decode_and_prefill(name):
    ex = _experts(name, e=32, h=512, i=256).to(DEV)
    assert choose_form(4, 32)[0] == "masked" and choose_form(512, 32)[0] == "contiguous"
    _graph_replays_equal_eager(ex, 4, 4, "auto")     # decode: masked form
    _graph_replays_equal_eager(ex, 512, 4, "auto")   # prefill: contiguous form
    _graph_replays_equal_eager(ex, 4, 4, "contiguous")
