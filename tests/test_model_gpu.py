"""The model layer on a GPU (scripts/gpu_run.sh tests-model): QuantLinear per config against the
reference, CUDA-graph capture and replay with inputs changed in place, torch.compile, and a
transformers decode step captured in a graph. Skipped without CUDA."""

import pytest
import torch
from torch import nn

import tileq
from tileq.integrations import compat
from tileq.nn import QuantLinear, config_from_name, quantize_
from tileq.testing import check_close

pytestmark = [
    pytest.mark.transformers,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIGS = ["A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A8"]


def _layer(name, k=5120, n=1536, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    return lin, QuantLinear.from_linear(lin, config_from_name(name))


def _reference(layer, x):
    """The same layer on CPU tensors: the torch reference executor for quantization and GEMM."""
    cpu = QuantLinear(layer.in_features, layer.out_features, layer.bias is not None, config=layer.config)
    cpu.load_state_dict({k: v.cpu() for k, v in layer.state_dict().items()})
    return cpu(x.cpu())


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("m", [1, 13, 300])
def test_quant_linear_on_gpu_matches_reference(name, m):
    lin, layer = _layer(name, seed=m)
    x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    want = _reference(layer, x)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all() and got.abs().max() > 0.1
    check_close(got.cpu(), want, torch.bfloat16)


@pytest.mark.parametrize("name", CONFIGS)
def test_quant_linear_cuda_graph_replay_with_new_inputs(name):
    _, layer = _layer(name, seed=1)
    x = torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16)
    layer(x)  # compile + fill the launch caches outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    for seed in (2, 3):
        x.copy_(torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, layer(x))  # the replay computed this input, bit for bit
        check_close(y.cpu(), _reference(layer, x), torch.bfloat16)


def test_nan_row_gives_nan_outputs_in_a_graph():
    _, layer = _layer("A8W8", seed=4)
    x = torch.randn(3, 5120, device="cuda", dtype=torch.bfloat16)
    layer(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    x[1, 7] = float("nan")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


@pytest.mark.parametrize("name", ["A8W8", "FP8Block", "W4A16"])
def test_compiled_model_matches_eager_on_gpu(name):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.SiLU(), nn.Linear(2048, 1024)).to("cuda", torch.bfloat16)
    quantize_(model, config_from_name(name))
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    eager = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    got = compiled(x)
    torch.cuda.synchronize()
    assert torch.equal(got, eager)


@pytest.mark.parametrize("name", ["A8W8", "FP8Row", "W4A16"])
def test_transformers_decode_step_in_a_cuda_graph(name):
    """A small Qwen3 with tileq layers: a decode step captured once and replayed gives the tokens of
    the eager decode (static cache; the cache position advances on the device)."""
    transformers = pytest.importorskip("transformers")
    from tileq.bench.e2e import build_model

    ids = torch.randint(0, 4096, (2, 24), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))

    def decode(graphs: bool):
        model = build_model(2, torch.device("cuda"), seed=0, small=True)
        quantize_(model, config_from_name(name))
        cache = transformers.StaticCache(config=model.config, max_cache_len=64)
        with torch.inference_mode():
            tok = model(input_ids=ids, **compat.cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
            toks = [tok]
            step = lambda t: model(input_ids=t, **compat.cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
            if not graphs:
                for _ in range(6):
                    toks.append(step(toks[-1]))
                return torch.cat(toks, 1)
            static = tok.clone()
            static.copy_(step(static))  # one eager step (also the warm-up)
            toks.append(static.clone())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static.copy_(step(static))
            for _ in range(5):
                graph.replay()
                toks.append(static.clone())
            return torch.cat(toks, 1)

    eager, graphed = decode(False), decode(True)
    torch.cuda.synchronize()
    assert torch.equal(eager, graphed)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("shape", [(1, 5120), (2, 8, 5120), (300, 5120)])
def test_eager_runner_matches_the_plain_path(name, shape):
    """QuantLinear's eager fast path (a LayerRunner per call signature, scratch buffers at decode
    sizes) computes exactly what the public functions compute, and follows weight changes."""
    from tileq.quant_linear import LayerRunner, quant_linear_forward

    _, layer = _layer(name, seed=6)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    first = layer(x)  # plain path; the signature is marked as seen
    assert type(layer._runners[next(iter(layer._runners))]) is not LayerRunner
    assert torch.equal(layer(x), first)  # second call: plain path again, and the runner is built
    assert [type(r) for r in layer._runners.values()] == [LayerRunner]
    for seed in (7, 8):
        x.copy_(torch.randn(*shape, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(seed)))
        fast = layer(x)
        plain = quant_linear_forward(layer.spec, x, layer.weight_operand(), layer.weight_scale, layer.bias,
                                     layer.input_scale)
        assert torch.equal(fast, plain) and fast.shape == first.shape
    _, other = _layer(name, seed=9)
    layer.load_state_dict(other.state_dict())  # new weights: the runners are dropped
    assert not layer._runners
    assert torch.equal(layer(x), other(x))
    if layer.config.act_dtype is not None:
        layer.set_input_scale(x.float().abs().max() / 100)
        y = layer(x)
        for _ in range(2):  # the second call builds the runner, the third runs it
            assert torch.equal(layer(x), y)
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 40, 8, 128), (4, 1, 40, 8, 128), (1, 37, 32, 8, 64), (2, 9, 16, 4, 256)])
def test_qk_norm_rope_on_gpu_matches_transformers(shape, norm):
    """tileq.qk_norm_rope on the GPU against transformers' Qwen3RMSNorm and apply_rotary_pos_emb
    run on the same GPU: bit for bit without the norm; with it within 2 ulps of each head's largest
    value (summation order, 1 / sqrt against the GPU's approximate rsqrt), nearly every value equal."""
    from transformers.models.qwen3 import modeling_qwen3 as mq

    from tileq.qk_rope import qk_norm_rope

    b, t, hq, hkv, d = shape
    g = torch.Generator(device="cuda").manual_seed(t)
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device="cuda", generator=g).mul(4).bfloat16()
    angle = torch.rand(b, t, d // 2, device="cuda", generator=g) * 40
    emb = torch.cat((angle, angle), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    q = qkv[..., :hq * d].reshape(b, t, hq, d)
    k = qkv[..., hq * d:(hq + hkv) * d].reshape(b, t, hkv, d)
    kw = {}
    if norm:
        qn, kn = mq.Qwen3RMSNorm(d, eps=1e-6).cuda().bfloat16(), mq.Qwen3RMSNorm(d, eps=1e-6).cuda().bfloat16()
        qn.weight.data.normal_(1, 0.2, generator=g)
        kn.weight.data.normal_(1, 0.2, generator=g)
        q, k = qn(q), kn(k)
        kw = dict(q_weight=qn.weight.data, k_weight=kn.weight.data, eps=1e-6)
    want = mq.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got = qk_norm_rope(qkv, cos, sin, q_heads=hq, kv_heads=hkv, **kw)
    for a, w in zip(got, want):
        assert a.shape == w.shape and a.dtype == w.dtype
        if norm:
            scale = w.float().abs().amax(-1, keepdim=True)
            assert ((a.float() - w.float()).abs() <= 2 * torch.finfo(w.dtype).eps * scale).all()
            # an rsqrt ulp moves a normalized value's rounding rarely (about 2**-8 of them, with the
            # partner each value's rotation reads)
            assert (a == w).float().mean() > 0.97
        else:
            assert torch.equal(a, w)


def test_qk_norm_rope_cache_write_on_gpu_matches_static_layer():
    """The kernel's static-cache write on the GPU against transformers' StaticLayer.update of
    transformers' own rotated k and v, over a prefill and two decode steps: bit for bit."""
    from transformers.cache_utils import StaticLayer
    from transformers.models.qwen3 import modeling_qwen3 as mq

    from tileq.qk_rope import qk_norm_rope

    b, hq, hkv, d, big = 2, 40, 8, 128, 64
    layer, ours = StaticLayer(max_cache_len=big), None
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (37, 1, 1):
        qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device="cuda", generator=g).mul(4).bfloat16()
        angle = torch.rand(b, t, d // 2, device="cuda", generator=g) * 40
        cos, sin = torch.cat((angle, angle), -1).cos().bfloat16(), torch.cat((angle, angle), -1).sin().bfloat16()
        q = qkv[..., :hq * d].reshape(b, t, hq, d).transpose(1, 2)
        k = qkv[..., hq * d:(hq + hkv) * d].reshape(b, t, hkv, d).transpose(1, 2)
        v = qkv[..., (hq + hkv) * d:].reshape(b, t, hkv, d).transpose(1, 2)
        tq, tk = mq.apply_rotary_pos_emb(q, k, cos, sin)
        want_keys, want_values = layer.update(tk, v)
        if ours is None:
            ours = (torch.zeros_like(want_keys), torch.zeros_like(want_values),
                    torch.zeros((), dtype=torch.int64, device="cuda"))
        gq, keys, values = qk_norm_rope(qkv, cos, sin, q_heads=hq, kv_heads=hkv, cache=ours)
        assert torch.equal(gq, tq) and torch.equal(keys, want_keys) and torch.equal(values, want_values)
        assert int(ours[2]) == int(layer.cumulative_length)


@pytest.mark.parametrize("b", [1, 16])
def test_decode_attention_on_gpu_matches_sdpa(b):
    """tileq.attention.decode_attention on the GPU at Qwen3-14B's attention shapes (40 query heads,
    8 kv heads, D 128) over a 2112-position static cache, its bool mask covering about 600 and about
    2100 positions per sequence (a few fewer for each later sequence): against a float64 reference
    (tests/test_decode_attention.py's bound: the softmax weights and the output rounded to bf16)
    and against torch's sdpa on the same GPU (twice that bound: sdpa rounds too). Positions past
    each mask hold huge values for the kernel, which never reads them; sdpa, which reads and then
    masks them, gets the clean cache."""
    import torch.nn.functional as F
    from test_decode_attention import assert_close, attention_float64

    from tileq.attention import decode_attention

    hq, hkv, d, length = 40, 8, 128, 2112
    g = torch.Generator(device="cuda").manual_seed(b)
    # x4: a peaked softmax, whose outputs stand far above the tolerance even over 2100 keys
    q = (torch.randn(b, 1, hq, d, device="cuda", generator=g) * 4).bfloat16().transpose(1, 2)
    keys = torch.randn(b, hkv, length, d, device="cuda", generator=g).bfloat16()
    values = torch.randn(b, hkv, length, d, device="cuda", generator=g).bfloat16()
    for valid in (600, 2100):
        ends = valid - 5 * torch.arange(b, device="cuda")
        mask = (torch.arange(length, device="cuda")[None, :] < ends[:, None])[:, None, None, :]
        k = keys.masked_fill(~mask[:, 0, 0, :, None].unsqueeze(1), 3e4)
        v = values.masked_fill(~mask[:, 0, 0, :, None].unsqueeze(1), 3e4)
        got = decode_attention(q, k, v, scaling=d ** -0.5, mask=mask)
        torch.cuda.synchronize()
        assert got.shape == (b, 1, hq, d) and got.is_contiguous() and torch.isfinite(got).all()
        assert_close(got.cpu(), attention_float64(q.cpu(), keys.cpu(), values.cpu(), mask.cpu(), d ** -0.5),
                     values.cpu())
        # sdpa gets the clean cache: its masked scores of the huge keys are inf before masking (NaN).
        sdpa = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d ** -0.5, enable_gqa=True)
        eps = torch.finfo(torch.bfloat16).eps
        bound = 2 * eps * (values.float().abs().max() + sdpa.float().abs().transpose(1, 2))
        assert ((got.float() - sdpa.transpose(1, 2).float()).abs() <= bound).all()


def test_compiled_decode_step_writes_the_static_cache_with_the_qk_kernel(monkeypatch):
    """A fused Qwen3 decode step compiled by inductor over a StaticCache with TILEQ_QK_ROPE=1 (the
    compiled route is opt-in until measured): the generated code
    launches tileq's q/k kernel itself (no tileq op call, no index_copy, no copy of a cache
    tensor), writes k and v in place, and its logits and cache follow the eager fused step's."""
    import transformers
    from torch._inductor.utils import run_and_get_code

    from tileq.integrations.hf import fuse_decoder_

    monkeypatch.setenv("TILEQ_QK_ROPE", "1")
    cfg = transformers.Qwen3Config(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                   vocab_size=1000, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    quantize_(model, config_from_name("A8W8"))
    fuse_decoder_(model)
    caches = [transformers.StaticCache(config=cfg, max_cache_len=64) for _ in range(2)]
    prompt = torch.randint(0, 1000, (1, 12), device="cuda")
    tok = torch.randint(0, 1000, (1, 1), device="cuda")
    torch._dynamo.reset()
    step = torch.compile(model.forward, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        for c in caches:
            model(input_ids=prompt, **compat.cache_kwargs(c), use_cache=True)
        eager = model(input_ids=tok, **compat.cache_kwargs(caches[0]), use_cache=True).logits
        got, code = run_and_get_code(lambda: step(input_ids=tok, **compat.cache_kwargs(caches[1]), use_cache=True).logits)
    torch.cuda.synchronize()
    code = "\n".join(code)
    assert "_qk_norm_rope_kernel" in code and "tileq.qk_norm_rope" not in code
    assert "index_copy" not in code and ".copy_(" not in code.split("def call(")[-1]  # written in place
    torch.testing.assert_close(got.float(), eager.float(), rtol=0.02, atol=0.02 * float(eager.abs().max()))
    for ours, want in zip(caches[1].layers, caches[0].layers):
        assert int(ours.cumulative_length) == int(want.cumulative_length) == 13
        torch.testing.assert_close(ours.keys.float(), want.keys.float(), rtol=0.02, atol=0.02)
        torch.testing.assert_close(ours.values.float(), want.values.float(), rtol=0.02, atol=0.02)
