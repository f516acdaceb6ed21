"""tileq.integrations.hf.fuse_decoder_ on tiny random Llama-family models (transformers 5.17, CPU).

QuantLinear runs the torch reference on CPU tensors (float64 products), so a merged GEMM's columns
are bit-identical to the separate layers' outputs, and weight-only fused models (norms unchanged)
give bit-identical logits. With activation quantization the fused path computes the RMSNorm inside
``add_rmsnorm_quantize``: the same formula as transformers' RMSNorm, but its own reduction order
for the mean square may round one bf16 normed value differently, which can move a quantized value
by one step and the bf16 logits by a few ulps. LOGIT_TOL allows that (2% of the largest logit,
about 3 bf16 ulps at these logits' size, while the logits' spread is ~25% of that maximum).
Measured on CPU (2026-12-01): fused and unfused logits were bit-identical for every config, through
the reference and through the Triton kernels in the interpreter alike.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tileq.nn as tnn  # noqa: E402
from tileq.attention import decode_attention  # noqa: E402
from tileq.errors import UnsupportedError  # noqa: E402
from tileq.integrations import compat  # noqa: E402
from tileq.integrations.hf import (  # noqa: E402
    FuseSummary,
    fuse_decoder_,
    merge_quant_linears,
    split_quant_linear,
    unfuse_decoder_,
)

pytestmark = pytest.mark.transformers

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=128)
LOGIT_TOL = 0.02  # x max|unfused logits| (module docstring)
MODELS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def tiny(family="qwen3", config=None, *, seed=0, filter_fn=None, **over):
    """A bf16 tiny model with random weights, quantized with ``config`` (None: left in bf16)."""
    cfg_name, model_name = MODELS[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**{**TINY, **over}))
    model = model.to(torch.bfloat16).eval()
    if config is not None:
        tnn.quantize_(model, config, filter_fn)
    return model


def ids(batch=2, seq=9, seed=1):
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def fused_copy(model):
    fused = copy.deepcopy(model)
    summary = fuse_decoder_(fused)
    return fused, summary


def logits(model, x, **kw):
    with torch.no_grad():
        return model(x, **kw).logits.float()


def assert_logits_close(got, want, exact=False):
    tol = LOGIT_TOL * want.abs().max()
    assert want.std() > 5 * tol  # the expected values are far above the tolerance (docs/schemes.md section 7, rule 4)
    if exact:
        assert torch.equal(got, want)
        return
    assert (got - want).abs().max() <= tol, ((got - want).abs().max(), tol)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def assert_same_greedy(fused, unfused, x, **gen):
    """Greedy tokens equal; a difference is accepted only where the unfused model's top two logits
    were within the tolerance of each other (a near tie the fused path's rounding may break the
    other way), and the comparison stops there."""
    with torch.no_grad():
        a = fused.generate(x, max_new_tokens=4, do_sample=False, **gen)
        b = unfused.generate(x, max_new_tokens=4, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **gen)
    assert a.shape[1] > x.shape[1]
    for step, (ta, tb) in enumerate(zip(a[0, x.shape[1]:], b.sequences[0, x.shape[1]:])):
        if ta != tb:
            scores = b.scores[step][0].float()
            assert scores[tb] - scores[ta] <= LOGIT_TOL * scores.abs().max(), (step, ta, tb)
            return
    assert torch.equal(a, b.sequences)


ACT_CONFIGS = [tnn.A8W8Config(), tnn.FP8BlockConfig(), tnn.W4A16Config()]


# ----------------------------------------------------------------------------- merging


@pytest.mark.parametrize("config", [tnn.A8W8Config(), tnn.FP8RowConfig(), tnn.FP8BlockConfig(), tnn.W8A16Config(),
                                    tnn.W4A16Config(), tnn.W4A16Config(group_size=None), tnn.W4A8Config()],
                         ids=lambda c: c.name + ("" if getattr(c, "group_size", 1) else "-col"))
def test_merge_exact(config):
    torch.manual_seed(0)
    # Bias on two parts of three (a missing one becomes zeros); the last part's N may be partial
    # for 128 x 128 blocks.
    linears = [torch.nn.Linear(256, 256, bias=True), torch.nn.Linear(256, 128, bias=False),
               torch.nn.Linear(256, 200, bias=True)]
    parts = [tnn.QuantLinear.from_linear(lin.to(torch.bfloat16), config) for lin in linears]
    merged = merge_quant_linears(parts)
    assert merged.out_features == 584 and merged.config == config
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    want = torch.cat([p(x) for p in parts], -1)
    got = merged(x)
    assert want.abs().max() > 0.1
    assert torch.equal(got, want)  # the reference sums in float64: the same columns, bit for bit
    back = split_quant_linear(merged, [256, 128, 200], [True, False, True])
    for p, b in zip(parts, back):
        assert b.bias is None if p.bias is None else torch.equal(b.bias, p.bias)
        assert torch.equal(b.weight, p.weight) and torch.equal(b.weight_scale, p.weight_scale)


def test_merge_refusals():
    torch.manual_seed(0)
    lin = [torch.nn.Linear(256, n, bias=False).to(torch.bfloat16) for n in (64, 128)]
    block = [tnn.QuantLinear.from_linear(x, tnn.FP8BlockConfig()) for x in lin]
    with pytest.raises(UnsupportedError, match="layers\\[0\\] has N=64, not a multiple of 128"):
        merge_quant_linears(block)
    mixed = [tnn.QuantLinear.from_linear(lin[0], tnn.A8W8Config()),
             tnn.QuantLinear.from_linear(lin[1], tnn.FP8RowConfig())]
    with pytest.raises(UnsupportedError, match="mixed configs"):
        merge_quant_linears(mixed)
    with pytest.raises(UnsupportedError, match="projections not QuantLinear"):
        merge_quant_linears([block[1], lin[1]])


# ----------------------------------------------------------------------------- fused models


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("config", ACT_CONFIGS, ids=lambda c: c.name)
def test_fused_logits_and_generate(family, config):
    model = tiny(family, config)
    fused, summary = fused_copy(model)
    assert summary.fused == ["model.layers.0", "model.layers.1"] and summary.kept == []
    layer = fused.model.layers[0]
    assert isinstance(layer, type(model.model.layers[0]))  # a subclass: transformers' hooks still match
    assert not hasattr(layer.self_attn, "q_proj") and layer.self_attn.qkv_proj.out_features == 256 + 2 * 128
    assert layer.mlp.gate_up_proj.out_features == 2 * 512
    x = ids()
    weight_only = config.act_dtype is None
    assert_logits_close(logits(fused, x), logits(model, x), exact=weight_only)
    assert_same_greedy(fused, model, x[:1])                                   # DynamicCache
    assert_same_greedy(fused, model, x[:1], cache_implementation="static")   # StaticCache


@pytest.mark.one_release
def test_fused_through_triton_kernels(monkeypatch):
    # The GEMMs and add_rmsnorm_quantize through the Triton kernels (the interpreter on CPU): the
    # merged GEMM's columns and the fused norm + quantization against the separate ones.
    model = tiny("qwen3", tnn.FP8BlockConfig())
    fused, _ = fused_copy(model)
    x = ids(batch=1, seq=5)
    monkeypatch.setenv("TILEQ_BACKEND", "triton")
    assert_logits_close(logits(fused, x), logits(model, x))


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families(family):
    # Qwen2 has q/k/v biases (merged with the weights); Mistral passes the config's sliding_window.
    model = tiny(family, tnn.A8W8Config())
    fused, summary = fused_copy(model)
    assert len(summary.fused) == 2, str(summary)
    if family == "qwen2":
        assert fused.model.layers[0].self_attn.qkv_proj.bias is not None
    x = ids()
    assert_logits_close(logits(fused, x), logits(model, x))


def test_hidden_states_and_standalone_modules():
    model = tiny("qwen3", tnn.A8W8Config())
    fused, _ = fused_copy(model)
    x = ids()
    with torch.no_grad():
        want = model(x, output_hidden_states=True).hidden_states
        got = fused(x, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 3  # transformers' hooks match the fused subclass
    for g, w in zip(got, want):
        assert (g.float() - w.float()).abs().max() <= LOGIT_TOL * w.float().abs().max()
    # The fused MLP still works as a module on its own.
    h = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fused.model.layers[1].mlp(h), model.model.layers[1].mlp(h))


def test_static_activation_scale():
    model = tiny("llama", tnn.A8W8Config())
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                     layer.mlp.gate_proj, layer.mlp.up_proj):
            proj.set_input_scale(0.05)
    fused, summary = fused_copy(model)
    assert len(summary.fused) == 2 and "static activation scale" in str(summary)
    x = ids()
    assert_logits_close(logits(fused, x), logits(model, x), exact=True)  # norms unchanged
    model.model.layers[0].self_attn.k_proj.set_input_scale(0.07)
    _, summary = fused_copy(model)
    assert summary.fused == ["model.layers.1"]
    assert summary.kept == [("model.layers.0", "different static activation scales on self_attn.q_proj, "
                                                "self_attn.k_proj, self_attn.v_proj")]


def test_state_dict_and_unfuse():
    model = tiny("qwen3", tnn.FP8BlockConfig())
    before = model.state_dict()
    fused, _ = fused_copy(model)
    sd = fused.state_dict()
    assert "model.layers.0.self_attn.qkv_proj.weight" in sd and "model.layers.0.mlp.gate_up_proj.weight_scale" in sd
    assert not any(".q_proj." in k or ".gate_proj." in k for k in sd)
    other, _ = fused_copy(tiny("qwen3", tnn.FP8BlockConfig(), seed=5))
    other.load_state_dict(sd)  # merged tensors load into a fused model of the same shape
    x = ids()
    assert torch.equal(logits(other, x), logits(fused, x))
    assert unfuse_decoder_(fused) == ["model.layers.0", "model.layers.1"]
    after = fused.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert type(fused.model.layers[0]) is type(model.model.layers[0])
    assert torch.equal(logits(fused, x), logits(model, x))


# ----------------------------------------------------------------------------- torch.compile


def _tileq_ops(seen) -> set:
    """The tileq ops a dynamo graph calls, an op's inline twin (``tileq.ops``, which the backend
    decomposes) named as the op it serves."""
    return {t.replace("_inline.", ".") for t in seen if "tileq" in t}


def _recording(backend, seen):
    def compile_fn(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)
    return compile_fn


@pytest.mark.parametrize("config", ACT_CONFIGS, ids=lambda c: c.name)
def test_compile_fullgraph(config):
    # aot_eager traces the fake implementations (shapes, dtypes, strides) and then runs the same
    # ops eagerly: the outputs are bit-identical to the eager fused model's.
    torch._dynamo.reset()
    fused, _ = fused_copy(tiny("qwen3", config))
    seen = []
    compiled = torch.compile(fused, fullgraph=True, backend=_recording("aot_eager", seen))
    x = ids()
    assert torch.equal(logits(compiled, x), logits(fused, x))
    assert all("_inline." in t for t in seen if "tileq" in t), seen  # every op through its twin
    ops = _tileq_ops(seen)
    if config.act_dtype is None:
        assert ops == {"tileq.quant_linear.default"}  # q/k: transformers' operations unless TILEQ_QK_ROPE=1
    else:
        assert {"tileq.rmsnorm_quantize.default", "tileq.add_rmsnorm_quantize.default", "tileq.linear.default"} <= ops
        assert "tileq.qk_norm_rope.default" not in ops


def test_compile_inductor():
    # Inductor generates C++ for everything around the tileq ops (about 10 s on a CPU).
    # emulate_precision_casts rounds its fused bf16 chains (rotary, q/k norms, silu * up, residual
    # adds) where eager rounds; without it the logits moved by ~2 bf16 ulps (0.018 of 1.25).
    torch._dynamo.reset()
    fused, _ = fused_copy(tiny("qwen3", tnn.A8W8Config()))
    x = ids()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = torch.compile(fused, fullgraph=True, backend="inductor")
        assert_logits_close(logits(compiled, x), logits(fused, x))


@pytest.mark.parametrize("qk_rope", ["unset", "1"])
def test_compile_static_cache_generate(qk_rope, monkeypatch):
    # transformers' recipe for compiled decoding: a StaticCache keeps the shapes fixed, so one
    # prefill graph and one decode graph serve every step. With TILEQ_QK_ROPE=1 the decode graph
    # writes k and v into the cache with the q/k op (mutating the cache's tensors), not
    # StaticLayer.update's index_copy_; unset, compiled code keeps transformers' operations.
    if qk_rope != "unset":
        monkeypatch.setenv("TILEQ_QK_ROPE", qk_rope)
    torch._dynamo.reset()
    model = tiny("qwen3", tnn.A8W8Config())
    fused, _ = fused_copy(model)
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")])
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    fused.forward = torch.compile(fused.forward, fullgraph=True, backend=record)
    assert_same_greedy(fused, model, ids(batch=1), cache_implementation="static")
    # the decode graph's attention: tileq's decode attention op, once per layer (TILEQ_DECODE_ATTN unset)
    decode = [g for g in graphs if "tileq.decode_attention_inline.default" in g]
    assert decode and len(decode) < len(graphs), graphs  # not the prefill's
    assert all(g.count("tileq.decode_attention_inline.default") == TINY["num_hidden_layers"] for g in decode)
    writers = [g for g in graphs if "tileq.qk_norm_rope_cache_inline.default" in g]
    if qk_rope == "unset":
        assert not writers and not [g for g in graphs if "tileq.qk_norm_rope_inline.default" in g]
        return
    assert writers, graphs
    for g in writers:
        assert g.count("tileq.qk_norm_rope_cache_inline.default") == TINY["num_hidden_layers"]
        assert not [t for t in g if "index_copy" in t], g


# ----------------------------------------------------------------------------- refusals


def test_refusals_unquantized_and_mixed():
    model = tiny("qwen3", None)
    summary = fuse_decoder_(model)
    assert summary.fused == []
    assert summary.kept == [(f"model.layers.{i}", "projections not QuantLinear (self_attn.q_proj is Linear)")
                            for i in range(2)]
    assert type(model.model.layers[0]).__name__ == "Qwen3DecoderLayer"

    # k_proj of layer 0 quantized with another config; layer 1 fusable: converted, layer 0 kept.
    model = tiny("qwen3", tnn.A8W8Config(), filter_fn=lambda m, n: n != "model.layers.0.self_attn.k_proj")
    tnn.quantize_(model, tnn.FP8RowConfig(), lambda m, n: n == "model.layers.0.self_attn.k_proj")
    unfused = copy.deepcopy(model)
    summary = fuse_decoder_(model)
    assert summary.fused == ["model.layers.1"]
    [(name, why)] = summary.kept
    assert name == "model.layers.0" and why.startswith("mixed configs: self_attn.q_proj is A8W8")
    assert hasattr(model.model.layers[0].self_attn, "k_proj")
    x = ids()
    assert_logits_close(logits(model, x), logits(unfused, x))
    again = fuse_decoder_(model)
    assert again.fused == [] and ("model.layers.1", "already fused") in again.kept


def test_refusal_fp8_block_n():
    # head_dim 32: k_proj's N = 2 x 32 = 64 would share a 128-row scale block with v_proj's rows.
    model = tiny("llama", tnn.FP8BlockConfig(), head_dim=32)
    summary = fuse_decoder_(model)
    assert summary.fused == []
    assert summary.kept[0] == ("model.layers.0", "FP8Block scales 128x128 blocks: self_attn.k_proj has N=64, "
                                                 "not a multiple of 128")


def test_refusal_unknown_layer_class():
    class MyDecoderLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = torch.nn.Identity(), torch.nn.Identity()
            self.input_layernorm = self.post_attention_layernorm = torch.nn.Identity()

    model = torch.nn.Sequential(MyDecoderLayer())
    summary = fuse_decoder_(model)
    assert isinstance(summary, FuseSummary) and summary.fused == []
    [(name, why)] = summary.kept
    assert name == "0" and why.startswith("unknown layer class") and "MyDecoderLayer" in why
    assert "no decoder layers found" in str(fuse_decoder_(torch.nn.Linear(2, 2)))
    with pytest.raises(UnsupportedError, match="model: expected a torch.nn.Module"):
        fuse_decoder_("model")


# ----------------------------------------------------------------------------- checkpoints

SAVE_CONFIGS = [tnn.A8W8Config(), tnn.FP8RowConfig(), tnn.FP8BlockConfig(), tnn.W8A16Config(),
                tnn.W4A16Config(), tnn.W4A8Config()]


@pytest.mark.parametrize("config", SAVE_CONFIGS, ids=lambda c: c.name)
def test_fused_model_saves_the_standard_layout(config, tmp_path):
    from tileq.formats import from_pretrained, save_pretrained

    model = tiny("qwen3", config)
    fused, summary = fused_copy(model)
    assert summary.fused == ["model.layers.0", "model.layers.1"], str(summary)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    save_pretrained(fused, tmp_path)
    # The fused model is left as it was ...
    assert isinstance(fused.model.layers[0].self_attn.qkv_proj, tnn.QuantLinear)
    after = fused.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # ... and the checkpoint is the unfused model's: it loads, with the same tensors and logits as
    # the unfused model's own checkpoint.
    save_pretrained(model, tmp_path / "unfused")
    loaded, want = from_pretrained(tmp_path), from_pretrained(tmp_path / "unfused")
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, tnn.QuantLinear)
    got_state, want_state = loaded.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    x = ids(batch=1, seq=5)
    assert torch.equal(logits(loaded, x), logits(want, x))


def test_fused_checkpoint_says_what_happened(tmp_path):
    from tileq.errors import CheckpointError
    from tileq.formats import from_pretrained, save_pretrained
    from tileq.formats.safetensors_io import CheckpointReader, write_checkpoint

    model = tiny("qwen3", tnn.A8W8Config())
    save_pretrained(model, tmp_path)
    # A checkpoint holding merged tensors, as fused models were once written.
    with CheckpointReader(tmp_path) as reader:
        tensors = [(k.replace("self_attn.q_proj.", "self_attn.qkv_proj."), reader.read(k)) for k in reader.keys()]
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    write_checkpoint(tensors, tmp_path)
    with pytest.raises(CheckpointError, match=r"self_attn\.qkv_proj.*fuse_decoder_.*Save the model again"):
        from_pretrained(tmp_path)


# ----------------------------------------------------------------------------- MoE decoder layers

MOE_TINY = dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[1])


def tiny_moe(config=None, seed=0):
    """A tiny Qwen3-MoE: layer 0 sparse (experts), layer 1 dense (``mlp_only_layers``)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY, **MOE_TINY))
    model = model.to(torch.bfloat16).eval()
    if config is not None:
        tnn.quantize_(model, config)
    return model


