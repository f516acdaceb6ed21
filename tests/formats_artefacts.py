"""Real quantized checkpoints for tests/test_formats.py, made on the CPU by the libraries that
produce them in the wild (no hand-written imitations):

- ``ct_quantize``: the compressed-tensors package alone: ``apply_quantization_config`` attaches the
  scheme, scales come from its own ``calculate_qparams`` over min/max observed per strategy (what
  llm-compressor's min-max observer feeds it), ``ModelCompressor`` compresses and writes the
  quantization config, transformers' ``save_pretrained`` writes the tensors.
- ``llmc_quantize``: llm-compressor's ``oneshot`` with a ``QuantizationModifier`` (data-free, or
  calibrated on a few token batches for static activation scales), saved compressed.
- ``fp8_block_quantize``: transformers' own FineGrainedFP8 quantizer op (``Fp8Quantize``, what
  ``from_pretrained(..., quantization_config=FineGrainedFP8Config())`` runs on a GPU) applied to a
  dense checkpoint, written with ``FineGrainedFP8Config``'s config: DeepSeek's fp8 layout
  (``weight_scale_inv`` per 128 x 128 block).

References: ``ct_reference`` / ``fp8_reference`` load a checkpoint back with transformers, which
decompresses it with the producing library's code (compressed-tensors' decompressors,
transformers' ``Fp8Dequantize``) into a dense bf16 model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, head_dim=64, max_position_embeddings=256)
TOKENS = torch.tensor([[1, 5, 7, 9, 200, 300, 17, 999], [3, 4, 5, 6, 7, 8, 9, 10]])


def make_dense(path, *, arch: str = "llama", seed: int = 0, tie: bool = False, bias: bool = False, **over):
    """A tiny random bf16 Llama or Qwen3 saved with transformers' save_pretrained."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    torch.manual_seed(seed)
    dims = {**TINY, **over}
    if arch == "llama":
        cfg = LlamaConfig(**dims, tie_word_embeddings=tie, attention_bias=bias)
    else:
        cfg = Qwen3Config(**dims, tie_word_embeddings=tie, attention_bias=bias)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    # transformers' default init (std 0.02) gives near-zero logits; a wider spread makes the
    # comparisons meaningful (logits of order 1).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(str(path))
    return Path(path)


def load_dense(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- compressed-tensors


def _observed_minmax(w: torch.Tensor, args):
    """min / max of ``w`` [N, K] reduced to the scale's shape for ``args.strategy``."""
    w = w.float()
    n, k = w.shape
    s = args.strategy
    if s == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if s == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if s == "group":
        g = args.group_size
        v = w.reshape(n, k // g, g)
        return v.amin(-1), v.amax(-1)
    if s == "block":
        bh, bw = args.block_structure
        nb, kb = math.ceil(n / bh), math.ceil(k / bw)
        v = torch.nn.functional.pad(w, (0, kb * bw - k, 0, nb * bh - n)).reshape(nb, bh, kb, bw)
        return v.amin(dim=(1, 3)), v.amax(dim=(1, 3))
    raise ValueError(s)


def _calibrate_input_amax(model, tokens) -> dict:
    """Largest |input| seen by every nn.Linear over a forward pass of ``tokens``."""
    amax, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            def hook(mod, args, name=name):
                a = args[0].detach().abs().amax().float()
                amax[name] = torch.maximum(amax.get(name, a), a)
            hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return amax


def ct_quantize(dense_dir, out_dir, scheme: dict, *, ignore=("lm_head",), targets=("Linear",),
                calib_tokens=TOKENS, extra_groups=None, max_shard_size=None):
    """Quantize ``dense_dir`` with compressed-tensors only and save the compressed checkpoint."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = load_dense(dense_dir)
    groups = {"group_0": QuantizationScheme(targets=list(targets), **scheme)}
    for i, (tg, sc) in enumerate(extra_groups or []):
        groups[f"group_{i + 1}"] = QuantizationScheme(targets=list(tg), **sc)
    static = any(g.input_activations is not None and not g.input_activations.dynamic for g in groups.values())
    amax = _calibrate_input_amax(model, calib_tokens) if static else {}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=list(ignore)))
    with torch.no_grad():
        for name, m in model.named_modules():
            sch = getattr(m, "quantization_scheme", None)
            if sch is None:
                continue
            lo, hi = _observed_minmax(m.weight, sch.weights)
            scale, zp = calculate_qparams(lo, hi, sch.weights)
            m.weight_scale.copy_(scale)
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.copy_(zp)
            a = sch.input_activations
            if a is not None and not a.dynamic:
                s, z = calculate_qparams(-amax[name].reshape(1), amax[name].reshape(1), a)
                m.input_scale.copy_(s)
                if hasattr(m, "input_zero_point"):
                    m.input_zero_point.copy_(z)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out_dir), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    compressor.update_config(str(out_dir))
    return Path(out_dir)


def llmc_quantize(dense_dir, out_dir, *, scheme=None, config_groups=None, ignore=("lm_head",),
                  calibrate: bool = False):
    """Quantize ``dense_dir`` with llm-compressor's oneshot and save it compressed."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = load_dense(dense_dir)
    if scheme is not None:
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore))
    else:
        recipe = QuantizationModifier(config_groups=config_groups, ignore=list(ignore))
    kwargs = {}
    if calibrate:
        from datasets import Dataset

        ids = [row.tolist() for row in TOKENS] * 2
        kwargs = dict(dataset=Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]}),
                      num_calibration_samples=len(ids), max_seq_length=TOKENS.shape[1],
                      processor=_word_tokenizer())
    oneshot(model=model, recipe=recipe, **kwargs)
    model.save_pretrained(str(out_dir), save_compressed=True)
    return Path(out_dir)


