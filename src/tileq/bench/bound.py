"""A decode step's byte bound: the bytes one step must read over the bandwidth bf16 cuBLAS reaches on
decode GEMVs of the same GPU, measured in the same run (``tileq e2e``, ``tileq moebench``).

``step_bytes`` counts what one decode step of a transformers causal LM (bf16, quantized by tileq's
``quantize_``, fused by ``fuse_decoder_``, or a peer's tensor subclasses) must read:

- every parameter and persistent buffer once (weights, weight scales, biases, norms, the router),
  a tied lm_head once; non-persistent buffers are no weights (QuantLinear's tile counters,
  the rotary embedding's ``inv_freq`` tables);
- of the input embedding table, the ``batch`` rows the step looks up (the table itself only where it
  is the tied lm_head's weight);
- of each experts module (transformers' 3-D ``gate_up_proj`` / ``down_proj`` experts, or a
  ``QuantExperts``), the experts a step touches: for E experts and top-k routing at ``batch``
  tokens, the expected number of distinct experts among ``batch`` uniform draws of k distinct
  experts, E (1 - (1 - k/E)^batch), times one expert's bytes (the module's over E);
- the KV cache attention reads: layers x 2 x kv_heads x head_dim x context_len x batch x the
  element size of the model's activations (the input embedding's dtype).

``gemv_bandwidth`` times ``torch.nn.functional.linear`` at M = 1 on weight shapes (N, K) with
bench/timing.py's ``Timer`` (CUDA events, the L2 flushed by a read before every run, so the weight
comes from HBM) and returns the median bytes per second over the shapes of at least
``MIN_WEIGHT_BYTES`` of weight (where none is that large, each shape widened along N to it).

The share of the bound is (``step_bytes`` total / bandwidth) / the measured step time: 1.0 is a step
that moves its bytes as fast as cuBLAS streams a large bf16 weight.
"""

from __future__ import annotations

import math
import statistics

import torch
from torch import nn

from .timing import Timer, TimingConfig

MIN_WEIGHT_BYTES = 25e6  # the weights a decode bandwidth is read on (README's "weights >= 25 MB")
TIMING = TimingConfig(warmup=10, runs=30, flush="read")
PARTS = ("weights", "experts", "kv_cache", "embedding_rows")  # step_bytes' parts, before its "total"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` stores; a tensor subclass (torchao's quantized weights) by its inner tensors."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def _stored(module: nn.Module):
    """Every parameter and persistent buffer of ``module`` and its children (a step's reads)."""
    for mod in module.modules():
        yield from (p for p in mod._parameters.values() if p is not None)
        yield from (b for name, b in mod._buffers.items()
                    if b is not None and name not in mod._non_persistent_buffers_set)


def module_bytes(module: nn.Module, seen: set | None = None) -> int:
    """Bytes of ``module``'s parameters and persistent buffers, each tensor once (ids in ``seen``,
    which it extends: a tensor already there is not counted again)."""
    seen = set() if seen is None else seen
    total = 0
    for t in _stored(module):
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    return total