@pytest.mark.parametrize("config", ACT_CONFIGS, ids=lambda c: c.name)
def test_moe_layers_fuse_their_attention(config):
    # The sparse layer merges q/k/v and fuses its input norm with their quantization; its MoE block
    # stays transformers' (the experts run fused_moe); the dense layer fuses as a Qwen3 layer does.
    model = tiny_moe(config)
    fused, summary = fused_copy(model)
    assert summary.fused == ["model.layers.0", "model.layers.1"], str(summary)
    sparse, dense = fused.model.layers
    assert "q/k/v GEMMs merged" in summary.how["model.layers.0"]
    assert "MoE block unchanged" in summary.how["model.layers.0"]
    assert isinstance(sparse.self_attn.qkv_proj, tnn.QuantLinear)
    assert type(sparse.mlp) is transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    assert isinstance(dense.mlp.gate_up_proj, tnn.QuantLinear)
    x = ids()
    assert_logits_close(logits(fused, x), logits(model, x), exact=config.act_dtype is None)
    assert_same_greedy(fused, model, x[:1], cache_implementation="static")
    assert unfuse_decoder_(fused) == ["model.layers.0", "model.layers.1"]
    assert list(fused.state_dict()) == list(model.state_dict())
    assert torch.equal(logits(fused, x), logits(model, x))


