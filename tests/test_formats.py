"""Quantized checkpoints (tileq.formats): real artefacts made on the CPU by compressed-tensors,
llm-compressor and transformers' FineGrainedFP8 quantizer (tests/formats_artefacts.py), loaded by
tileq and compared with the producing library's own decompression: the weights bit for bit, the
logits to the accuracy of activation quantization. tileq's saved models reload exactly and, where
written as compressed-tensors, validate with its config parser and decompress (through
transformers) to tileq's weights exactly. Corrupted inputs are refused with the right error."""

from __future__ import annotations

import json
import shutil
import weakref

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
ct_pkg = pytest.importorskip("compressed_tensors")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import formats_artefacts as fa  # noqa: E402
from tileq.dtypes import PackedInt4  # noqa: E402
from tileq.errors import DTypeError, ScaleError, ShapeError, UnsupportedError  # noqa: E402
from tileq.formats import CheckpointError, from_pretrained, save_pretrained  # noqa: E402
from tileq.formats import compressed_tensors as ctf  # noqa: E402
from tileq.formats import safetensors_io  # noqa: E402
from tileq.nn import QuantLinear  # noqa: E402
from tileq.quant import dequantize_a, dequantize_b, pack_int4  # noqa: E402

pytestmark = pytest.mark.transformers

Q_PROJ = "model.layers.0.self_attn.q_proj"

