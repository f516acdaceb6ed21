"""``quantize_(model, config, filter_fn=None)``: replace a model's nn.Linear layers in place by
``QuantLinear`` ones, torchao-style, and say what was done.

Every nn.Linear is either converted or listed with the reason it stays in its dtype (skipped by
name, refused by ``filter_fn``, a shape the config cannot serve, a weight that cannot be
quantized): a model is never left half-converted by an exception.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from .. import extensions
from ..errors import UnsupportedError, expect
from .configs import QuantConfig
from .linear import QuantLinear, quantize_linear_or_reason

log = logging.getLogger("tileq")


@dataclass(frozen=True)
class ModuleKind:
    """Modules that ``quantize_`` converts through a floor above this one (``integrations/hf_moe.py``
    registers transformers' experts modules). ``matches(module)``: whether a module is one;
    ``convert(model, config, filter_fn, skipped=)`` converts every one in place, appends those it
    leaves to ``skipped`` as (name, why) and returns [(name, what was done)]."""

    matches: Callable[[nn.Module], bool]
    convert: Callable[..., list[tuple[str, str]]]


# Filled by the floors above when imported (tileq.extensions imports them on quantize_'s first call).
_module_kinds: list[ModuleKind] = []
_sharded_quantizer: Callable | None = None


def register_module_kind(kind: ModuleKind) -> None:
    if kind not in _module_kinds:
        _module_kinds.append(kind)


def register_sharded_quantizer(quantizer: Callable) -> None:
    """``quantizer(model, calibration)``: the tensor-parallel quantizer of a model with a device
    mesh (its ``quantize_linear(name, linear, config)`` gives (the rank's layer, "") or (None, why)),
    None where the mesh shards nothing; it raises for what a sharded model refuses.
    ``tileq.distributed`` registers it."""
    global _sharded_quantizer
    _sharded_quantizer = quantizer


@dataclass
class QuantizeSummary:
    """What ``quantize_`` did: converted layer names and the ones left alone, with reasons."""

    config: QuantConfig
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    experts: list[tuple[str, str]] = field(default_factory=list)  # MoE experts modules converted, and how

    def __str__(self) -> str:
        lines = [f"tileq.quantize_ ({self.config.describe()}): {len(self.converted)} layers converted, "
                 f"{len(self.skipped)} left unquantized"]
        for name, what in self.experts:
            lines.append(f"  experts {name}: {what}")
        for name, why in self.skipped:
            lines.append(f"  kept {name}: {why}")
        return "\n".join(lines)


def skip_reason(name: str, module: nn.Module, config: QuantConfig,
                filter_fn: Callable[[nn.Module, str], bool] | None = None) -> str | None:
    """Why the caller asked to leave module ``name`` unquantized (``config.skip_modules``, by its
    full or last name; ``filter_fn``), None if it did not: ``quantize_``, its experts conversion and
    the quantize-on-load path decide alike."""
    if name in config.skip_modules or name.rsplit(".", 1)[-1] in config.skip_modules:
        return "in config.skip_modules"
    if filter_fn is not None and not filter_fn(module, name):
        return "filter_fn returned False"
    return None


def quantize_(model: nn.Module, config: QuantConfig,
              filter_fn: Callable[[nn.Module, str], bool] | None = None, *,
              calibration: Callable[[nn.Module], object] | None = None) -> QuantizeSummary:
    """Convert ``model``'s nn.Linear layers to ``QuantLinear`` with ``config``, in place.

    ``filter_fn(module, name)`` (torchao's convention) returns True for layers to convert; by
    default every nn.Linear is converted except ``config.skip_modules`` (the output head). The
    summary is returned and logged on the ``tileq`` logger at INFO.

    ``calibration`` (int4 configs): a function run once on the unquantized model, e.g.
    ``lambda m: m(**batch)``; the inputs it feeds each layer make the layer's Hessian, and its
    int4 weights are rounded with GPTQ instead of to nearest.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedError(expect("model", "a torch.nn.Module", type(model).__name__))
    if not isinstance(config, QuantConfig):
        raise UnsupportedError(expect("config", "a tileq quantization config (e.g. tileq.A8W8Config())",
                                      type(config).__name__))
    if filter_fn is not None and not callable(filter_fn):
        raise UnsupportedError(expect("filter_fn", "None or a callable (module, name) -> bool",
                                      type(filter_fn).__name__))
    if calibration is not None and (not callable(calibration) or config.weight_dtype != "int4"):
        raise UnsupportedError(expect("calibration", "a callable, with an int4 config (GPTQ rounds int4 "
                                                     "weights)", f"{type(calibration).__name__} with "
                                                     f"{config.name}"))
    summary = QuantizeSummary(config)
    extensions.load()
    for kind in _module_kinds:
        if any(kind.matches(mod) for mod in model.modules()):
            summary.experts += kind.convert(model, config, filter_fn, skipped=summary.skipped)
    tp = None
    if getattr(model, "_device_mesh", None) is not None:  # sharded by transformers' tp_plan
        if _sharded_quantizer is None:
            raise UnsupportedError("quantize_ on a model sharded by transformers' tp_plan needs tileq.distributed, "
                                   "which registered no tensor-parallel quantizer (it could not be imported: "
                                   "`import tileq.distributed` says why)")
        tp = _sharded_quantizer(model, calibration)
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if isinstance(model, nn.Linear):
        raise UnsupportedError(expect("model", "a model containing nn.Linear layers (quantize_ replaces "
                                               "them in their parents)", "an nn.Linear itself; use "
                                               "tileq.QuantLinear.from_linear"))
    chosen = []
    for name, mod in targets:
        why = skip_reason(name, mod, config, filter_fn)
        if why is not None:
            summary.skipped.append((name, why))
            continue
        chosen.append((name, mod))
    hessians = _hessians(model, dict(chosen), calibration) if calibration is not None else {}
    for name, mod in chosen:
        if tp is not None:  # the rank's slice, with the tp_plan's forward transforms
            layer, why = tp.quantize_linear(name, mod, config)
        else:
            layer, why = quantize_linear_or_reason(mod, config, hessians.get(name))
        if layer is None:
            summary.skipped.append((name, why))
            continue
        layer.qualified_name = name  # errors about the layer's input name it
        _replace(model, name, layer)
        summary.converted.append(name)
    log.info("%s", summary)
    return summary


def _hessians(model: nn.Module, layers: dict, calibration) -> dict:
    """H = 2 X^T X per layer from the inputs ``calibration(model)`` gives it (unquantized model)."""
    import torch

    from .gptq import HessianCollector

    collector = HessianCollector(layers)
    try:
        with torch.no_grad():
            calibration(model)
    finally:
        collector.remove()
    return collector.h


def _replace(model: nn.Module, name: str, layer: QuantLinear) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, layer)
