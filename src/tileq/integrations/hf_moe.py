"""tileq as a transformers experts implementation (``transformers.integrations.moe``, 5.17
through 5.25: ``compat.py``).

transformers' MoE models keep their routed experts in one module per layer (``Qwen3MoeExperts``,
``Qwen2MoeExperts``, ``MixtralExperts``, ``DeepseekV3Experts`` and every class decorated with
``@use_experts_implementation`` the same way: 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj``
[E, H, I], concatenated gate/up, no bias, SiLU). The decorator makes the module's ``forward`` look
its implementation up in ``ALL_EXPERTS_FUNCTIONS`` under ``config._experts_implementation``
("eager", "grouped_mm", ...). ``quantize_experts_`` registers "tileq" there, replaces each such
module by a ``tileq.moe.QuantExperts`` whose class also derives from the original one (so
``isinstance`` checks and transformers' hooks still match, and its ``forward`` is still
transformers' dispatcher, which refuses any implementation but "tileq" with a clear error) and sets
``config._experts_implementation = "tileq"``. The model's own
code keeps routing (its router, its top-k weights, its shared experts and dense MLPs, which
``quantize_`` turns into ``QuantLinear`` layers) and calls the experts as before.

An experts module that stays unquantized (skipped by name or ``filter_fn``, or a layout tileq does
not run: the reason is listed) runs transformers' eager loop under "tileq", as under "eager".

``tileq.quantize_`` runs ``quantize_experts_`` on a model holding such modules: importing this
module registers it there (``nn/quantize.py``'s ``ModuleKind``; ``tileq.extensions`` imports it).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..errors import UnsupportedError, expect
from . import compat
from ..moe.experts import QuantExperts, experts_refusal
from ..nn.configs import QuantConfig
from ..nn.quantize import ModuleKind, register_module_kind, skip_reason

IMPLEMENTATION = "tileq"
_CLASSES: dict = {}
# Attributes transformers' experts code and the decorator read on the module.
_KEEP = ("config", "has_gate", "has_bias", "is_transposed", "is_concatenated", "act_fn")


def tileq_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "tileq" experts implementation: ``QuantExperts.forward``; an unconverted module runs its
    class's own (eager) forward."""
    if isinstance(self, QuantExperts):
        return QuantExperts.forward(self, hidden_states, top_k_index, top_k_weights)
    eager = getattr(type(self).forward, "__wrapped__", type(self).forward)
    return eager(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register "tileq" in transformers' ``ALL_EXPERTS_FUNCTIONS`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    compat.require_supported("tileq's experts implementation")

    ExpertsInterface.register(IMPLEMENTATION, tileq_experts_forward)


def is_experts_module(mod: nn.Module) -> bool:
    """A module holding routed experts as 3-D tensors (converted or not)."""
    gu = getattr(mod, "gate_up_proj", None)
    return isinstance(mod, QuantExperts) or (isinstance(gu, nn.Parameter) and gu.dim() == 3)


def _unconverted(mod: nn.Module) -> bool:
    return is_experts_module(mod) and not isinstance(mod, QuantExperts)


def _forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' dispatcher (the original class's forward), refusing any implementation but
    "tileq": another one would read the quantized buffers as if they were bf16 weights."""
    impl = self.config._experts_implementation
    if impl != IMPLEMENTATION:
        raise UnsupportedError(expect(
            "config._experts_implementation", f"{IMPLEMENTATION!r} for experts quantized by tileq "
            f"(model.set_experts_implementation({IMPLEMENTATION!r}))", repr(impl)))
    return self._tileq_original.forward(self, hidden_states, top_k_index, top_k_weights)


def _tileq_class(orig: type) -> type:
    cls = _CLASSES.get(orig)
    if cls is None:
        cls = type(f"Tileq{orig.__name__}", (QuantExperts, orig),
                   {"forward": _forward, "__module__": __name__, "_tileq_original": orig})
        _CLASSES[orig] = cls
    return cls


def convert(mod: nn.Module, config: QuantConfig) -> QuantExperts:
    """A QuantExperts holding ``mod``'s experts quantized; for a class dispatching through
    transformers' experts interface, an instance of a subclass of both (module docstring)."""
    register()
    return _stand_in(QuantExperts.from_experts(mod, config), mod)


def _stand_in(new: QuantExperts, mod: nn.Module) -> QuantExperts:
    if hasattr(type(mod).forward, "__wrapped__") and hasattr(mod, "config"):
        new.__class__ = _tileq_class(type(mod))
        for attr in _KEEP:
            if hasattr(mod, attr):
                setattr(new, attr, getattr(mod, attr))
    return new


def empty_like(mod: nn.Module, config: QuantConfig, *, dtype) -> QuantExperts:
    """An unfilled QuantExperts (buffers on the meta device) of ``mod``'s shape, standing where
    ``mod`` stood as ``convert`` makes it: a checkpoint loader sets its buffers. ``mod`` may be on
    the meta device (its weights are not read)."""
    register()
    why = experts_refusal(mod)
    if why is not None and not why.startswith("weights on the meta device"):
        raise UnsupportedError(expect("module", "a transformers experts module tileq can run", why))
    e, i2, h = mod.gate_up_proj.shape
    return _stand_in(QuantExperts(e, h, i2 // 2, config=config, dtype=dtype, device="meta"), mod)


def describe(new: QuantExperts) -> str:
    """What a conversion did, for quantize_'s summary."""
    via = "transformers' experts interface ('tileq')" if hasattr(new, "_tileq_original") else "its own forward"
    return (f"{new.num_experts} experts {new.hidden_dim}->{new.intermediate_dim}->{new.hidden_dim} quantized "
            f"{new.quant_config.name}, run by tileq.moe.fused_moe through {via}")


def quantize_experts_(model: nn.Module, config: QuantConfig,
                      filter_fn: Callable[[nn.Module, str], bool] | None = None, *,
                      skipped: list | None = None) -> list[tuple[str, str]]:
    """Replace ``model``'s experts modules by tileq ones, in place; returns [(name, what was done)].

    Modules named in ``config.skip_modules`` or refused by ``filter_fn(module, name)`` stay, and
    so does a layout tileq does not run: each is appended to ``skipped`` as (name, why) when a list
    is given. A model is never left half-converted by an exception.
    """
    register()
    done, configs = [], []
    targets = [(n, m) for n, m in model.named_modules() if n and _unconverted(m)]
    for name, mod in targets:
        why = skip_reason(name, mod, config, filter_fn) or experts_refusal(mod)
        if why is None:
            try:
                new = convert(mod, config)
            except Exception as e:  # noqa: BLE001 - never leave the model half-converted
                why = f"{type(e).__name__}: {e}"
        if why is not None:
            if skipped is not None:
                skipped.append((name, why))
            continue
        model.set_submodule(name, new)
        done.append((name, describe(new)))
        cfg = getattr(new, "config", None)
        if hasattr(new, "_tileq_original") and cfg is not None and all(cfg is not c for c in configs):
            configs.append(cfg)
    for cfg in configs:
        cfg._experts_implementation = IMPLEMENTATION
    return done


def use_tileq_experts(new: QuantExperts) -> None:
    """Point the model config a converted experts module dispatches through at "tileq"."""
    cfg = getattr(new, "config", None)
    if hasattr(new, "_tileq_original") and cfg is not None:
        cfg._experts_implementation = IMPLEMENTATION


register_module_kind(ModuleKind(matches=_unconverted, convert=quantize_experts_))