def test_moe_fused_model_saves_the_standard_layout(tmp_path):
    from tileq.formats import from_pretrained, save_pretrained

    model = tiny_moe(tnn.FP8BlockConfig())
    fused, _ = fused_copy(model)
    save_pretrained(fused, tmp_path)
    save_pretrained(model, tmp_path / "unfused")
    loaded, want = from_pretrained(tmp_path), from_pretrained(tmp_path / "unfused")
    got_state, want_state = loaded.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)


def test_moe_fused_compile_fullgraph():
    torch._dynamo.reset()
    fused, _ = fused_copy(tiny_moe(tnn.A8W8Config()))
    seen = []
    compiled = torch.compile(fused, fullgraph=True, backend=_recording("aot_eager", seen))
    x = ids()
    assert torch.equal(logits(compiled, x), logits(fused, x))
    assert {"tileq.rmsnorm_quantize.default", "tileq.fused_moe.default", "tileq.linear.default"} <= _tileq_ops(seen)


@pytest.mark.one_release
def test_moe_fused_through_triton_kernels(monkeypatch):
    # The fused norm + quantization, the merged q/k/v GEMM and fused_moe's kernels (the
    # interpreter on CPU) against the unfused model through the same kernels.
    model = tiny_moe(tnn.FP8BlockConfig())
    fused, _ = fused_copy(model)
    x = ids(batch=1, seq=5)
    monkeypatch.setenv("TILEQ_BACKEND", "triton")
    assert_logits_close(logits(fused, x), logits(model, x))


