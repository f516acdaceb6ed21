"""tileq's own checkpoint format, for layers compressed-tensors cannot describe (today: int4 groups
that do not divide K, which tileq serves with a partial last group), or when asked for with
``save_pretrained(..., format="tileq")``.

Layout (format_version 1)
-------------------------

A Hugging Face model directory: ``config.json`` (the model's config) and safetensors files
(``model.safetensors``, or shards + ``model.safetensors.index.json``). Each safetensors header's
metadata holds ``{"format": "pt", "tileq_format": "1", "producer": "tileq <version>"}``.

``config.json["quantization_config"]``::

    {"quant_method": "tileq", "format_version": 1, "tileq_version": "0.1.0",
     "layers": {"<module name>": <layer>, ...}}

one entry per quantized ``nn.Linear`` (every other module is stored as in a plain Hugging Face
checkpoint). ``<layer>``::

    {"config": "W4A16",                  # tileq.nn config name (A8W8, FP8Row, FP8Block, W8A16,
                                          #   W4A16, W4A8)
     "options": {"group_size": 96},       # the config's fields (group_size / block_size), JSON
     "in_features": K, "out_features": N, "bias": true | false, "static_input_scale": true | false,
     "weight": {"dtype": "uint8", "shape": [N, K // 2], "packing": "pk_int4"},
     "weight_scale": {"dtype": "float32", "shape": [Gk, Gn], "group_k": 96, "group_n": 1},
     "activations": {"dtype": null | "int8" | "fp8", "granularity": null | "row" | "group"}}

Tensors of layer ``L`` (exactly ``tileq.nn.QuantLinear``'s state dict):

- ``L.weight``: int8 [N, K] (A8W8, W8A16); float8_e4m3fn [N, K] (FP8Row, FP8Block); uint8
  [N, K / 2] for int4 (W4A16, W4A8), ``packing: "pk_int4"``: byte ``j`` of row ``n`` holds the
  values at k = 2j (high nibble) and k = 2j + 1 (low nibble), stored as value + 8 (nibble 0 is
  -8, 15 is 7): CK's pk_int4 order, docs/schemes.md section 1. Row-major, K contiguous.
- ``L.weight_scale``: float32, the dequantization multiplier (w = q * s) in the b_scale layout of
  the logical B = weight^T: [N] for per-channel configs (``group_k``/``group_n`` null); for groups
  [ceil(K / group_k), ceil(N / group_n)] row-major, group (g, h) covering k in
  [g * group_k, (g + 1) * group_k) and n in [h * group_n, (h + 1) * group_n) (the last group along
  either dimension may be partial). group_n is 1 (int4 groups along K) or 128 (FP8Block).
- ``L.bias``: float32 [N] when ``bias`` is true.
- ``L.input_scale``: float32 0-d static per-tensor activation scale when ``static_input_scale``.

Reading checks every entry against the config (a dtype, shape or packing other than the one the
config stores is refused), so a file from a later format_version or with another packing is never
misread.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import DTypeError, ShapeError, UnsupportedError, expect
from .safetensors_io import CheckpointReader, dtype_name

QUANT_METHOD = "tileq"
FORMAT_VERSION = 1
PACKING = {"int8": "none", "fp8": "none", "int4": "pk_int4"}


def config_options(cfg) -> dict:
    """The config's own fields (not skip_modules), JSON-ready."""
    # int4_layout is how a process holds int4 weights in memory; files always hold pk_int4.
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in ("skip_modules", "int4_layout")}


def layer_entry(layer) -> dict:
    """The metadata of one QuantLinear."""
    cfg = layer.config
    per_channel = cfg.weight_granularity == "col"
    return {
        "config": cfg.name,
        "options": config_options(cfg),
        "in_features": layer.in_features,
        "out_features": layer.out_features,
        "bias": layer.bias is not None,
        "static_input_scale": layer.input_scale is not None,
        "weight": {"dtype": dtype_name(layer.weight_dtype), "shape": list(layer.weight_shape),
                   "packing": PACKING[cfg.weight_dtype]},
        "weight_scale": {"dtype": "float32", "shape": list(layer.weight_scale.shape),
                         "group_k": None if per_channel else cfg.group_k,
                         "group_n": None if per_channel else cfg.group_n},
        "activations": {"dtype": cfg.act_dtype, "granularity": cfg.act_granularity},
    }


def quantization_config(layers: dict) -> dict:
    from ..version import __version__

    return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "tileq_version": __version__,
            "layers": {name: layer_entry(layer) for name, layer in layers.items()}}


