"""Routed experts in checkpoints (tileq.formats.moe): per-expert tensors in and out of QuantExperts."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import tileq  # noqa: E402
from model_checks import assert_same_model, bits, ids  # noqa: E402
from tileq import nn as tnn  # noqa: E402
from tileq.errors import ScaleError, ShapeError, UnsupportedError  # noqa: E402
from tileq.moe import QuantExperts  # noqa: E402

pytestmark = pytest.mark.transformers

TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 64}


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setenv("TILEQ_BACKEND", "reference")


def _model(family, hidden=128, moe_i=128):
    torch.manual_seed(0)
    tiny = {**TINY, "hidden_size": hidden}
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**tiny, intermediate_size=256, moe_intermediate_size=moe_i, head_dim=32,
                                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**tiny, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    # bf16 from the start: .to(bf16) would also round the RoPE tables, which a loaded model recomputes
    return cls._from_config(cfg, dtype=torch.bfloat16).eval()


def _keys(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


CONFIGS = {"A8W8": tnn.A8W8Config(), "FP8Block": tnn.FP8BlockConfig(), "W4A16": tnn.W4A16Config(group_size=32)}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_compressed_tensors(tmp_path, family, name):
    model = _model(family)
    tnn.quantize_(model, CONFIGS[name])
    assert tileq.save_pretrained(model, tmp_path) == "compressed-tensors"
    keys = _keys(tmp_path)
    # per expert, under the family's names (as vLLM and transformers' conversions read them)
    moe, (gate, up, down) = (("mlp", ("gate_proj", "up_proj", "down_proj")) if family == "qwen3_moe"
                             else ("block_sparse_moe", ("w1", "w3", "w2")))
    weight = "weight_packed" if name == "W4A16" else "weight"
    for e in range(4):
        for p in (gate, up, down):
            assert f"model.layers.1.{moe}.experts.{e}.{p}.{weight}" in keys
            assert f"model.layers.1.{moe}.experts.{e}.{p}.weight_scale" in keys
    assert not any("gate_up_proj" in k for k in keys)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert f"model.layers.0.{moe}.gate" in qc["ignore"]  # the router is no quantized Linear
    back = tileq.from_pretrained(tmp_path)
    assert isinstance(back.get_submodule("model.layers.0.mlp.experts"), QuantExperts)
    assert back.config._experts_implementation == "tileq"
    assert_same_model(model, back)


@pytest.mark.parametrize("config", [tnn.FP8RowConfig(), tnn.W8A16Config()], ids=lambda c: c.name)
def test_round_trip_other_configs(tmp_path, config):
    model = _model("qwen3_moe")
    tnn.quantize_(model, config)
    assert tileq.save_pretrained(model, tmp_path) == "compressed-tensors"
    assert_same_model(model, tileq.from_pretrained(tmp_path))


def test_round_trip_tileq_format(tmp_path):
    model = _model("mixtral")
    tnn.quantize_(model, tnn.A8W8Config())
    assert tileq.save_pretrained(model, tmp_path, format="tileq") == "tileq"
    keys = _keys(tmp_path)  # QuantExperts' buffers as they are, under Mixtral's names
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj_scale" in keys
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["layers"]["model.layers.0.mlp.experts"]["experts"]["num_experts"] == 4
    assert_same_model(model, tileq.from_pretrained(tmp_path))


def test_fp8_block_straddling_gate_and_up_is_saved_in_tileq_format(tmp_path):
    model = _model("qwen3_moe", moe_i=96)  # gate's last 128-row block would hold up's rows
    tnn.quantize_(model, tnn.FP8BlockConfig())
    with pytest.raises(UnsupportedError, match="straddle gate and up"):
        tileq.save_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    assert tileq.save_pretrained(model, tmp_path / "tq") == "tileq"
    assert_same_model(model, tileq.from_pretrained(tmp_path / "tq"))


def test_unquantized_experts_stay_3d(tmp_path):
    model = _model("qwen3_moe")
    tnn.quantize_(model, tnn.A8W8Config(), filter_fn=lambda m, n: not n.endswith("experts"))
    tileq.save_pretrained(model, tmp_path)
    back = tileq.from_pretrained(tmp_path)
    assert not isinstance(back.get_submodule("model.layers.0.mlp.experts"), QuantExperts)
    assert_same_model(model, back)


# ----------------------------------------------------------------------------- refusals


def _edit(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def saved_a8w8(tmp_path_factory):
    path = tmp_path_factory.mktemp("a8w8")
    model = _model("qwen3_moe")
    tnn.quantize_(model, tnn.A8W8Config())
    tileq.save_pretrained(model, path)
    return path


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_expert_is_refused(saved_a8w8, tmp_path):
    path = _copy(saved_a8w8, tmp_path / "c")
    _edit(path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ShapeError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight: missing"):
        tileq.from_pretrained(path)


def test_extra_expert_is_refused(saved_a8w8, tmp_path):
    path = _copy(saved_a8w8, tmp_path / "c")
    src = "model.layers.0.mlp.experts.0.down_proj"

    def add(t):
        t["model.layers.0.mlp.experts.4.down_proj.weight"] = t[f"{src}.weight"].clone()
    _edit(path, add)
    with pytest.raises(UnsupportedError, match=r"experts\.4\.down_proj\.weight.*neither the model nor"):
        tileq.from_pretrained(path)


def test_mismatched_scale_shape_is_refused(saved_a8w8, tmp_path):
    path = _copy(saved_a8w8, tmp_path / "c")
    key = "model.layers.0.mlp.experts.2.gate_proj.weight_scale"
    _edit(path, lambda t: t.__setitem__(key, t[key][:-1].clone()))
    with pytest.raises(ShapeError, match=rf"{key}: expected float32/bfloat16/float16 \[128, 1\].*got float32 \[127, 1\]"):
        tileq.from_pretrained(path)


def test_experts_quantized_differently_are_refused(saved_a8w8, tmp_path):
    path = _copy(saved_a8w8, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("model.layers.0.mlp.experts.1.down_proj")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match=r"experts\.1\.down_proj: quantized as unquantized where .*experts\.0"
                                               r"\.gate_proj is A8W8.*must share one quantization"):
        tileq.from_pretrained(path)


# ----------------------------------------------------------------------------- DeepSeek-style fp8


def _block_quantize(w):
    """DeepSeek's 128 x 128 e4m3 blocks: (q, weight_scale_inv [ceil(N/128), ceil(K/128)])."""
    n, k = w.shape
    gn, gk = math.ceil(n / 128), math.ceil(k / 128)
    wp = torch.nn.functional.pad(w.float(), (0, gk * 128 - k, 0, gn * 128 - n))
    blocks = wp.reshape(gn, 128, gk, 128)
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(gn * 128, gk * 128)[:n, :k].contiguous(), s


