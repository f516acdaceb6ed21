"""bench/bound.py: the bytes one decode step must read (``step_bytes``) on tiny transformers models,
bf16, quantized and fused, counted by hand from the shapes; the experts a step touches; the GEMV
bandwidth's shapes (the timing itself needs a GPU: None on a CPU)."""

import pytest
import torch

import tileq
from tileq.bench import bound

pytest.importorskip("transformers")

pytestmark = pytest.mark.transformers

# Qwen3: hidden 256, intermediate 512, 4 heads and 2 kv heads of 64, vocabulary 512, 2 layers.
H, I, HEADS, KV, D, V, L = 256, 512, 4, 2, 64, 512, 2
# Each layer's projections as (N, K): q, k, v, o, gate, up, down.
PROJ = [(HEADS * D, H), (KV * D, H), (KV * D, H), (H, HEADS * D), (I, H), (I, H), (H, I)]
NORMS = L * (H + H + D + D) + H  # input / post-attention norms, q / k norms per layer, the final norm


def _qwen3(tied: bool = False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=HEADS,
                      num_key_value_heads=KV, head_dim=D, vocab_size=V, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def _kv(batch, ctx):
    return L * 2 * KV * D * ctx * batch * 2  # bf16 keys and values


def test_bf16_dense_step_bytes_by_hand():
    got = bound.step_bytes(_qwen3(), batch=4, context_len=100)
    weights = 2 * (L * sum(n * k for n, k in PROJ) + NORMS + V * H)  # bf16; lm_head [V, H]; not the table
    assert got == dict(weights=weights, experts=0, kv_cache=_kv(4, 100), embedding_rows=4 * H * 2,
                       total=weights + _kv(4, 100) + 4 * H * 2)


def test_quantized_step_bytes_by_hand():
    """A8W8: int8 weights and fp32 per-channel scales; W4A16 (groups of 128 along K): the int4 weight
    prepacked (K padded to 512, half a byte a value) and fp32 scales [K / 128, N]; lm_head stays bf16;
    QuantLinear's tile counters (non-persistent) and the rotary tables are not counted; the fused
    decoder (merged q/k/v and gate/up) reads the same bytes."""
    from tileq.integrations.hf import fuse_decoder_

    rest = 2 * (NORMS + V * H)  # the norms and lm_head, bf16
    want = {"A8W8": L * sum(n * k + 4 * n for n, k in PROJ) + rest,
            "W4A16": L * sum(n * -(-k // 512) * 512 // 2 + 4 * n * (k // 128) for n, k in PROJ) + rest}
    for name, config in (("A8W8", tileq.A8W8Config()), ("W4A16", tileq.W4A16Config(group_size=128))):
        model = _qwen3()
        tileq.quantize_(model, config)
        got = bound.step_bytes(model, batch=1, context_len=7)
        assert got["weights"] == want[name], name
        assert got["total"] == want[name] + _kv(1, 7) + H * 2
        fuse_decoder_(model)
        assert model.model.layers[0].self_attn.qkv_proj is not None
        assert bound.step_bytes(model, batch=1, context_len=7) == got, name


def test_tied_embeddings_counted_once():
    """A tied lm_head reads the embedding table once; the step's lookup adds its batch rows."""
    model = _qwen3(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    got = bound.step_bytes(model, batch=2, context_len=1)
    assert got["weights"] == 2 * (L * sum(n * k for n, k in PROJ) + NORMS + V * H)
    assert got["embedding_rows"] == 2 * H * 2


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, vocab_size=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()


@pytest.mark.parametrize("batch", [1, 16])
def test_moe_counts_the_experts_a_step_touches(batch):
    """E 8 experts, top-2: E (1 - (1 - 2/8)^batch) distinct experts expected (2 at batch 1, 7.92 at
    16), times one expert's bytes (bf16 gate_up [128, 128] + down [128, 64]; A8W8: int8 and fp32
    per-channel scales); the router [8, 128] and attention are weights."""
    touched = 8 * (1 - 0.75 ** batch)
    assert bound.touched_experts(8, 2, batch) == pytest.approx(touched)
    assert bound.touched_experts(8, 2, 1) == pytest.approx(2.0)
    model = _qwen3_moe()
    attn = [(128, 128), (64, 128), (64, 128), (128, 128)]
    rest = 2 * (2 * (sum(n * k for n, k in attn) + 8 * 128 + 128 + 128 + 32 + 32) + 128 + 256 * 128)
    got = bound.step_bytes(model, batch=batch, context_len=3)
    assert got["weights"] == rest
    assert got["experts"] == pytest.approx(2 * touched * 2 * (128 * 128 + 128 * 64))
    assert got["kv_cache"] == 2 * 2 * 2 * 32 * 3 * batch * 2
    tileq.quantize_(model, tileq.A8W8Config())
    got = bound.step_bytes(model, batch=batch, context_len=3)
    assert got["weights"] == rest - 2 * (2 * sum(n * k for n, k in attn)) + 2 * sum(n * k + 4 * n for n, k in attn)
    assert got["experts"] == pytest.approx(2 * touched * (128 * 128 + 4 * 128 + 128 * 64 + 4 * 128))
    assert bound.step_bytes(model, batch=batch, context_len=3, top_k=8)["experts"] == pytest.approx(
        2 * 8 * (128 * 128 + 4 * 128 + 128 * 64 + 4 * 128))  # every expert touched


def test_bandwidth_shapes_and_cpu():
    """Shapes of >= 25 MB of bf16 weight are timed; where none is, each is widened along N to it;
    off a GPU there is no bandwidth (the bound's cells stay empty)."""
    shapes = bound.linear_shapes(_qwen3())
    assert shapes == [(256, 256), (128, 256), (512, 256), (256, 512)]
    assert bound.bandwidth_shapes([(5120, 5120), (1024, 5120), (17408, 5120)]) == [(5120, 5120), (17408, 5120)]
    # 256 x 256 (128 KiB) x 191 rows over; 128 x 256 widens to the same; 512 x 256 x 96; 256 x 512 x 96
    assert bound.bandwidth_shapes(shapes) == [(48896, 256), (49152, 256), (24576, 512)]
    assert "widened along N" in bound.bandwidth_method(shapes)
    assert "2 of its 3 weight shapes of >= 25 MB" in bound.bandwidth_method([(5120, 5120), (1024, 5120), (17408, 5120)])
    assert bound.gemv_bandwidth(shapes, "cpu") is None
