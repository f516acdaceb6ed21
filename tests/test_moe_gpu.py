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
from tileq.dispatch.pdl import pdl_enabled
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


# ----------------------------------------------------------------------------- the masked form's kernels


def _routing_ids(t, k, e, kind, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":  # k distinct experts per token
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    elif kind == "skewed":  # every token on the same k experts: each at full capacity C = T
        ids = torch.arange(k).repeat(t, 1) + (e - k) // 2
    else:  # "one": every slot on one expert (C = T * k)
        ids = torch.full((t, k), e - 1)
    return ids.to(dtype).to(DEV)


def _align_launch(ids, w, x, xs, e, c):
    from tileq.kernels.moe_align import MoeAlignLaunch

    t, k = ids.shape
    return MoeAlignLaunch(t=t, topk=k, e=e, c=c, k_dim=x.shape[1], device=DEV, ids_dtype=ids.dtype,
                          ids_strides=ids.stride(), w_dtype=w.dtype, w_strides=w.stride(), x_dtype=x.dtype,
                          x_stride=x.stride(0), xs_shape=None if xs is None else tuple(xs.shape),
                          xs_strides=None if xs is None else xs.stride(), interpreted=False,
                          pdl=pdl_enabled(DEV, False))


def _check_alignment(out, ids, w, x, xs, e, c):
    """The align kernel's outputs against align() + the torch gathers / scatters on valid rows."""
    from tileq.moe import align
    from tileq.moe.layer import _gather, _scatter

    xg, sg, rs, counts, slot_rows = out
    al = align(ids, w, e, form="masked", capacity=c)
    assert torch.equal(counts, al.counts) and torch.equal(slot_rows.long(), al.slot_rows)
    valid = torch.arange(c, device=DEV)[None, :] < counts[:, None]
    want_x = _scatter(_gather(x, al.tokens), al.dest, (e, c))
    assert torch.equal(xg.view(torch.uint8)[valid], want_x.view(torch.uint8)[valid])
    assert torch.equal(rs[valid], _scatter(al.weights, al.dest, (e, c))[valid])
    if xs is not None:
        assert torch.equal(sg[valid], _scatter(xs[al.tokens], al.dest, (e, c))[valid])


def _sequential_combine(y, slot_rows, t, k):
    rows = y.reshape(-1, y.shape[-1])[slot_rows.long()].view(t, k, -1)
    acc = torch.zeros(t, y.shape[-1], device=DEV)
    for j in range(k):
        acc = acc + rows[:, j].float()
    return acc.to(y.dtype)


@pytest.mark.parametrize("t,k,e,kind,idt", [(1, 8, 256, "uniform", torch.int64), (16, 8, 128, "uniform", torch.int32),
                                            (32, 8, 128, "skewed", torch.int64), (4, 2, 8, "one", torch.int32)])
def test_moe_align_and_combine_kernels_gpu(t, k, e, kind, idt):
    from tileq.kernels.moe_align import MoeCombineLaunch

    c = t * k if kind == "one" else t
    ids = _routing_ids(t, k, e, kind, idt, seed=t + k)
    w = torch.rand(t, k, device=DEV)
    x = (torch.randn(t, 7168, device=DEV) * 4).to(torch.float8_e4m3fn)
    xs = torch.rand(t, 56, device=DEV)
    out = _align_launch(ids, w, x, xs, e, c)(ids, w, x, xs)
    _check_alignment(out, ids, w, x, xs, e, c)
    xb = torch.randn(t, 7168, device=DEV).bfloat16()  # bf16 rows without scales (W4A16 / W8A16)
    _check_alignment(_align_launch(ids, w, xb, None, e, c)(ids, w, xb, None), ids, w, xb, None, e, c)
    y = torch.randn(e, c, 7168, device=DEV).bfloat16()
    combine = MoeCombineLaunch(t=t, topk=k, rows=e * c, h=7168, y_stride=7168, y_dtype=torch.bfloat16,
                               out_dtype=torch.bfloat16, device=DEV, interpreted=False,
                               pdl=pdl_enabled(DEV, False))
    assert torch.equal(combine(y, out[4]), _sequential_combine(y, out[4], t, k))


def test_moe_align_and_combine_graph_replays_with_new_routing():
    from tileq.kernels.moe_align import MoeCombineLaunch

    t, k, e, h = 8, 4, 64, 2048
    ids = torch.empty(t, k, device=DEV, dtype=torch.int64)
    w = torch.empty(t, k, device=DEV)
    x = torch.empty(t, h, device=DEV, dtype=torch.float8_e4m3fn)
    xs = torch.empty(t, h // 128, device=DEV)
    y = torch.randn(e, t, h, device=DEV).bfloat16()

    def fill(seed, kind):
        g = torch.Generator(device=DEV).manual_seed(seed)
        ids.copy_(_routing_ids(t, k, e, kind, torch.int64, seed))
        w.copy_(torch.rand(t, k, device=DEV, generator=g))
        x.copy_((torch.randn(t, h, device=DEV, generator=g) * 4).to(torch.float8_e4m3fn))
        xs.copy_(torch.rand(t, h // 128, device=DEV, generator=g))

    align_launch = _align_launch(ids, w, x, xs, e, t)
    combine = MoeCombineLaunch(t=t, topk=k, rows=e * t, h=h, y_stride=h, y_dtype=torch.bfloat16,
                               out_dtype=torch.bfloat16, device=DEV, interpreted=False,
                               pdl=pdl_enabled(DEV, False))
    fill(0, "uniform")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        combine(y, align_launch(ids, w, x, xs)[4])  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = align_launch(ids, w, x, xs)
        combined = combine(y, out[4])
    for seed, kind in ((1, "uniform"), (2, "skewed"), (3, "uniform")):
        fill(seed, kind)
        graph.replay()
        torch.cuda.synchronize()
        _check_alignment(out, ids, w, x, xs, e, t)
        assert torch.equal(combined, _sequential_combine(y, out[4], t, k)), (seed, kind)


@pytest.mark.parametrize("name", ["A8W8", "FP8Block", "W4A16"])
def test_fused_moe_masked_kernels_equal_torch_ops_gpu(name, monkeypatch):
    from tileq.kernels import moe_align
    from tileq.moe import layer

    ex = _experts(name, e=32, h=512, i=256).to(DEV)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 512, generator=g).bfloat16().to(DEV)
    ids, w = softmax_topk(torch.randn(4, 32, generator=g) * 3, 4, normalize=True)
    ids, w = ids.to(DEV), w.to(DEV)
    monkeypatch.setattr(layer, "_KERNELS", {})
    got = fused_moe(x, (ids, w), ex, form="masked")
    assert all(layer._KERNELS.values())  # the kernels ran
    monkeypatch.setattr(layer, "_KERNELS", {})
    monkeypatch.setattr(moe_align, "MAX_SLOTS", 0)  # the torch ops
    want = fused_moe(x, (ids, w), ex, form="masked")
    assert list(layer._KERNELS.values()) == [False] and want.float().abs().max() > 1e-3
    assert torch.equal(got, want)
