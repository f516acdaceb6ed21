"""tileq as a transformers quantization method ("tileq"), so that ``from_pretrained`` quantizes
while it loads and reads tileq checkpoints:

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=tileq.A8W8Config(),
                                                 device_map="cuda")

Quantize on load: before any weight is read, every layer ``tileq.quantize_`` would convert (the
same choice: ``nn/quantize.py``'s ``skip_reason``, the config's ``cannot_serve``, the experts'
refusals) is replaced on the meta device by an unfilled ``QuantLinear`` / ``QuantExperts`` whose
float placeholders ``weight`` and ``bias`` (``gate_up_proj`` / ``down_proj``) tell transformers'
loader the dtype to read them in. transformers then reads one tensor at a time onto its device and
hands each placeholder's tensor to ``QuantizeOnLoad``, which quantizes it with the function
``quantize_`` uses (``QuantLinear.from_weight``, ``QuantExperts.quantize_stacked``) and returns the
stored tensors: the bf16 model never exists, and the result equals bf16 load + ``quantize_`` bit
for bit. After loading, the model's ``config.quantization_config`` describes the checkpoint in
tileq's format (``formats/tileq_format.py``), so ``model.save_pretrained`` writes a checkpoint that
both ``AutoModelForCausalLM.from_pretrained`` and ``tileq.from_pretrained`` read.

Pre-quantized: a tileq-format checkpoint (``quant_method: "tileq"`` with ``layers``) loads into
empty tileq layers of each entry's config; the tensors are stored as the layers hold them.
compressed-tensors checkpoints stay transformers' own method (or ``tileq.from_pretrained``).

Refused with the alternative named: tensor parallelism (``tp_plan``), CPU / disk offload.
Importing this module registers "tileq" (``register()``); ``tileq/__init__.py`` imports it when
``transformers.quantizers.auto`` is imported, before or after tileq.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..errors import UnsupportedError, expect
from ..integrations import compat, hf_moe
from ..moe.experts import QuantExperts, experts_refusal
from ..nn.configs import QuantConfig, config_from_dict
from ..nn.linear import QuantLinear
from ..nn.quantize import QuantizeSummary, skip_reason
from . import moe as moe_fmt
from . import tileq_format as tqf

log = logging.getLogger("tileq")

METHOD = "tileq"
_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class TileqQuantizationConfig(QuantizationConfigMixin):
    """``config.json``'s ``quantization_config`` for tileq. Either a request to quantize on load
    (``QuantConfig.to_dict``: ``{"quant_method": "tileq", "config": "A8W8", "options": {...},
    "skip_modules": [...]}``) or a tileq checkpoint's description (``{"quant_method": "tileq",
    "format_version": 1, "layers": {...}}``, ``formats/tileq_format.py``)."""

    def __init__(self, config=None, options=None, skip_modules=None, layers=None, format_version=None,
                 tileq_version=None, **kwargs):
        self.quant_method = METHOD
        self.description = {"quant_method": METHOD}
        if layers is not None:
            self.description.update(format_version=format_version, tileq_version=tileq_version, layers=layers)
            self.request = None
        else:
            d = {"config": config, "options": options or {}}
            if skip_modules is not None:
                d["skip_modules"] = list(skip_modules)
            self.request = config_from_dict(d)
            self.description.update(self.request.to_dict())

    @classmethod
    def of(cls, config) -> TileqQuantizationConfig:
        if isinstance(config, cls):
            return config
        if isinstance(config, QuantConfig):
            return cls(**{k: v for k, v in config.to_dict().items() if k != "quant_method"})
        if isinstance(config, dict):
            return cls(**{k: v for k, v in config.items() if k != "quant_method"})
        raise UnsupportedError(expect("quantization_config", "a tileq config (e.g. tileq.A8W8Config())",
                                      type(config).__name__))

    def to_dict(self) -> dict:
        return dict(self.description)

    def to_diff_dict(self) -> dict:
        return self.to_dict()

    def __repr__(self) -> str:
        what = self.request.describe() if self.request is not None else f"{len(self.description['layers'])} layers"
        return f"TileqQuantizationConfig({what})"


class QuantizeOnLoad:
    """transformers' conversion op for the placeholders: each weight read is quantized into its
    layer's stored tensors (a ``ConversionOps``: the class is made by ``_conversion_op_class``)."""

    def __init__(self, quantizer: TileqHfQuantizer):
        self.quantizer = quantizer

    def convert(self, input_dict: dict, **kwargs) -> dict:
        model = kwargs["model"]
        out = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            prefix, _, attr = key.rpartition(".")
            module = model.get_submodule(prefix)
            with torch.no_grad():
                out.update(_quantized(module, prefix, attr, tensor))
        return out