# compressed-tensors schemes (QuantizationScheme fields) the CT-only producer quantizes with.
_I8CH = dict(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False)
_F8 = dict(num_bits=8, type="float", symmetric=True)
_TOKEN_I8 = dict(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
_TOKEN_F8 = dict(_F8, strategy="token", dynamic=True)
_I4 = dict(num_bits=4, type="int", symmetric=True, dynamic=False)
CT_SCHEMES = {
    # name: (scheme, expected tileq config name, activations quantized)
    "w8a8_int_dynamic": (dict(weights=_I8CH, input_activations=_TOKEN_I8), "A8W8", True),
    "w8a8_int_static": (dict(weights=_I8CH, input_activations=dict(num_bits=8, type="int", strategy="tensor",
                                                                   symmetric=True, dynamic=False)), "A8W8", True),
    "fp8_channel_token": (dict(weights=dict(_F8, strategy="channel", dynamic=False), input_activations=_TOKEN_F8),
                          "FP8Row", True),
    "fp8_tensor_static": (dict(weights=dict(_F8, strategy="tensor", dynamic=False),
                               input_activations=dict(_F8, strategy="tensor", dynamic=False)), "FP8Row", True),
    "fp8_tensor_token": (dict(weights=dict(_F8, strategy="tensor", dynamic=False), input_activations=_TOKEN_F8),
                         "FP8Row", True),
    "fp8_block": (dict(weights=dict(_F8, strategy="block", block_structure=[128, 128], dynamic=False),
                       input_activations=dict(_F8, strategy="group", group_size=128, dynamic=True)), "FP8Block", True),
    "w4a16_group128": (dict(weights=dict(_I4, strategy="group", group_size=128)), "W4A16", False),
    "w4a16_group64": (dict(weights=dict(_I4, strategy="group", group_size=64)), "W4A16", False),
    "w4a16_channel": (dict(weights=dict(_I4, strategy="channel")), "W4A16", False),
    "w8a16_channel": (dict(weights=_I8CH), "W8A16", False),
    "w4afp8_int_quantized": (dict(weights=dict(_I4, strategy="group", group_size=128), input_activations=_TOKEN_F8),
                             "W4A8", True),
    # Formats forced through the scheme: int8 weights unpacked (naive-quantized), and int4 x fp8
    # packed as vLLM's W4A8-fp8 scheme reads it.
    "w8a16_naive": (dict(weights=_I8CH, format="naive-quantized"), "W8A16", False),
    "w4afp8_pack_quantized": (dict(weights=dict(_I4, strategy="group", group_size=128), input_activations=_TOKEN_F8,
                                   format="pack-quantized"), "W4A8", True),
}
W4A16_ASYM = dict(weights=dict(_I4, strategy="group", group_size=128, symmetric=False))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("formats")


@pytest.fixture(scope="session")
def dense(workdir):
    return fa.make_dense(workdir / "dense_llama")


@pytest.fixture(scope="session")
def dense_logits(dense):
    with torch.no_grad():
        return fa.load_dense(dense)(fa.TOKENS).logits.float()


_made: dict = {}


@pytest.fixture(scope="session")
def ct_artefact(workdir, dense):
    def make(name):
        if name not in _made:
            _made[name] = fa.ct_quantize(dense, workdir / f"ct_{name}", CT_SCHEMES[name][0])
        return _made[name]
    return make


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _dequantized(layer) -> torch.Tensor:
    """The fp32 weight [N, K] a QuantLinear represents (tileq.quant.dequantize_b on B = W^T)."""
    cfg = layer.config
    w = layer.packed_weight()  # int4: pk_int4 bytes, also when the layer holds them prepacked
    if cfg.weight_dtype == "int4":
        w = PackedInt4(w, (layer.out_features, layer.in_features), 1)
    return dequantize_b(w.t(), layer.weight_scale, group_k=cfg.group_k, group_n=cfg.group_n).t()


def _quant_layers(model):
    from tileq.nn import QuantLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _assert_weights_exact(tq, ref):
    """tileq's dequantized weights equal the producer's decompressed ones bit for bit (in the
    producer's dtype: compressed-tensors and transformers compute q * s in the scale's dtype,
    exact there for 8-bit and int4 values and 16-bit scales, so rounding tileq's fp32 product to
    it must give the same bits)."""
    layers = _quant_layers(tq)
    assert layers
    for name, layer in layers.items():
        want = ref.get_submodule(name).weight.detach()
        got = _dequantized(layer).to(want.dtype)
        assert torch.equal(got, want), f"{name}: max diff {float((got.float() - want.float()).abs().max())}"
        assert float(want.float().abs().max()) > 0.05  # far from zero: a real comparison


def _check_logits(tq, ref, dense_logits, act_quantized):
    with torch.no_grad():
        got = tq(fa.TOKENS).logits.float()
        want = ref(fa.TOKENS).logits.float()
    assert torch.isfinite(got).all()
    assert float(want.abs().mean()) > 0.3  # logits of order 1, far above the tolerances below
    if act_quantized:
        # tileq and the producer quantize activations on different grids (int8: amax / 127 vs
        # amax / 127.5): each is ~4-14% off the dense model here, and they differ from each other
        # by no more than that.
        assert _rel(got, want) < 1.5 * _rel(want, dense_logits) + 0.02
        assert _rel(got, want) < 0.2
    else:
        assert _rel(got, want) < 0.03  # same weights; bf16 rounding of activations only (1.2% here)


def _check_layer_math(tq, ref, name=Q_PROJ):
    """One layer against the producer's weight with tileq's own activation quantization: only the
    accumulation order and the bf16 output rounding differ."""
    from tileq.activation import quantize_activation

    layer = _quant_layers(tq)[name]
    w = ref.get_submodule(name).weight.detach().float()
    torch.manual_seed(1)
    x = torch.randn(5, layer.in_features, dtype=torch.bfloat16)
    cfg = layer.config
    if cfg.act_dtype is None:
        xd = x.float()
    elif layer.input_scale is not None:
        q, s = quantize_activation(x, cfg.act_dtype, granularity="tensor", scale=layer.input_scale)
        xd = dequantize_a(q, s)  # s holds the static scale per row
    else:
        q, s = quantize_activation(x, cfg.act_dtype, granularity=cfg.act_granularity, group_k=cfg.group_k)
        xd = dequantize_a(q, s, group_k=cfg.group_k)
    want = F.linear(xd, w, None if layer.bias is None else layer.bias)
    got = layer(x).float()
    assert _rel(got, want) < 1e-2


# ----------------------------------------------------------------------------- packing converters


@pytest.mark.parametrize("k", [256, 200, 130, 2])
def test_int4_converter_is_bit_exact_against_compressed_tensors(k):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    torch.manual_seed(k)
    v = torch.randint(-8, 8, (7, k), dtype=torch.int8)
    v[0, :16] = torch.arange(-8, 8, dtype=torch.int8)[: min(16, k)] if k >= 16 else v[0, :16]
    ct_packed = pack_to_int32(v, 4)
    tileq = pack_int4(v, dim=1).data
    assert torch.equal(ctf.ct_packed_to_pk_int4(ct_packed, k), tileq)
    assert torch.equal(ctf.pk_int4_to_ct_packed(tileq, k), ct_packed)  # padding bits included
    assert torch.equal(unpack_from_int32(ctf.pk_int4_to_ct_packed(tileq, k), 4, torch.Size([7, k])), v)


@pytest.mark.parametrize("k", [256, 130])
def test_int8_packing_is_bit_exact_against_compressed_tensors(k):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    torch.manual_seed(k)
    v = torch.randint(-128, 128, (5, k), dtype=torch.int8)
    assert torch.equal(ctf.int8_to_ct_packed(v), pack_to_int32(v, 8))
    assert torch.equal(ctf.ct_packed_to_int8(pack_to_int32(v, 8), k), v)


# ----------------------------------------------------------------------------- loading real artefacts


@pytest.mark.parametrize("name", list(CT_SCHEMES))
def test_compressed_tensors_checkpoint_matches_its_producer(name, ct_artefact, dense_logits):
    path = ct_artefact(name)
    fmt = json.loads((path / "config.json").read_text())["quantization_config"]["format"]
    tq = from_pretrained(path)
    ref = fa.ct_reference(path)
    layers = _quant_layers(tq)
    assert len(layers) == 14  # 7 projections x 2 layers; lm_head ignored
    assert {m.config.name for m in layers.values()} == {CT_SCHEMES[name][1]}
    assert type(tq.lm_head).__name__ == "Linear"
    _assert_weights_exact(tq, ref)
    _check_layer_math(tq, ref)
    _check_logits(tq, ref, dense_logits, CT_SCHEMES[name][2])
    if "static" in name:
        assert layers[Q_PROJ].input_scale is not None
    if name == "w4afp8_int_quantized":
        assert fmt == "int-quantized"  # int4 values stored one per int8, repacked by tileq
    if name.startswith("w4a16") or name in ("w8a16_channel", "w4afp8_pack_quantized"):
        assert fmt == "pack-quantized"
    if name == "w8a16_naive":
        assert fmt == "naive-quantized"


LLMC_SCHEMES = {"W8A8": "A8W8", "FP8_DYNAMIC": "FP8Row", "FP8_BLOCK": "FP8Block", "W4A16": "W4A16",
                "W4AFP8": "W4A8", "FP8": "FP8Row"}


@pytest.mark.parametrize("scheme", list(LLMC_SCHEMES))
def test_llmcompressor_checkpoint_matches_its_producer(scheme, workdir, dense, dense_logits):
    pytest.importorskip("llmcompressor")
    path = fa.llmc_quantize(dense, workdir / f"llmc_{scheme}", scheme=scheme, calibrate=scheme == "FP8")
    tq = from_pretrained(path)
    ref = fa.ct_reference(path)
    assert {m.config.name for m in _quant_layers(tq).values()} == {LLMC_SCHEMES[scheme]}
    if scheme == "FP8":  # static per-tensor activation scales, calibrated
        assert _quant_layers(tq)[Q_PROJ].input_scale is not None
    _assert_weights_exact(tq, ref)
    _check_logits(tq, ref, dense_logits, scheme != "W4A16")


def test_qwen3_with_tied_embeddings_and_biases(workdir):
    dense = fa.make_dense(workdir / "dense_qwen3_tied", arch="qwen3", tie=True, bias=True, seed=3)
    path = fa.ct_quantize(dense, workdir / "ct_qwen3_w4a16", CT_SCHEMES["w4a16_group128"][0])
    assert "lm_head.weight" not in safe_open(str(path / "model.safetensors"), "pt").keys()
    tq = from_pretrained(path)
    ref = fa.ct_reference(path)
    assert tq.lm_head.weight is tq.model.embed_tokens.weight
    assert torch.equal(tq.lm_head.weight, ref.lm_head.weight)
    q = _quant_layers(tq)[Q_PROJ]
    assert q.bias is not None and q.bias.dtype == torch.float32
    assert torch.equal(q.bias, ref.get_submodule(Q_PROJ).bias.float())
    _assert_weights_exact(tq, ref)
    _check_layer_math(tq, ref)
    with torch.no_grad():
        d = fa.load_dense(dense)(fa.TOKENS).logits.float()
    _check_logits(tq, ref, d, act_quantized=False)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_deepseek_fp8_checkpoint_matches_transformers(scale_fmt, workdir, dense, dense_logits):
    path = fa.fp8_block_quantize(dense, workdir / f"ds_fp8_{scale_fmt}", scale_fmt=scale_fmt)
    keys = safe_open(str(path / "model.safetensors"), "pt").keys()
    assert f"{Q_PROJ}.weight_scale_inv" in keys
    tq = from_pretrained(path)
    ref = fa.fp8_reference(path)  # transformers dequantizes on a CPU
    assert {m.config.name for m in _quant_layers(tq).values()} == {"FP8Block"}
    assert len(_quant_layers(tq)) == 14
    _assert_weights_exact(tq, ref)
    _check_layer_math(tq, ref)
    with torch.no_grad():
        got, want = tq(fa.TOKENS).logits.float(), ref(fa.TOKENS).logits.float()
    # The reference keeps activations in bf16: tileq's 1x128 fp8 activations add their own error.
    assert _rel(got, want) < 0.2


# ----------------------------------------------------------------------------- saving


def _quantized_dense(dense, config):
    from tileq.nn import quantize_

    model = fa.load_dense(dense)
    quantize_(model, config)
    return model


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


SAVE_CONFIGS = ["A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A16-channel", "W4A8"]


def _config(name):
    from tileq.nn import config_from_name

    if name == "W4A16-channel":
        return config_from_name("W4A16", group_size=None)
    return config_from_name(name)


@pytest.mark.parametrize("name", SAVE_CONFIGS)
def test_save_writes_compressed_tensors_that_reload_exactly(name, workdir, dense):
    from compressed_tensors.quantization import QuantizationConfig

    model = _quantized_dense(dense, _config(name))
    out = workdir / f"saved_{name}"
    assert save_pretrained(model, out) == "compressed-tensors"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # compressed-tensors' own parser
    assert parsed.quantization_status == "compressed" and parsed.ignore == ["lm_head"]
    back = from_pretrained(out)
    _assert_same_state(model, back)
    # compressed-tensors decompresses it (through transformers, fp32 so the fp32 scales stay
    # exact) to tileq's weights bit for bit.
    ref = fa.ct_reference(out, dtype=torch.float32)
    _assert_weights_exact(back, ref)


@pytest.fixture(scope="module")
def mixed(workdir, dense):
    """A model with W4A16 MLPs and A8W8 attention, saved (a mixed-precision checkpoint)."""
    from tileq.nn import A8W8Config, W4A16Config, quantize_

    model = fa.load_dense(dense)
    quantize_(model, W4A16Config(), filter_fn=lambda m, n: ".mlp." in n)
    quantize_(model, A8W8Config(), filter_fn=lambda m, n: ".self_attn." in n)
    out = workdir / "saved_mixed"
    save_pretrained(model, out)
    return model, out


def test_mixed_precision_weights_match_transformers(mixed):
    from tileq.integrations import compat

    if compat.version_tuple(transformers.__version__) >= (5, 24):
        pytest.skip("transformers >= 5.24 dequantizes every dense layer of a mixed-precision checkpoint with "
                    "one config group (transformers.integrations.compressed_tensors.get_dense_scheme): no reference")
    model, out = mixed
    _assert_weights_exact(from_pretrained(out), fa.ct_reference(out, dtype=torch.float32))


def test_save_mixed_configs_as_mixed_precision(mixed):
    from compressed_tensors.quantization import QuantizationConfig

    model, out = mixed
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    QuantizationConfig.model_validate(qc)
    back = from_pretrained(out)
    _assert_same_state(model, back)
    # int4 layers load prepacked by default; int4_layout='pk_int4' keeps pk_int4 in memory.
    int4 = [m for m in back.modules() if isinstance(m, QuantLinear) and m.config.weight_dtype == "int4"]
    assert int4 and all(m.is_prepacked for m in int4)
    pk = from_pretrained(out, int4_layout="pk_int4")
    pk_int4 = [m for m in pk.modules() if isinstance(m, QuantLinear) and m.config.weight_dtype == "int4"]
    assert not any(m.is_prepacked for m in pk_int4)
    _assert_same_state(back, pk)
    with pytest.raises(UnsupportedError, match="int4_layout"):
        from_pretrained(out, int4_layout="marlin")


def test_save_tileq_format_when_compressed_tensors_has_no_equivalent(workdir):
    from tileq.nn import W4A16Config

    # K = 320 for down_proj: int4 groups of 128 leave a partial last group, which tileq serves and
    # compressed-tensors' group quantization refuses.
    dense = fa.make_dense(workdir / "dense_k320", intermediate_size=320, seed=5, bias=True)
    model = _quantized_dense(dense, W4A16Config())
    assert _quant_layers(model)[Q_PROJ].bias is not None
    with pytest.raises(UnsupportedError, match=r"model\.layers\.0\.mlp\.down_proj: no compressed-tensors equivalent"):
        save_pretrained(model, workdir / "k320_ct", format="compressed-tensors")
    out = workdir / "k320_tileq"
    assert save_pretrained(model, out) == "tileq"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    entry = qc["layers"]["model.layers.0.mlp.down_proj"]
    assert entry["weight"] == {"dtype": "uint8", "shape": [256, 160], "packing": "pk_int4"}
    assert entry["weight_scale"] == {"dtype": "float32", "shape": [3, 256], "group_k": 128, "group_n": 1}
    back = from_pretrained(out)
    _assert_same_state(model, back)
    # Any config can be forced into the tileq format and still reload exactly.
    out2 = workdir / "k320_tileq_forced"
    model2 = _quantized_dense(dense, _config("FP8Block"))
    assert save_pretrained(model2, out2, format="tileq") == "tileq"
    _assert_same_state(model2, from_pretrained(out2))
    # The same biased model as compressed-tensors (A8W8 has an equivalent for every layer).
    out3 = workdir / "k320_ct_a8w8"
    model3 = _quantized_dense(dense, _config("A8W8"))
    assert save_pretrained(model3, out3) == "compressed-tensors"
    _assert_same_state(model3, from_pretrained(out3))
    _assert_weights_exact(model3, fa.ct_reference(out3, dtype=torch.float32))


# ----------------------------------------------------------------------------- sharding, memory


def test_sharded_checkpoint_loads_tensor_by_tensor(workdir, dense, monkeypatch):
    model = _quantized_dense(dense, _config("W4A16"))
    out = workdir / "sharded"
    save_pretrained(model, out, max_shard_size="200KB")
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 4 and (out / "model.safetensors.index.json").is_file()

    # A "device" with its own memory: each tensor read from a file is copied there, so any host
    # tensor still alive was kept by the loader. Count live host tensors at every read.
    monkeypatch.setattr(safetensors_io, "to_device", lambda t, device: t.clone())
    alive: list = []
    peak = [0]

    def on_read(name, t):
        alive.append(weakref.ref(t))
        peak[0] = max(peak[0], sum(r() is not None for r in alive))

    back = from_pretrained(out, on_read=on_read)
    assert len(alive) == sum(len(safe_open(str(s), "pt").keys()) for s in shards)
    assert peak[0] <= 2, f"{peak[0]} host tensors alive at once"
    _assert_same_state(model, back)


def test_transformers_sharded_checkpoint(workdir, dense):
    # Shards and index written by transformers' save_pretrained (compressed by compressed-tensors).
    scheme = CT_SCHEMES["w8a8_int_dynamic"][0]
    path = fa.ct_quantize(dense, workdir / "ct_sharded", scheme, max_shard_size="300KB")
    assert len(list(path.glob("model-*.safetensors"))) >= 3
    single = fa.ct_quantize(dense, workdir / "ct_single", scheme)
    _assert_same_state(from_pretrained(single), from_pretrained(path))


# ----------------------------------------------------------------------------- refusals


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def test_refuses_truncated_file(ct_artefact, workdir):
    path = _copy(ct_artefact("w8a8_int_dynamic"), workdir / "bad_truncated")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        from_pretrained(path)


def test_refuses_wrong_weight_dtype(ct_artefact, workdir):
    path = _copy(ct_artefact("w8a8_int_dynamic"), workdir / "bad_dtype")
    _edit_tensors(path, lambda t: t.__setitem__(f"{Q_PROJ}.weight", t[f"{Q_PROJ}.weight"].to(torch.bfloat16)))
    with pytest.raises(DTypeError, match=rf"{Q_PROJ}\.weight: expected int8 \[256, 256\] for int-quantized "
                                         r"int8 channel static .*got bfloat16 \[256, 256\]"):
        from_pretrained(path)


def test_refuses_int4_data_declared_as_fp8(ct_artefact, workdir):
    # int4 values (int-quantized W4AFP8, one per int8) under a config claiming fp8 channel weights:
    # the stored dtype is checked, the bytes are never reinterpreted.
    path = _copy(ct_artefact("w4afp8_int_quantized"), workdir / "bad_int4_as_fp8")

    def to_fp8(qc):
        g = qc["config_groups"]["group_0"]
        g["weights"].update(num_bits=8, type="float", strategy="channel", group_size=None)
        g["format"] = qc["format"] = "float-quantized"
    _edit_config(path, to_fp8)
    with pytest.raises(DTypeError, match=rf"{Q_PROJ}\.weight: expected float8_e4m3fn \[256, 256\] .*got int8"):
        from_pretrained(path)


def test_refuses_missing_scale(ct_artefact, workdir):
    path = _copy(ct_artefact("w4a16_group128"), workdir / "bad_missing_scale")
    _edit_tensors(path, lambda t: t.pop(f"{Q_PROJ}.weight_scale"))
    with pytest.raises(ScaleError, match=rf"{Q_PROJ}\.weight_scale: missing"):
        from_pretrained(path)


def test_refuses_wrong_scale_shape(ct_artefact, workdir):
    path = _copy(ct_artefact("w4a16_group128"), workdir / "bad_scale_shape")
    _edit_tensors(path, lambda t: t.__setitem__(f"{Q_PROJ}.weight_scale", t[f"{Q_PROJ}.weight_scale"][:, :1].contiguous()))
    with pytest.raises(ShapeError, match=rf"{Q_PROJ}\.weight_scale: expected float32/bfloat16/float16 \[256, 2\] "
                                         r"for pack-quantized int4 group 128 static \(W4A16\), got bfloat16 \[256, 1\]"):
        from_pretrained(path)


def test_refuses_group_size_not_dividing_k(ct_artefact, workdir):
    path = _copy(ct_artefact("w4a16_group128"), workdir / "bad_group_size")
    _edit_config(path, lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=96))
    with pytest.raises(ShapeError, match=rf"{Q_PROJ}: group_size 96 does not divide in_features K=256"):
        from_pretrained(path)