def layer_tensors(name: str, layer) -> list:
    out = [(f"{name}.weight", layer.packed_weight()), (f"{name}.weight_scale", layer.weight_scale)]
    if layer.bias is not None:
        out.append((f"{name}.bias", layer.bias))
    if layer.input_scale is not None:
        out.append((f"{name}.input_scale", layer.input_scale))
    return out


# ----------------------------------------------------------------------------- reading


def parse_config(qc: dict) -> dict:
    where = "quantization_config"
    version = qc.get("format_version")
    if version != FORMAT_VERSION:
        raise UnsupportedError(expect(f"{where}.format_version", f"{FORMAT_VERSION} (this tileq reads it)",
                                      repr(version)))
    layers = qc.get("layers")
    if not isinstance(layers, dict):
        raise UnsupportedError(expect(f"{where}.layers", "an object of layer entries", type(layers).__name__))
    return layers


def plan_layer(name: str, entry: dict, linear):
    """The tileq config of ``name`` from its metadata, checked against the model and the config."""
    from ..nn import QuantLinear, config_from_name
    from ..nn.configs import weight_scale_shape

    where = f"quantization_config.layers.{name}"
    if not isinstance(entry, dict):
        raise UnsupportedError(expect(where, "a layer object", type(entry).__name__))
    try:
        cfg = config_from_name(entry.get("config"), **(entry.get("options") or {}))
    except TypeError as e:
        raise UnsupportedError(expect(f"{where}.options", "the config's fields", f"{entry.get('options')!r} ({e})")) from None
    n, k = linear.out_features, linear.in_features
    if (entry.get("in_features"), entry.get("out_features")) != (k, n):
        raise ShapeError(expect(f"{where}", f"in_features={k}, out_features={n} (the model's layer)",
                                f"in_features={entry.get('in_features')}, out_features={entry.get('out_features')}"))
    probe = QuantLinear(k, n, linear.bias is not None, config=cfg, device="meta")
    want = layer_entry(probe)
    want["static_input_scale"] = entry.get("static_input_scale")
    for key in ("weight", "weight_scale", "activations", "bias", "static_input_scale"):
        if entry.get(key) != want[key]:
            raise UnsupportedError(expect(f"{where}.{key}", f"{want[key]!r} for {cfg.describe()}",
                                          repr(entry.get(key))))
    if entry["static_input_scale"] not in (True, False):
        raise UnsupportedError(expect(f"{where}.static_input_scale", "true or false",
                                      repr(entry["static_input_scale"])))
    assert tuple(want["weight_scale"]["shape"]) == weight_scale_shape(cfg, n, k)
    return cfg, bool(entry["static_input_scale"])


def load_layer(reader: CheckpointReader, name: str, linear, cfg, static_input: bool, *, device, dtype):
    from ..nn import QuantLinear

    probe = QuantLinear(linear.in_features, linear.out_features, linear.bias is not None, config=cfg,
                        device="meta")
    expected = {"weight": (probe.weight.dtype, tuple(probe.weight.shape)),
                "weight_scale": (torch.float32, tuple(probe.weight_scale.shape))}
    if linear.bias is not None:
        expected["bias"] = (torch.float32, (linear.out_features,))
    if static_input:
        expected["input_scale"] = (torch.float32, ())
    for key in reader.children(name):
        local = key[len(name) + 1:]
        if local not in expected:
            raise UnsupportedError(f"{key}: unexpected tensor for tileq {cfg.name} (expected only "
                                   f"{', '.join(sorted(expected))})")
    tensors, consumed = {}, []
    for local, (dt, shape) in expected.items():
        key = f"{name}.{local}"
        if key not in reader:
            raise ShapeError(f"{key}: missing (tileq {cfg.name} stores it)")
        info = reader.info(key)
        want = f"{dtype_name(dt)} {list(shape)}"
        if info.dtype != dt:
            raise DTypeError(f"{key}: expected {want} for tileq {cfg.name}, got {info.describe()}")
        if info.shape != shape:
            raise ShapeError(f"{key}: expected {want} for tileq {cfg.name}, got {info.describe()}")
        tensors[local] = reader.read(key, device)
        consumed.append(key)
    layer = QuantLinear.from_quantized(tensors["weight"], tensors["weight_scale"], config=cfg,
                                       bias=tensors.get("bias"), input_scale=tensors.get("input_scale"),
                                       in_features=linear.in_features, dtype=dtype)
    return layer, consumed