def _deepseek_checkpoint(path, *, experts_unquantized=False):
    """A Qwen3-MoE fp8 checkpoint as DeepSeek-V3 / Qwen3-FP8 write it: every linear (experts per
    expert) e4m3 + weight_scale_inv. H = 192: partial blocks along K (gate/up) and N (down)."""
    model = _model("qwen3_moe", hidden=192)
    tensors, deq = {}, {}
    skip = ["lm_head"] + (["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"] if experts_unquantized else [])
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            base, _, kind = name.rpartition(".")
            for e in range(t.shape[0]):
                parts = ({"gate_proj": t[e, :128], "up_proj": t[e, 128:]} if kind == "gate_up_proj"
                         else {"down_proj": t[e]})
                for p, w in parts.items():
                    key = f"{base}.{e}.{p}"
                    if experts_unquantized:
                        tensors[f"{key}.weight"] = w.clone()
                        continue
                    q, s = _block_quantize(w)
                    tensors[f"{key}.weight"], tensors[f"{key}.weight_scale_inv"] = q, s
                    deq[key] = (q, s)
        elif name.endswith("proj.weight") and "experts" not in name:
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = _block_quantize(t)
        else:
            tensors[name] = t.clone()
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": skip}
    (path / "config.json").write_text(json.dumps(cfg))
    return model, deq