def test_refuses_asymmetric_int4(workdir, dense):
    path = fa.ct_quantize(dense, workdir / "ct_w4a16_asym", W4A16_ASYM)
    keys = safe_open(str(path / "model.safetensors"), "pt").keys()
    assert f"{Q_PROJ}.weight_zero_point" in keys  # a real asymmetric checkpoint
    with pytest.raises(UnsupportedError, match=rf"{Q_PROJ} .*asymmetric weights \(zero points\) are not supported"):
        from_pretrained(path)


def test_refuses_unexpected_tensor(ct_artefact, workdir):
    path = _copy(ct_artefact("w4a16_group128"), workdir / "bad_g_idx")
    _edit_tensors(path, lambda t: t.__setitem__(f"{Q_PROJ}.weight_g_idx", torch.zeros(256, dtype=torch.int32)))
    with pytest.raises(UnsupportedError, match=rf"{Q_PROJ}\.weight_g_idx: unexpected tensor"):
        from_pretrained(path)


@pytest.mark.parametrize("edit, match", [
    (lambda qc: qc.update(quant_method="gptq"), r"quant_method: expected one of .*got 'gptq'"),
    (lambda qc: qc["config_groups"]["group_0"].update(format="marlin-24"), r"format.*got 'marlin-24'"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), r"kv_cache_scheme: expected empty"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=3), r"int3 group 128"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(color="red"), r"unknown field\(s\) \['color'\]"),
])
def test_refuses_unknown_formats(ct_artefact, workdir, edit, match):
    path = _copy(ct_artefact("w4a16_group128"), workdir / f"bad_fmt_{abs(hash(match))}")
    _edit_config(path, edit)
    with pytest.raises(UnsupportedError, match=match):
        from_pretrained(path)