def _quantized(module: nn.Module, prefix: str, attr: str, t: torch.Tensor) -> dict:
    if isinstance(module, QuantLinear):
        if attr == "bias":  # as quantize_ keeps it: in the model's dtype, then fp32
            return {f"{prefix}.bias": t.to(module.dtype).float()}
        layer = QuantLinear.from_weight(t.to(module.dtype), None, module.config, where=f"{prefix}.weight")
        return {f"{prefix}.weight": layer.weight, f"{prefix}.weight_scale": layer.weight_scale}
    q, s = module.quantize_stacked(t.to(module.dtype))
    return {f"{prefix}.{attr}": q, f"{prefix}.{attr}_scale": s}


_OP_CLASS = None


def _conversion_op_class():
    """``QuantizeOnLoad`` as a subclass of transformers' ``ConversionOps`` (imported on first use:
    ``core_model_loading`` imports the modeling code, which is still loading when tileq registers)."""
    global _OP_CLASS
    if _OP_CLASS is None:
        from transformers.core_model_loading import ConversionOps

        _OP_CLASS = type("TileqQuantizeOnLoad", (QuantizeOnLoad, ConversionOps), {"__module__": __name__})
    return _OP_CLASS


class TileqHfQuantizer(HfQuantizer):
    """The "tileq" method of ``from_pretrained`` (module docstring)."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(TileqQuantizationConfig.of(quantization_config), **kwargs)
        qc = self.quantization_config
        if self.pre_quantized and qc.request is not None:
            raise UnsupportedError("this checkpoint's config.json asks for tileq quantization on load but holds no "
                                   "tileq layers: pass quantization_config=tileq.<Config>() to from_pretrained on a "
                                   "bf16 checkpoint, or load a checkpoint tileq wrote")
        if not self.pre_quantized and qc.request is None:
            raise UnsupportedError("quantization_config describes a tileq checkpoint's layers; to quantize a bf16 "
                                   "checkpoint on load pass a config such as tileq.A8W8Config()")
        self.summary = QuantizeSummary(qc.request) if qc.request is not None else None

    # ------------------------------------------------------------------ checks

    def validate_environment(self, *args, device_map=None, **kwargs):
        compat.require_supported("from_pretrained with a tileq quantization_config")
        if isinstance(device_map, dict):
            places = {str(v) for v in device_map.values()}
            if "disk" in places or ("cpu" in places and len(places) > 1):
                raise UnsupportedError(expect(
                    "device_map", "every module on one device or spread over GPUs (tileq layers are not "
                    "offloaded; give max_memory room for the quantized model)", f"{sorted(places)}"))

    def _refuse_tensor_parallel(self, model) -> None:
        if getattr(model.config, "distributed_config", None) is not None or \
                getattr(model, "_device_mesh", None) is not None:
            raise UnsupportedError(
                "from_pretrained(tp_plan=..., quantization_config=<tileq config>): quantizing while loading a "
                "tensor-parallel model is not supported. Load the bf16 model with tp_plan and call "
                "tileq.quantize_(model, config) (each rank quantizes its shard), or save a quantized checkpoint "
                "and load it with tileq.from_pretrained(path, tp_plan='auto')")

    # ------------------------------------------------------------------ before loading

    def _process_model_before_weight_loading(self, model, dtype=None, **kwargs):
        self._refuse_tensor_parallel(model)
        dtype = dtype if isinstance(dtype, torch.dtype) else model.dtype
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise UnsupportedError(expect("dtype", "torch.bfloat16, torch.float16 or torch.float32", dtype))
        if self.pre_quantized:
            self._empty_checkpoint_layers(model, dtype)
        else:
            self._empty_layers(model, dtype)
        return model

    def _empty_layers(self, model, dtype) -> None:
        """Unfilled tileq layers with float placeholders wherever quantize_ would convert."""
        config, summary = self.quantization_config.request, self.summary
        tied = _tied_modules(model)
        for name, mod in list(model.named_modules()):
            if not name:
                continue
            if hf_moe.is_experts_module(mod) and not isinstance(mod, QuantExperts):
                why = skip_reason(name, mod, config) or _experts_why(mod)
                if why is not None:
                    summary.skipped.append((name, why))
                    continue
                new = hf_moe.empty_like(mod, config, dtype=dtype)
                for attr in _EXPERT_WEIGHTS:  # the float weight the loader reads and hands to QuantizeOnLoad
                    new._buffers[attr] = torch.empty(getattr(mod, attr).shape, dtype=dtype, device="meta")
                model.set_submodule(name, new)
                summary.experts.append((name, hf_moe.describe(new)))
                hf_moe.use_tileq_experts(new)
            elif isinstance(mod, nn.Linear):
                why = skip_reason(name, mod, config) or config.cannot_serve(mod.in_features, mod.out_features)
                if why is None and name in tied:
                    why = f"tied to {tied[name]} (quantize_ on a loaded model would untie it)"
                if why is not None:
                    summary.skipped.append((name, why))
                    continue
                new = QuantLinear(mod.in_features, mod.out_features, mod.bias is not None, config=config,
                                  dtype=dtype, device="meta")
                new._buffers["weight"] = torch.empty(mod.weight.shape, dtype=dtype, device="meta")
                if mod.bias is not None:
                    new._buffers["bias"] = torch.empty(mod.bias.shape, dtype=dtype, device="meta")
                new.qualified_name = name
                model.set_submodule(name, new)
                summary.converted.append(name)

    def _empty_checkpoint_layers(self, model, dtype) -> None:
        """Unfilled tileq layers of each checkpoint entry's config, holding the stored dtypes."""
        qc = self.quantization_config.description
        layers = tqf.parse_config(qc)
        modules = dict(model.named_modules())
        for name, entry in layers.items():
            mod = modules.get(name)
            if mod is None:
                raise UnsupportedError(f"quantization_config.layers.{name}: the model has no such module")
            if isinstance(entry, dict) and "experts" in entry:
                new = moe_fmt.empty_experts(mod, entry, name, dtype=dtype)
                hf_moe.use_tileq_experts(new)
            else:
                cfg, static_input = tqf.plan_layer(name, entry, mod)
                new = QuantLinear(mod.in_features, mod.out_features, mod.bias is not None, config=cfg,
                                  dtype=dtype, device="meta")
                if cfg.weight_dtype == "int4":  # the stored pk_int4 bytes; converted after loading
                    new._buffers["weight"] = torch.empty(new.weight_shape, dtype=torch.uint8, device="meta")
                if static_input:
                    new._buffers["input_scale"] = torch.empty((), dtype=torch.float32, device="meta")
                new.qualified_name = name
            model.set_submodule(name, new)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        prefix, _, attr = param_name.rpartition(".")
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            return False
        t = module._buffers.get(attr)
        if isinstance(module, QuantLinear):
            placeholders = ("weight", "bias")
        elif isinstance(module, QuantExperts):
            placeholders = _EXPERT_WEIGHTS
        else:
            return False
        # A float placeholder of the model's dtype (_empty_layers); the stored tensors never are one.
        return attr in placeholders and t is not None and t.is_meta and t.dtype == module.dtype

    def param_element_size(self, model, param_name: str, param) -> float:
        """Bytes per element once stored (device_map="auto" sizes the model with it)."""
        if self.param_needs_quantization(model, param_name) and not param_name.endswith(".bias"):
            prefix = param_name.rpartition(".")[0]
            mod = model.get_submodule(prefix)
            cfg = mod.config if isinstance(mod, QuantLinear) else mod.quant_config
            return 0.5 if cfg.weight_dtype == "int4" else 1.0
        return super().param_element_size(model, param_name, param)

    def get_quantize_ops(self):
        return _conversion_op_class()(self)

    # ------------------------------------------------------------------ after loading

    def _process_model_after_weight_loading(self, model, **kwargs):
        layers, experts = {}, {}
        for name, mod in model.named_modules():
            if isinstance(mod, QuantLinear):
                _finish_layer(name, mod)
                layers[name] = mod
            elif isinstance(mod, QuantExperts):
                _finish_experts(name, mod)
                experts[name] = mod
        if experts:
            _keep_experts_stacked(model)
        if self.summary is not None:
            model.tileq_summary = self.summary
            log.info("%s", str(self.summary).replace("tileq.quantize_", "tileq quantize-on-load", 1))
        # The model now holds a tileq checkpoint's layers: config.json describes them, so that
        # save_pretrained writes what both loaders read.
        description = tqf.quantization_config(layers)
        for name, mod in experts.items():
            description["layers"][name] = moe_fmt.experts_entry(mod)
        self.quantization_config = TileqQuantizationConfig(**{k: v for k, v in description.items()
                                                              if k != "quant_method"})
        model.config.quantization_config = self.quantization_config
        return model

    # ------------------------------------------------------------------ properties transformers reads

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _experts_why(mod: nn.Module) -> str | None:
    why = experts_refusal(mod)
    return None if why is not None and why.startswith("weights on the meta device") else why