@pytest.mark.one_release
@pytest.mark.parametrize("config", ["A8W8", "FP8Block", "W8A16"])
def test_eager_fused_decode_steps_skip_validation(config, monkeypatch):
    """After warm-up, an eager decode step of a fused model launches from kept launches only:
    no QuantLinear call (forward or forward_quantized) goes back to the validating
    ``quant_linear_forward`` / ``tileq.linear``, and the fused norm and SiLU quantizations plan
    nothing anew, nor does the decode attention (the Triton executor, interpreted here, as a GPU
    runs it)."""
    import tileq.activation as act
    import tileq.attention as attention
    import tileq.nn.linear as nl

    monkeypatch.setenv("TILEQ_BACKEND", "triton")
    fused, _ = fused_copy(tiny("qwen3", tnn.config_from_name(config), num_hidden_layers=1))
    cache = transformers.StaticCache(config=fused.config, max_cache_len=16)
    tok = ids(batch=1, seq=3)
    with torch.inference_mode():
        def step(tok, pos):
            out = fused(input_ids=tok, **compat.cache_kwargs(cache), use_cache=True,
                        cache_position=torch.arange(pos, pos + tok.shape[1]))
            return out.logits[:, -1:].argmax(-1)

        tok = step(tok, 0)
        for pos in range(3, 5):  # a signature's first call is noted, its second builds its launch
            tok = step(tok, pos)
        slow = []
        for name in ("linear", "quant_linear_forward"):
            monkeypatch.setattr(nl, name, lambda *a, _f=getattr(nl, name), _n=name, **k: slow.append(_n) or _f(*a, **k))
        for name in ("_build_fused", "_build_silu", "_build_quantize"):
            monkeypatch.setattr(act, name, lambda *a, _f=getattr(act, name), _n=name, **k: slow.append(_n) or _f(*a, **k))
        monkeypatch.setattr(attention, "_build", lambda *a, _f=attention._build: slow.append("attention") or _f(*a))
        tok = step(tok, 5)
    assert slow == []


