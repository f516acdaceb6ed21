"""Quantize while loading through transformers (``from_pretrained(..., quantization_config=tileq
config)``) and tileq checkpoints through ``AutoModelForCausalLM``: ``tileq.formats.hf_quantizer``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tileq  # noqa: E402
from model_checks import assert_same_model, bits, ids  # noqa: E402
from tileq import nn as tnn  # noqa: E402
from tileq.errors import UnsupportedError  # noqa: E402
from tileq.formats import hf_quantizer  # noqa: E402
from tileq.moe import QuantExperts  # noqa: E402

pytestmark = pytest.mark.transformers

TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 64}
CONFIGS = ("A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A8")


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setenv("TILEQ_BACKEND", "reference")


def _model(family: str, dtype=torch.float32):
    torch.manual_seed(0)
    tiny = TINY
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**tiny, intermediate_size=256, head_dim=32, attention_bias=True)
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**tiny, intermediate_size=256, moe_intermediate_size=128, head_dim=32,
                                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**tiny, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    # fp32 weights in the files: the loader casts them to bf16 first, as a bf16 load does
    return cls._from_config(cfg, dtype=dtype).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in ("qwen3", "qwen3_moe", "mixtral"):
        d = tmp_path_factory.mktemp(family)
        _model(family).save_pretrained(d)
        out[family] = d
    return out


def _load(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("name", CONFIGS)
def test_on_load_equals_quantize_bit_for_bit(checkpoints, family, name):
    config = tnn.config_from_name(name)
    want = _load(checkpoints[family])
    summary = tileq.quantize_(want, config)
    got = _load(checkpoints[family], quantization_config=config)
    assert_same_model(want, got)
    assert got.tileq_summary.converted == summary.converted
    assert got.tileq_summary.skipped == summary.skipped
    assert [n for n, _ in got.tileq_summary.experts] == [n for n, _ in summary.experts]
    if family != "qwen3":
        assert any(isinstance(m, QuantExperts) for m in got.modules())
    if name in ("W4A16", "W4A8"):  # the running layout, as quantize_ makes it
        assert got.model.layers[0].self_attn.q_proj.is_prepacked


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
@pytest.mark.parametrize("name", ["A8W8", "FP8Block", "W4A16"])
def test_save_pretrained_round_trip_through_both_loaders(checkpoints, tmp_path, family, name):
    got = _load(checkpoints[family], quantization_config=tnn.config_from_name(name))
    got.save_pretrained(tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "tileq" and qc["format_version"] == 1 and "layers" in qc
    auto = _load(tmp_path)
    assert not any(type(m) is torch.nn.Linear for n, m in auto.named_modules() if n.endswith("q_proj"))
    assert_same_model(got, auto)
    assert_same_model(got, tileq.from_pretrained(tmp_path))


def test_tileq_written_checkpoint_loads_through_automodel(tmp_path):
    model = _model("qwen3", torch.bfloat16)  # not .to(bf16): that rounds the RoPE tables a load recomputes
    tileq.quantize_(model, tnn.W4A16Config(group_size=96))  # no compressed-tensors form: tileq's format
    assert tileq.save_pretrained(model, tmp_path) == "tileq"
    assert_same_model(model, _load(tmp_path))


def test_skip_modules_filter_and_unservable_layers_are_listed(checkpoints):
    config = tnn.A8W8Config(skip_modules=("lm_head", "o_proj"))
    got = _load(checkpoints["qwen3"], quantization_config=config)
    kept = dict(got.tileq_summary.skipped)
    assert kept["model.layers.0.self_attn.o_proj"] == "in config.skip_modules"
    assert type(got.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert got.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    want = _load(checkpoints["qwen3"])
    tileq.quantize_(want, config)
    assert_same_model(want, got)


def test_int4_layer_it_cannot_serve_is_kept_and_named(tmp_path):
    # a 129-wide intermediate makes down_proj's K odd: int4 packs pairs along K
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**TINY, intermediate_size=129, head_dim=32)
    transformers.Qwen3ForCausalLM._from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    got = _load(tmp_path, quantization_config=tnn.W4A16Config())
    kept = dict(got.tileq_summary.skipped)
    assert "in_features=129 is odd" in kept["model.layers.0.mlp.down_proj"]
    assert type(got.model.layers[0].mlp.down_proj) is torch.nn.Linear


def test_no_bf16_model_is_ever_held(checkpoints, monkeypatch):
    """Each weight is quantized as it is read: when one is, no other tileq layer holds a float
    weight with data (the placeholders are on the meta device until their turn)."""
    seen = []
    quantize = hf_quantizer._quantized

    def watched(module, prefix, attr, t):
        model = watched.model
        for name, mod in model.named_modules():
            w = mod._buffers.get("weight") if isinstance(mod, tnn.QuantLinear) else None
            if w is not None and w.dtype == torch.bfloat16 and not w.is_meta:
                raise AssertionError(f"{name} holds a bf16 weight while {prefix} is quantized")
        seen.append((prefix, attr, t.dtype))
        return quantize(module, prefix, attr, t)

    real_before = hf_quantizer.TileqHfQuantizer._process_model_before_weight_loading

    def before(self, model, **kw):
        watched.model = model
        return real_before(self, model, **kw)

    monkeypatch.setattr(hf_quantizer, "_quantized", watched)
    monkeypatch.setattr(hf_quantizer.TileqHfQuantizer, "_process_model_before_weight_loading", before)
    _load(checkpoints["qwen3_moe"], quantization_config=tnn.A8W8Config())
    assert seen and all(dt == torch.bfloat16 for _, _, dt in seen)
    assert {a for _, a, _ in seen} >= {"weight", "gate_up_proj", "down_proj"}


def test_config_json_form_round_trips():
    for name in CONFIGS:
        c = tnn.config_from_name(name, skip_modules=("lm_head", "gate"))
        assert tnn.config_from_dict(json.loads(json.dumps(c.to_dict()))) == c
    c = tnn.W4A16Config(group_size=64, int4_layout="pk_int4")
    assert tnn.config_from_dict(c.to_dict()) == c
    with pytest.raises(UnsupportedError, match="group_sise"):
        tnn.config_from_dict({"config": "W4A16", "options": {"group_sise": 64}})


def test_dict_quantization_config_and_refusals(checkpoints):
    got = _load(checkpoints["qwen3"], quantization_config={"quant_method": "tileq", "config": "A8W8"})
    assert isinstance(got.model.layers[0].mlp.up_proj, tnn.QuantLinear)
    with pytest.raises(UnsupportedError, match="offload"):
        _load(checkpoints["qwen3"], quantization_config=tnn.A8W8Config(),
              device_map={"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu",
                          "model.rotary_emb": "cpu", "lm_head": "cpu"})


def test_tensor_parallel_is_refused_with_the_alternative(checkpoints, monkeypatch):
    from transformers.distributed import DistributedConfig

    q = hf_quantizer.TileqHfQuantizer(tnn.A8W8Config(), pre_quantized=False)
    model = _model("qwen3")
    model.config.distributed_config = DistributedConfig(tp_plan="auto")
    with pytest.raises(UnsupportedError, match=r"tileq.quantize_\(model, config\).*tileq.from_pretrained"):
        q._process_model_before_weight_loading(model, dtype=torch.bfloat16)


@pytest.mark.parametrize("order", ["tileq first", "transformers first"])
def test_registered_whichever_is_imported_first(order):
    imports = ("import tileq", "from transformers.quantizers import auto") if order == "tileq first" else \
        ("from transformers.quantizers import auto", "import tileq")
    code = "; ".join(imports) + "; print('tileq' in auto.AUTO_QUANTIZER_MAPPING, " \
                                "'tileq' in auto.AUTO_QUANTIZATION_CONFIG_MAPPING)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (quantizing on the device it loads to)")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("name", ["A8W8", "FP8Block", "W4A16"])
def test_on_load_to_the_gpu_equals_quantize(checkpoints, family, name, monkeypatch):
    monkeypatch.delenv("TILEQ_BACKEND")  # the GPU kernels run both models
    config = tnn.config_from_name(name)
    want = _load(checkpoints[family], device_map="cuda")
    tileq.quantize_(want, config)
    torch.cuda.reset_peak_memory_stats()
    got = _load(checkpoints[family], device_map="cuda", quantization_config=config)
    sa, sb = want.state_dict(), got.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sb[k].device.type == "cuda" and torch.equal(bits(sa[k]), bits(sb[k])), k
    tokens = ids().cuda()
    with torch.no_grad():
        torch.testing.assert_close(got(tokens).logits, want(tokens).logits, rtol=0, atol=0)