def test_deepseek_fp8_experts_load_exactly(tmp_path):
    _, deq = _deepseek_checkpoint(tmp_path / "ds")
    model = tileq.from_pretrained(tmp_path / "ds")
    ex = model.get_submodule("model.layers.1.mlp.experts")
    assert isinstance(ex, QuantExperts) and ex.quant_config.name == "FP8Block"
    b = "model.layers.1.mlp.experts"
    for e in range(4):
        (qg, sg), (qu, su), (qd, sd) = (deq[f"{b}.{e}.{p}"] for p in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(bits(ex.gate_up_proj[e]), bits(torch.cat([qg, qu])))
        assert torch.equal(ex.gate_up_proj_scale[e], torch.cat([sg, su]))  # [2I/128, ceil(H/128)] = [2, 2]
        assert torch.equal(bits(ex.down_proj[e]), bits(qd)) and torch.equal(ex.down_proj_scale[e], sd)
    # The experts compute the dequantized weights' function (up to 1x128 fp8 activations).
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 192, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g).bfloat16()

    def dq(q, s):
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
        return q.float() * full

    want = torch.zeros(6, 192)
    for t in range(6):
        for j in range(2):
            e = int(ids[t, j])
            x = hidden[t].float()
            gate, up, down = (dq(*deq[f"{b}.{e}.{p}"]) for p in ("gate_proj", "up_proj", "down_proj"))
            want[t] += float(w[t, j]) * (down @ (torch.nn.functional.silu(gate @ x) * (up @ x)))
    with torch.no_grad():
        got = ex(hidden, ids, w).float()
    err = (got - want).norm() / want.norm()
    assert want.abs().max() > 1e-3 and err < 0.05, err


def test_deepseek_fp8_unquantized_experts_are_stacked(tmp_path):
    model, _ = _deepseek_checkpoint(tmp_path / "ds", experts_unquantized=True)
    back = tileq.from_pretrained(tmp_path / "ds")
    ex = back.get_submodule("model.layers.0.mlp.experts")
    assert not isinstance(ex, QuantExperts)
    want = model.get_submodule("model.layers.0.mlp.experts")
    assert torch.equal(ex.gate_up_proj, want.gate_up_proj) and torch.equal(ex.down_proj, want.down_proj)


def test_deepseek_fp8_bad_expert_scale_is_refused(tmp_path):
    _deepseek_checkpoint(tmp_path / "ds")
    key = "model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"
    _edit(tmp_path / "ds", lambda t: t.__setitem__(key, t[key][:1].clone()))
    with pytest.raises(ShapeError, match=rf"{key}: expected float32 \[2, 1\].*got float32 \[1, 1\]"):
        tileq.from_pretrained(tmp_path / "ds")
    _edit(tmp_path / "ds", lambda t: t.pop(key))
    with pytest.raises(ScaleError, match=rf"{key}: missing"):
        tileq.from_pretrained(tmp_path / "ds")


# ----------------------------------------------------------------------------- tileq e2e --model qwen3-moe


def test_e2e_qwen3_moe_model():
    from tileq.bench import e2e
    from tileq.bench.cli import E2E_MODELS

    assert E2E_MODELS == tuple(e2e.MODELS)
    full = e2e.build_model(2, torch.device("meta"), seed=0, model="qwen3-moe")  # shapes only
    ex = full.model.layers[1].mlp.experts
    assert type(full).__name__ == "Qwen3MoeForCausalLM" and full.config.num_experts_per_tok == 8
    assert tuple(ex.gate_up_proj.shape) == (128, 1536, 2048) and tuple(ex.down_proj.shape) == (128, 2048, 768)
    assert full.model.layers[0].self_attn.k_proj.weight.shape == (4 * 128, 2048)
    assert full.lm_head.weight.shape == (151936, 2048)
    model = e2e.build_model(1, torch.device("cpu"), seed=0, small=True, model="qwen3-moe")
    assert model.config._experts_implementation == "grouped_mm"  # the bf16 baseline
    line = e2e.quantize_model(model, "A8W8", fuse=False)
    assert "1 experts modules quantized" in line
    assert isinstance(model.model.layers[0].mlp.experts, QuantExperts)
    assert model.config._experts_implementation == "tileq"
    with torch.no_grad():
        assert torch.isfinite(model(ids()).logits).all()