def _tied_modules(model) -> dict:
    """{module name: the module it shares its weight with} for tied weights (the output head)."""
    out, seen = {}, {}
    for name, mod in model.named_modules(remove_duplicate=False):
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor):
            if id(w) in seen and seen[id(w)] != name:
                out[name] = seen[id(w)]
                out.setdefault(seen[id(w)], name)
            seen.setdefault(id(w), name)
    for key in getattr(model, "all_tied_weights_keys", None) or {}:  # transformers' own record (5.x)
        target = getattr(model, "all_tied_weights_keys")[key]
        out.setdefault(key.removesuffix(".weight"), str(target).removesuffix(".weight"))
    return out


def _finish_layer(name: str, layer: QuantLinear) -> None:
    """Checks what the loader set and puts the layer in its running state (int4 prepacked when its
    config says so; zeroed tile counters with the weight)."""
    for attr in ("weight", "weight_scale", "bias", "input_scale"):
        t = layer._buffers.get(attr)
        if t is not None and t.is_meta:
            raise UnsupportedError(f"{name}.{attr}: not in the checkpoint (the layer was left unfilled)")
    w = layer._buffers.pop("weight")
    layer._buffers["weight"] = torch.empty(0, device="meta")  # _adopt replaces it
    layer._adopt("weight", w, f"{name}.weight")
    for attr in ("weight_scale", "bias", "input_scale"):
        t = layer._buffers.get(attr)
        if t is not None:
            layer._adopt(attr, t, f"{name}.{attr}")
    layer.tile_counters.zero_()  # transformers made the non-persistent buffer with empty_like