def _qk_kernel_interpreted(monkeypatch):
    """The fused attention's q/k preparation through its Triton kernel (interpreted), everything
    else on the backend the test runs (the reference: fast on a CPU)."""
    import tileq.integrations.hf as hf

    real = hf.qk_norm_rope
    monkeypatch.setattr(hf, "qk_norm_rope", lambda *a, **k: real(*a, **{**k, "backend": "triton"}))


@pytest.mark.parametrize("family,config", [("qwen3", "A8W8"), ("llama", "W8A16")])
def test_eager_fused_attention_prepares_q_and_k_in_one_launch(family, config, monkeypatch):
    """Eager fused layers (the Triton executor, interpreted) prepare q and k with tileq's one
    kernel (Qwen3: per-head norms + rotary embedding; Llama: the rotation alone), once per layer,
    and their logits stay close to the unfused model's; TILEQ_QK_ROPE=0 gives transformers'
    operations back. The GEMMs run on the reference backend (the q/k kernel is the subject)."""
    from tileq.kernels import direct

    _qk_kernel_interpreted(monkeypatch)
    model = tiny(family, tnn.config_from_name(config))
    fused, _ = fused_copy(model)
    x = ids(batch=2, seq=5)
    launches = []
    call = direct.KernelCall.__call__
    monkeypatch.setattr(direct.KernelCall, "__call__",
                        lambda self, ptrs, d: launches.append(self.name) or call(self, ptrs, d))
    got = logits(fused, x)
    assert launches.count("_qk_norm_rope_kernel") == TINY["num_hidden_layers"]
    assert_logits_close(got, logits(model, x))
    launches.clear()
    monkeypatch.setenv("TILEQ_QK_ROPE", "0")
    off = logits(fused, x)
    assert "_qk_norm_rope_kernel" not in launches
    assert_logits_close(got, off)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_eager_fused_decode_writes_the_static_cache_itself(family, monkeypatch):
    """Eager decode steps of a fused model over a StaticCache (the Triton executor, interpreted):
    after the prefill (whose update makes the cache's tensors), each layer's k and v go into the
    cache from the q/k kernel, StaticLayer.update is not called, and the logits, the cache's
    contents and its length follow the unfused model's over the same steps. The GEMMs run on the
    reference backend (the q/k kernel writing the cache is the subject)."""
    from transformers.cache_utils import StaticLayer

    _qk_kernel_interpreted(monkeypatch)
    model = tiny(family, tnn.config_from_name("A8W8"))
    fused, _ = fused_copy(model)
    updates = []
    update = StaticLayer.update
    monkeypatch.setattr(StaticLayer, "update", lambda self, *a, **k: updates.append(1) or update(self, *a, **k))
    caches = [transformers.StaticCache(config=m.config, max_cache_len=16) for m in (fused, model)]
    tok = ids(batch=2, seq=4)
    with torch.inference_mode():
        outs = [m(input_ids=tok, **compat.cache_kwargs(c), use_cache=True).logits for m, c in zip((fused, model), caches)]
        for step in range(3):
            assert_logits_close(outs[0].float(), outs[1].float())
            updates.clear()
            tok = outs[1][:, -1:].argmax(-1)
            logits = fused(input_ids=tok, **compat.cache_kwargs(caches[0]), use_cache=True).logits
            assert updates == []  # no layer went through StaticLayer.update
            outs = [logits, model(input_ids=tok, **compat.cache_kwargs(caches[1]), use_cache=True).logits]
    for got, want in zip(caches[0].layers, caches[1].layers):
        assert int(got.cumulative_length) == int(want.cumulative_length) == 7
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            assert (a[:, :, 7:] == 0).all() and (b[:, :, 7:] == 0).all()
            assert (a[:, :, :7].float() - b[:, :, :7].float()).abs().max() <= 0.05 * b.float().abs().max()


