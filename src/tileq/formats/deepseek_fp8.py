"""DeepSeek-style fp8 checkpoints (DeepSeek-V3/R1, and what transformers' ``FineGrainedFP8Config``
writes): ``config.json``'s ``quantization_config``::

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128]}

(transformers adds ``modules_to_not_convert``, ``scale_fmt``, ``dequantize``, from 5.25
``expert_dtype``, ...). A quantized
layer ``L`` stores ``L.weight`` float8_e4m3fn [N, K] and ``L.weight_scale_inv`` float32
[ceil(N / 128), ceil(K / 128)], the dequantization multiplier of each 128 x 128 block despite its
name (w = q * weight_scale_inv, as DeepSeek's ``weight_dequant`` and transformers'
``Fp8Dequantize`` compute it); ``scale_fmt: "ue8m0"`` stores it as float8_e8m0fnu powers of two.
Activations are quantized per 1 x 128 group at run time: tileq's ``FP8BlockConfig``, whose weight
scale is the transpose, [ceil(K / 128), ceil(N / 128)] (converted exactly; e8m0 values are exact in
fp32).

Which ``nn.Linear`` layers are quantized follows transformers' ``replace_with_fp8_linear``: every
plain ``nn.Linear`` except those matched by ``modules_to_not_convert`` (a name prefix followed by
a dot, a ``re.match`` pattern, or a name suffix); without that list, transformers' defaults (the
output embedding, tied weights and the module of the model's last parameter). Static activation
scales, other block sizes, per-tensor (``weight_block_size: null``) and fp8 embeddings are
refused.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from ..errors import DTypeError, ScaleError, ShapeError, UnsupportedError, expect
from .safetensors_io import CheckpointReader

QUANT_METHOD = "fp8"
_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
         "ignored_layers", "modules_to_convert", "dequantize", "scale_fmt", "expert_dtype"}


def parse_config(qc: dict) -> dict:
    where = "quantization_config"
    unknown = sorted(set(qc) - _KEYS)
    if unknown:
        raise UnsupportedError(expect(where, f"fp8 fields ({', '.join(sorted(_KEYS))})", f"unknown field(s) {unknown}"))
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedError(expect(f"{where}.fmt", "'e4m3'", repr(fmt)))
    act = qc.get("activation_scheme", "dynamic")
    if str(act).lower() != "dynamic":
        raise UnsupportedError(expect(f"{where}.activation_scheme", "'dynamic' (1 x 128 groups per call)", repr(act)))
    block = qc.get("weight_block_size")
    if block is None or list(block) != [128, 128]:
        raise UnsupportedError(expect(f"{where}.weight_block_size", "[128, 128]", repr(block)))
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise UnsupportedError(expect(f"{where}.scale_fmt", "'float' or 'ue8m0'", repr(scale_fmt)))
    expert_dtype = qc.get("expert_dtype", "fp8")  # transformers 5.25 writes it; "fp4" experts have no tileq layer
    if expert_dtype != "fp8":
        raise UnsupportedError(expect(f"{where}.expert_dtype", "'fp8'", repr(expert_dtype)))
    if qc.get("modules_to_convert"):
        raise UnsupportedError(expect(f"{where}.modules_to_convert", "empty (fp8 embeddings are not supported)",
                                      repr(qc["modules_to_convert"])))
    skip = qc.get("modules_to_not_convert")
    if skip is None:
        skip = qc.get("ignored_layers")
    if skip is not None and (not isinstance(skip, list) or not all(isinstance(s, str) for s in skip)):
        raise UnsupportedError(expect(f"{where}.modules_to_not_convert", "a list of names", repr(skip)))
    return {"skip": skip, "scale_fmt": scale_fmt}


def _default_skip(model) -> list[str]:
    """transformers' get_keys_to_not_convert: tied weights, the last parameter's module and the
    output embedding."""
    keys = set()
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    keys |= set(tied) | set(tied.values())
    params = list(model.named_parameters())
    if params:
        keys.add(params[-1][0])
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None:
        keys |= {name for name, m in model.named_modules() if m is out}
    return sorted({k.removesuffix(".weight") for k in keys})


def _should_convert(name: str, patterns) -> bool:
    return not any(re.match(f"{p}\\.", name) or re.match(f"{p}", name) or name.endswith(p) for p in patterns)


def _patterns(model, parsed: dict) -> list[str]:
    skip = parsed["skip"] if parsed["skip"] is not None else _default_skip(model)
    return list(skip) + list(getattr(model, "_keep_in_fp32_modules", None) or [])


def quantized_layers(model, parsed: dict) -> list[str]:
    patterns = _patterns(model, parsed)
    return [name for name, m in model.named_modules() if type(m) is nn.Linear and _should_convert(name, patterns)]


def converts(model, parsed: dict, name: str) -> bool:
    """Whether module ``name`` (an experts module: its per-expert linears) is stored quantized."""
    return _should_convert(name, _patterns(model, parsed))


def load_layer(reader: CheckpointReader, name: str, linear, parsed: dict, *, device, dtype):
    from ..nn import FP8BlockConfig, QuantLinear

    n, k = linear.out_features, linear.in_features
    cfg = FP8BlockConfig()
    what = "for DeepSeek fp8 (128 x 128 blocks)"
    allowed = {"weight", "weight_scale_inv"} | ({"bias"} if linear.bias is not None else set())
    for key in reader.children(name):
        if key[len(name) + 1:] not in allowed:
            raise UnsupportedError(f"{key}: unexpected tensor {what} (expected only {', '.join(sorted(allowed))})")
    wkey, skey = f"{name}.weight", f"{name}.weight_scale_inv"
    if wkey not in reader:
        raise ShapeError(f"{wkey}: missing")
    info = reader.info(wkey)
    if info.dtype != torch.float8_e4m3fn or info.shape != (n, k):
        err = DTypeError if info.dtype != torch.float8_e4m3fn else ShapeError
        raise err(f"{wkey}: expected float8_e4m3fn {[n, k]} {what}, got {info.describe()}")
    if skey not in reader:
        raise ScaleError(f"{skey}: missing (the block scales of {wkey})")
    gshape = (math.ceil(n / 128), math.ceil(k / 128))
    sdt = torch.float32 if parsed["scale_fmt"] == "float" else getattr(torch, "float8_e8m0fnu", None)
    sinfo = reader.info(skey)
    if sinfo.dtype != sdt or sinfo.shape != gshape:
        err = DTypeError if sinfo.dtype != sdt else ShapeError
        sname = "float32" if parsed["scale_fmt"] == "float" else "float8_e8m0fnu"
        raise err(f"{skey}: expected {sname} {list(gshape)} {what}, got {sinfo.describe()}")
    weight = reader.read(wkey, device)
    scale = reader.read(skey, device).float().t().contiguous()  # [Gn, Gk] -> tileq's [Gk, Gn]
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ScaleError(f"{skey}: expected finite non-negative scales, got NaN, inf or negative values")
    consumed = [wkey, skey]
    bias = None
    if linear.bias is not None:
        bkey = f"{name}.bias"
        if bkey not in reader:
            raise ShapeError(f"{bkey}: missing (the model's config builds this layer with a bias)")
        binfo = reader.info(bkey)
        if not isinstance(binfo.dtype, torch.dtype) or not binfo.dtype.is_floating_point or binfo.shape != (n,) \
                or binfo.dtype.itemsize < 2:
            raise DTypeError(f"{bkey}: expected a float32/bfloat16/float16 [{n}] bias, got {binfo.describe()}")
        bias = reader.read(bkey, device).float()
        consumed.append(bkey)
    layer = QuantLinear.from_quantized(weight, scale, config=cfg, bias=bias, in_features=k, dtype=dtype)
    return layer, consumed


def check_unquantized(reader: CheckpointReader, name: str) -> None:
    """A layer transformers keeps in high precision must not carry fp8 data."""
    skey = f"{name}.weight_scale_inv"
    if skey in reader:
        raise UnsupportedError(f"{skey}: unexpected tensor: {name} is not quantized under this config "
                               "(modules_to_not_convert / transformers' defaults)")