def _keep_experts_stacked(model) -> None:
    """save_pretrained reverts the conversions that built each experts module from per-expert
    checkpoint tensors; a QuantExperts is stored stacked (tileq's format), so those go (renamings,
    e.g. Mixtral's block_sparse_moe, stay)."""
    from transformers.core_model_loading import WeightConverter

    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [
            c for c in conversions
            if not (isinstance(c, WeightConverter)
                    and any(p.rstrip("$").endswith(_EXPERT_WEIGHTS) for p in getattr(c, "target_patterns", ())))]


def _finish_experts(name: str, mod: QuantExperts) -> None:
    for local, shape, dt in mod._layout():
        t = mod._buffers[local]
        if t.is_meta:
            raise UnsupportedError(f"{name}.{local}: not in the checkpoint (the experts were left unfilled)")
        if t.dtype != dt or tuple(t.shape) != tuple(shape):
            raise UnsupportedError(expect(f"{name}.{local}", f"{dt} {list(shape)}", f"{t.dtype} {list(t.shape)}"))
        mod._buffers[local] = t.contiguous()


_registered = False


def register() -> None:
    """Register "tileq" with transformers' quantizers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers.quantizers import auto

    if METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(METHOD)(TileqQuantizationConfig)
    if METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(METHOD)(TileqHfQuantizer)
    _registered = True


register()