def test_refuses_unquantized_and_leftover_tensors(ct_artefact, workdir, dense):
    with pytest.raises(UnsupportedError, match=r"quantization_config: expected a quantized checkpoint"):
        from_pretrained(dense)
    path = _copy(ct_artefact("w8a8_int_dynamic"), workdir / "bad_leftover")
    _edit_tensors(path, lambda t: t.__setitem__("model.mystery", torch.zeros(3)))
    with pytest.raises(UnsupportedError, match=r"model\.mystery: tensors in the checkpoint that neither"):
        from_pretrained(path)


def test_refuses_index_naming_a_missing_shard(workdir, dense):
    model = _quantized_dense(dense, _config("A8W8"))
    out = workdir / "bad_index"
    save_pretrained(model, out, max_shard_size="300KB")
    next(out.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: .*no such file"):
        from_pretrained(out)


def test_refuses_deepseek_static_activations(workdir, dense):
    path = fa.fp8_block_quantize(dense, workdir / "ds_static")
    _edit_config(path, lambda qc: qc.update(activation_scheme="static"))
    with pytest.raises(UnsupportedError, match=r"activation_scheme: expected 'dynamic'"):
        from_pretrained(path)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["w4a16_group128", "fp8_block", "w8a8_int_dynamic"])
def test_gpu_converted_qwen3_checkpoint_generates(name, tmp_path):
    dense = fa.make_dense(tmp_path / "dense", arch="qwen3", hidden_size=1024, intermediate_size=3072,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=64, seed=7)
    with torch.no_grad():
        dense_logits = fa.load_dense(dense)(fa.TOKENS).logits.float()
    path = fa.ct_quantize(dense, tmp_path / name, CT_SCHEMES[name][0])
    gpu = from_pretrained(path, device="cuda")
    cpu = from_pretrained(path)  # the torch reference executor
    assert all(m.weight.is_cuda for m in _quant_layers(gpu).values())
    fa.check_gpu_against_cpu(gpu, cpu, dense_logits, act_quantized=CT_SCHEMES[name][2])
    out = gpu.generate(fa.TOKENS[:1].cuda(), max_new_tokens=8, do_sample=False)
    assert out.shape == (1, fa.TOKENS.shape[1] + 8)