def touched_experts(experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts among ``batch`` tokens each routed to ``top_k`` distinct experts of
    ``experts``, uniformly: E (1 - (1 - k/E)^batch)."""
    return experts * (1.0 - (1.0 - min(top_k, experts) / experts) ** batch)


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def kv_cache_bytes(config, *, batch: int, context_len: int, element_size: int) -> int:
    """Bytes of keys and values attention reads over ``context_len`` positions (a multi-head or
    grouped-query cache: layers x 2 x kv_heads x head_dim x context_len x batch x element size)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * context_len * batch * element_size


def step_bytes(model: nn.Module, *, batch: int, context_len: int, top_k: int | None = None) -> dict:
    """The bytes one decode step of ``model`` at ``batch`` sequences of ``context_len`` cached
    positions must read, by part (module docstring): {"weights", "experts", "kv_cache",
    "embedding_rows", "total"}. ``top_k``: the experts per token (default: the config's
    ``num_experts_per_tok``)."""
    from ..integrations.hf_moe import is_experts_module

    cfg = _text_config(model)
    embed = model.get_input_embeddings()
    out_embed = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = out_embed is not None and getattr(out_embed, "weight", None) is embed.weight
    seen = set() if tied else {id(embed.weight)}  # the table is read whole only as the tied lm_head
    out = dict.fromkeys(PARTS, 0.0)
    k = top_k if top_k is not None else getattr(cfg, "num_experts_per_tok", None)
    for mod in model.modules():
        if is_experts_module(mod):
            if k is None:
                raise ValueError(f"{type(mod).__name__}: experts without a top-k (pass top_k=)")
            e = mod.gate_up_proj.shape[0]
            out["experts"] += module_bytes(mod, seen) / e * touched_experts(e, k, batch)
    out["weights"] = float(module_bytes(model, seen))
    width = embed.weight.element_size()
    out["embedding_rows"] = float(batch * embed.weight.shape[1] * width)
    out["kv_cache"] = float(kv_cache_bytes(cfg, batch=batch, context_len=context_len, element_size=width))
    out["total"] = sum(out[p] for p in PARTS)
    return out


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct (N, K) weight shapes of ``model``'s nn.Linear layers, in model order."""
    return list(dict.fromkeys((m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear)))


def _distinct(shapes) -> list[tuple[int, int]]:
    return list(dict.fromkeys((int(n), int(k)) for n, k in shapes))


def bandwidth_shapes(shapes, element_size: int = 2, min_bytes: float = MIN_WEIGHT_BYTES) -> list[tuple[int, int]]:
    """The distinct shapes ``gemv_bandwidth`` times: those of ``min_bytes`` of weight or more; where
    none is, each widened along N by the whole multiple of its rows that reaches ``min_bytes``."""
    shapes = _distinct(shapes)
    large = [(n, k) for n, k in shapes if n * k * element_size >= min_bytes]
    if large:
        return large
    return list(dict.fromkeys((n * math.ceil(min_bytes / (n * k * element_size)), k) for n, k in shapes))


def bandwidth_method(shapes, dtype=torch.bfloat16, min_bytes: float = MIN_WEIGHT_BYTES) -> str:
    """How ``gemv_bandwidth(shapes)`` measures, in words (a report's header)."""
    timed = bandwidth_shapes(shapes, dtype.itemsize, min_bytes)
    given = set(_distinct(shapes))
    which = (f"{len(timed)} of its {len(given)} weight shapes of >= {min_bytes / 1e6:.0f} MB"
             if set(timed) <= given else
             f"its {len(given)} weight shapes, none of {min_bytes / 1e6:.0f} MB, each widened along N to it")
    dims = ", ".join(f"{n}x{k}" for n, k in timed)
    return (f"torch.nn.functional.linear in {str(dtype).removeprefix('torch.')} at M=1 (cuBLAS) on {which} "
            f"(N x K: {dims}); per shape the median of {TIMING.runs} runs after {TIMING.warmup} warm-ups, one "
            "CUDA-event pair per run, the L2 flushed by a read before each (bench/timing.py); bytes = weight + "
            "input + output; the median over the shapes")


def gemv_bandwidth(shapes, device, dtype=torch.bfloat16, min_bytes: float = MIN_WEIGHT_BYTES) -> float | None:
    """Median bytes per second of ``torch.nn.functional.linear`` at M = 1 over ``bandwidth_shapes``
    (``bandwidth_method`` says how); None off a CUDA device (a bound needs the GPU's number)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    timer = Timer(device, TIMING)
    rates = []
    for n, k in bandwidth_shapes(shapes, dtype.itemsize, min_bytes):
        w = torch.randn(n, k, device=device, dtype=dtype)
        x = torch.randn(1, k, device=device, dtype=dtype)
        ms = timer.measure(lambda w=w, x=x: torch.nn.functional.linear(x, w)).median_ms
        rates.append((n * k + k + n) * dtype.itemsize / (ms * 1e-3))
        del w, x
    del timer
    torch.cuda.empty_cache()
    return statistics.median(rates)