@pytest.mark.parametrize("cache,padded", [("static", True), ("static", False), ("dynamic", False)])
def test_eager_fused_decode_attention(cache, padded, monkeypatch):
    """Eager decode steps of a fused Qwen3 run attention through ``tileq.attention.decode_attention``
    (its Triton kernels, interpreted; the GEMMs through the reference, which keeps this fast), once
    per layer and step (the prefill keeps transformers' sdpa), over a StaticCache with a left-padded
    batch (transformers passes a bool mask [B, 1, 1, L]) or without padding; a DynamicCache, whose
    keys grow every step, keeps sdpa. Tokens and logits as with TILEQ_DECODE_ATTN=0 (transformers'
    sdpa)."""
    import tileq.integrations.hf as hf

    fused, _ = fused_copy(tiny("qwen3", tnn.A8W8Config()))
    x = ids(batch=2, seq=5)
    attention_mask = torch.ones_like(x)
    if padded:
        attention_mask[1, :2] = 0
    calls = []

    def kernel(q, keys, values, *, scaling, mask):
        calls.append(None if mask is None else (mask.dtype, tuple(mask.shape)))
        return decode_attention(q, keys, values, scaling=scaling, mask=mask, backend="triton")

    monkeypatch.setattr(hf, "decode_attention", kernel)

    def generate():
        gen = dict(cache_implementation="static") if cache == "static" else {}
        with torch.no_grad():
            return fused.generate(x, attention_mask=attention_mask, max_new_tokens=3, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True, **gen)

    on = generate()
    steps = 2  # three new tokens: the prefill's and two decode steps'
    if cache == "static":  # one bool mask shape over the cache's fixed length
        assert len(calls) == steps * TINY["num_hidden_layers"]
        (dtype, shape), = set(calls)
        assert dtype == torch.bool and shape[:3] == (2, 1, 1), calls
    else:
        assert calls == []
    calls.clear()
    monkeypatch.setenv("TILEQ_DECODE_ATTN", "0")
    off = generate()
    assert calls == []
    assert torch.equal(on.sequences, off.sequences)
    for got, want in zip(on.scores, off.scores):
        assert_logits_close(got.float(), want.float())