def _word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (oneshot wants a processor with a dataset;
    the dataset here is already token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")


def ct_reference(path, dtype=torch.bfloat16):
    """The checkpoint decompressed by compressed-tensors (through transformers) into a dense model
    that quantizes activations as the scheme says. transformers casts the scales to ``dtype``
    before decompressing: float32 keeps fp32 scales exact."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                quantization_config=CompressedTensorsConfig(dequantize=True))


# ----------------------------------------------------------------------------- DeepSeek-style fp8


def fp8_block_quantize(dense_dir, out_dir, *, scale_fmt: str = "float"):
    """DeepSeek-style fp8 via transformers' FineGrainedFP8 quantizer op, on the CPU."""
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    qcfg = FineGrainedFP8Config(scale_fmt=scale_fmt)
    op = Fp8Quantize(FineGrainedFP8HfQuantizer(qcfg))
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = load_file(str(dense_dir / "model.safetensors"))
    out = {}
    for key, t in state.items():
        linear = key.endswith("_proj.weight")  # every Linear but lm_head (transformers' default skip)
        out.update(op.convert({key: t}) if linear else {key: t})
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dense_dir / "config.json").read_text())
    qd = qcfg.to_dict()
    qd["quant_method"] = str(getattr(qd["quant_method"], "value", qd["quant_method"]))
    qd["weight_block_size"] = list(qd["weight_block_size"])
    cfg["quantization_config"] = qd
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def fp8_reference(path):
    """transformers' own load of an fp8 block checkpoint on a CPU: dequantized to bf16."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- GPU against CPU


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_gpu_against_cpu(gpu, cpu, dense_logits, act_quantized: bool, tokens=TOKENS):
    """One checkpoint loaded twice: ``gpu`` (tileq's kernels) against ``cpu`` (the torch reference
    executor); ``dense_logits``: the unquantized model's logits on ``tokens`` (CPU).

    Every quantized layer, on the input it sees in the CPU model's forward: only the accumulation
    order, the bf16 output rounding and activation-quantization ties differ (0.4% in Triton's
    interpreter for every config), so a wrongly loaded weight or scale shows here.

    The logits: with unquantized activations the two differ by bf16 rounding (1.5% in the
    interpreter, W4A16). With quantized activations those roundings move values across
    quantization steps and two layers amplify that to the order of the activation-quantization
    error itself (interpreter against the reference: A8W8 4.4%, FP8Block 8.5%, W4A8 9.0%; 5.4%,
    14% and 39% from the dense model), so the bound follows test_formats' _check_logits: relative
    to the reference's own error against the dense model, capped.
    """
    from tileq.nn import QuantLinear

    device = next(gpu.parameters()).device
    layers = {n: m for n, m in cpu.named_modules() if isinstance(m, QuantLinear)}
    assert layers
    inputs, hooks = {}, []
    for name, m in layers.items():
        hooks.append(m.register_forward_pre_hook(
            lambda mod, args, name=name: inputs.setdefault(name, args[0].detach().clone())))
    try:
        with torch.no_grad():
            want = cpu(tokens).logits.float()
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for name, layer in layers.items():
            x = inputs[name]
            got_l = gpu.get_submodule(name)(x.to(device)).float().cpu()
            want_l = layer(x).float()
            assert rel(got_l, want_l) < 1e-2, f"{name}: {rel(got_l, want_l):.2e}"
        got = gpu(tokens.to(device)).logits.float().cpu()
    assert torch.isfinite(got).all()
    err, q_err = rel(got, want), rel(want, dense_logits)
    if act_quantized:
        assert err < 1.5 * q_err + 0.02 and err < 0.2, f"{err:.4f} against the reference ({q_err:.4f} from dense)"
    else:
        assert err < 0.05, f"{err:.4f} against the reference ({q_err:.4f} from dense)"
    return err, q_err