def test_decode_attention_routing_conditions(monkeypatch):
    """``_attention_fuses``: transformers' sdpa with no mask or a bool [B or 1, 1, 1, L] one, or the
    model's eager attention without a mask, at one query token; anything else keeps transformers'
    function."""
    from types import SimpleNamespace

    from transformers import DynamicCache, StaticCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3 import modeling_qwen3 as mq

    from tileq.integrations.hf import _attention_fuses

    fused, _ = fused_copy(tiny("qwen3", tnn.A8W8Config()))
    attn = fused.model.layers[0].self_attn
    q = torch.randn(2, 1, 4, 64).bfloat16().transpose(1, 2)
    k = torch.randn(2, 2, 16, 64).bfloat16()
    v = torch.randn(2, 2, 16, 64).bfloat16()
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    eager = mq.eager_attention_forward

    static = SimpleNamespace(is_compileable=True)  # (what the route reads of a StaticCache)

    def fuses(interface=sdpa_attention_forward, q=q, k=k, v=v, mask=mask, cache=static, **kwargs):
        return _attention_fuses(attn, interface, q, k, v, mask, cache, kwargs)

    assert fuses() and fuses(mask=None) and fuses(mask=mask[:1]) and fuses(sliding_window=8, position_ids=None)
    assert fuses(eager, mask=None)
    assert not fuses(eager)  # eager adds a bool mask to the scores as numbers
    assert not fuses(eager, mask=torch.zeros(2, 1, 1, 16, dtype=torch.bfloat16))  # eager's additive masks
    assert not fuses(mask=torch.zeros(2, 1, 1, 16))  # an additive mask for sdpa
    assert not fuses(mask=mask[..., :8]) and not fuses(mask=torch.ones(2, 4, 1, 16, dtype=torch.bool))
    assert not fuses(lambda *a, **kw: None)  # another attention function (flash, flex, a registered one)
    assert not fuses(q=q.expand(2, 4, 2, 64))  # two query tokens
    assert not fuses(q=q.float(), k=k.float(), v=v.float())
    assert not fuses(position_bias=torch.zeros(1)) and not fuses(softcap=30.0) and not fuses(output_attentions=True)
    # a cache that grows every step (DynamicCache), or none
    assert not fuses(cache=DynamicCache(config=attn.config)) and not fuses(cache=None)
    assert fuses(cache=StaticCache(config=attn.config, max_cache_len=16))
    attn.train()
    assert not fuses()
    attn.eval()
    monkeypatch.setenv("TILEQ_DECODE_ATTN", "0")
    assert not fuses()
    monkeypatch.setenv("TILEQ_DECODE_ATTN", "2")
    with pytest.raises(UnsupportedError, match=r"TILEQ_DECODE_ATTN: expected 0 or 1, got '2'"):
        fuses()
