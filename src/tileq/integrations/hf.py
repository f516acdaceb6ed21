"""A fused decoder path for tileq-quantized Hugging Face Llama-family models (transformers 5.17
through 5.25: ``compat.py``).

    tileq.nn.quantize_(model, tileq.nn.A8W8Config())
    print(fuse_decoder_(model))

Why: an eager Hugging Face decode step is dominated by host time, every kernel launch costing
microseconds (a bf16 Qwen3-14B spends 66 ms per token on GEMMs needing 7.45 ms, docs/schemes.md
section 6). After ``quantize_`` a decoder layer runs 7 activation quantizations + 7 GEMMs, two RMSNorms of
about 8 eager ops each and two residual adds. ``fuse_decoder_`` rewrites each Llama / Qwen2 / Qwen3
/ Mistral / Qwen3-MoE decoder layer in place, as vLLM does:

* q/k/v become one ``self_attn.qkv_proj`` and gate/up one ``mlp.gate_up_proj``: a ``QuantLinear``
  whose weight rows, weight scales (along their N axis) and biases are the parts' concatenated
  along N. Two GEMMs where there were five, each streaming a larger weight (under CUDA graphs a
  26 MB weight streamed at 2.0 TB/s against 4.0 TB/s for the large ones: a fixed ~6 us per kernel).
* With dynamically quantized activations (A8W8, FP8Row, FP8Block, W4A8), ``input_layernorm`` and
  the activation quantization run as ONE ``tileq.activation.add_rmsnorm_quantize`` call whose
  (q, s) feed the qkv GEMM directly; the attention residual add + ``post_attention_layernorm`` +
  quantization run as another feeding the gate_up GEMM, and a SiLU MLP's ``act_fn(gate) * up`` +
  down_proj's quantization as a third (``silu_mul_quantize``). Per layer that is 4 quantizations
  (3 of them fused with the norms or the SiLU·mul) + 4 GEMMs + an add, against 7 + 7 + 2 x 8 norm
  ops + act/mul + 2 adds.
* A Qwen3-MoE layer whose MLP is a sparse MoE block fuses its attention half only: merged q/k/v
  and ``input_layernorm`` + quantization in one call; the post-attention norm and the block stay
  transformers' (the router reads the normalized bf16 hidden state, the experts quantize their
  routed tokens in ``tileq.moe.fused_moe``). Its dense layers (``mlp_only_layers``) fuse fully.
* Weight-only configs (W8A16, W4A16) have nothing to quantize, and a layer with a static (calibrated)
  activation scale quantizes per tensor, which ``add_rmsnorm_quantize`` does not take: those run
  the merged GEMMs with the norms as they are (the ``QuantLinear`` forward quantizes).

The rest of the layer is transformers' code, mirrored line for line from
``modeling_{llama,qwen2,qwen3,mistral,qwen3_moe}.py`` (identical in the supported releases but for
the KV cache argument's name, ``past_key_values`` or ``cache``, which the fused forwards take by
either name): q_norm/k_norm (Qwen3), the model module's own ``apply_rotary_pos_emb``, the cache's
``update``, ``ALL_ATTENTION_FUNCTIONS`` (falling back to
the module's ``eager_attention_forward``) with the same arguments (``sliding_window`` as each
family passes it; ``position_ids``/``use_cache`` reach the attention function through ``**kwargs``
as they do there), ``o_proj``, ``act_fn(gate) * up``, ``down_proj``. At one query token the attention
function itself becomes ``tileq.attention.decode_attention`` where that computes the same math
(``_attention_fuses``: transformers' sdpa, or eager without a mask, over a cache of fixed shapes such
as ``StaticCache``; TILEQ_DECODE_ATTN=0 keeps
transformers' function).

How the layers are rewritten: each decoder layer, its ``self_attn`` and its ``mlp`` get their class
swapped for a subclass made here (``TileqQwen3DecoderLayer(_FusedDecoderLayer, Qwen3DecoderLayer)``,
one per original class) rather than a forward bound on the instance: dynamo guards on the type and
traces a class-defined ``forward`` as it traces transformers' own (``torch.compile(fullgraph=True)``
sees no break), ``isinstance(layer, Qwen3DecoderLayer)`` stays true so transformers' output
capture hooks (``output_hidden_states``; ``output_attentions`` through the attention module, which
is still called as a module) and ``GradientCheckpointingLayer.__call__`` keep working, ``generate``
only ever calls the model, and ``unfuse_decoder_`` restores ``__class__``. The fused attention and
MLP modules still work on their own (``layer.mlp(x)``, ``layer.self_attn(hidden_states, ...)``).

Eagerly the fused path calls tileq's functions directly (a dispatcher round trip per call is host
time); under ``torch.compile`` it goes through ``torch.ops.tileq.linear`` and the two ops defined
here, ``tileq::rmsnorm_quantize``, ``tileq::add_rmsnorm_quantize`` and ``tileq::silu_mul_quantize``,
and ``tileq::qk_norm_rope[_cache]`` / ``tileq::decode_attention`` where those run (fake
implementations give shapes and strides), so the graph has no break.

Exactness: a merged GEMM's output column n is the same dot product over K with the same scales as
the part's column (bit-identical through the reference executor, which sums in float64; on a GPU
only the kernel's fp32 summation order may differ between an N of 1024 and of 7168). The fused
norm + quantization computes transformers' RMSNorm (``weight * (h.float() * rsqrt(mean(h.float()**2)
+ eps)).to(dtype)``) then quantizes as ``quantize_activation`` does, so it agrees with the unfused
path up to the reduction order of the mean (one rounding of a bf16 normed value can move a
quantized value by one step).

State dict: a fused model saves the merged tensors (``...self_attn.qkv_proj.weight``,
``...mlp.gate_up_proj.weight_scale``, ...), which load into a fused model of the same shape.
``unfuse_decoder_(model)`` splits them back exactly (every tensor equal to the pre-fusion one) for a
checkpoint in the per-projection layout.

Inference only: the custom ops have no autograd formulas.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from .. import settings
from . import compat
from ..activation import add_rmsnorm_quantize, silu_mul_quantize
from ..attention import decode_attention, takes as _attention_takes
from ..errors import UnsupportedError, expect
from ..nn.linear import QuantLinear
from ..ops import _quantize_activation_fake, decode_attention_op, qk_norm_rope_cache_op, qk_norm_rope_op, tileq_op
from ..qk_rope import HEAD_DIMS as _ROPE_HEAD_DIMS, qk_norm_rope
from ..quant_linear import keeps_launches

log = logging.getLogger("tileq")

@dataclass(frozen=True)
class _Family:
    """What differs between the supported decoder layers (their forwards are otherwise identical
    in transformers 5.17)."""

    prefix: str
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before the rotary embedding
    sliding: str  # how the attention passes sliding_window: "none" | "attr" (self.sliding_window)
    #              | "config" (getattr(self.config, "sliding_window", None))


_FAMILIES = {f.prefix + "DecoderLayer": f for f in (
    _Family("Llama", qk_norm=False, sliding="none"),
    _Family("Qwen2", qk_norm=False, sliding="attr"),
    _Family("Qwen3", qk_norm=True, sliding="attr"),
    _Family("Mistral", qk_norm=False, sliding="config"),
    _Family("Qwen3Moe", qk_norm=True, sliding="attr"),
)}

# A layer whose MLP is this class (transformers' name after the family prefix) fuses its attention
# half only: the experts run fused_moe, which quantizes the routed tokens itself.
_SPARSE_MLP = "SparseMoeBlock"

_MODELING_NAMES = ("apply_rotary_pos_emb", "eager_attention_forward", "ALL_ATTENTION_FUNCTIONS")


# ----------------------------------------------------------------------------- summary


@dataclass
class FuseSummary:
    """What ``fuse_decoder_`` did: the decoder layers fused (with how) and those left as they were
    (with why)."""

    fused: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    how: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"tileq fuse_decoder_: {len(self.fused)} decoder layers fused, {len(self.kept)} left as they were"]
        by_how: dict[str, list[str]] = {}
        for name in self.fused:
            by_how.setdefault(self.how.get(name, ""), []).append(name)
        for how, names in by_how.items():
            lines.append(f"  fused {_names(names)}: {how}")
        for name, why in self.kept:
            lines.append(f"  kept {name}: {why}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ... {names[-1]} ({len(names)})"


# ----------------------------------------------------------------------------- merging QuantLinears


def _config_key(config):
    # Configs equal up to skip_modules (which only steers quantize_) serve layers identically.
    return type(config), replace(config, skip_modules=())


def merge_refusal(layers, names) -> str | None:
    """Why ``layers`` (in output order, named ``names``) cannot be one QuantLinear, or None."""
    for layer, name in zip(layers, names):
        if not isinstance(layer, QuantLinear):
            return f"projections not QuantLinear ({name} is {type(layer).__name__})"
    first, name0 = layers[0], names[0]
    for layer, name in zip(layers[1:], names[1:]):
        if _config_key(layer.config) != _config_key(first.config):
            return (f"mixed configs: {name0} is {first.config.describe()}, {name} is "
                    f"{layer.config.describe()}")
        if layer.in_features != first.in_features:
            return f"{name0} has {first.in_features} inputs, {name} {layer.in_features}"
        if layer.dtype != first.dtype:
            return f"{name0} outputs {first.dtype}, {name} {layer.dtype}"
        if layer.weight.device != first.weight.device:
            return f"{name0} is on {first.weight.device}, {name} on {layer.weight.device}"
    gn = first.config.group_n if first.config.weight_granularity == "group" else 1
    if gn > 1:
        # A 128 x 128 block scale covers 128 output rows: a part whose N is not a multiple of 128
        # would share its last block with the next part's first rows. The last part may be partial
        # (its partial block stays the merged weight's last one).
        for layer, name in zip(layers[:-1], names[:-1]):
            if layer.out_features % gn:
                return (f"{first.config.name} scales {gn}x{gn} blocks: {name} has N={layer.out_features}, "
                        f"not a multiple of {gn}")
    tp = [getattr(layer, "tp_info", None) for layer in layers]
    if any(t is not None for t in tp):
        # Per rank, a merge of column-wise shards is the rank's own q/k/v (gate/up) rows: its
        # output is local like theirs. Any other style would lose its forward transforms.
        bad = [n for n, t in zip(names, tp) if t is None or t.spec.style != "colwise"]
        if bad:
            return f"tensor-parallel {', '.join(bad)}: only 'colwise' shards merge per rank"
    scales = [layer.input_scale for layer in layers]
    if any(s is None for s in scales) and not all(s is None for s in scales):
        static = [n for n, s in zip(names, scales) if s is not None]
        return f"static activation scale on {', '.join(static)} only"
    if scales[0] is not None and not all(torch.equal(s, scales[0]) for s in scales[1:]):
        return f"different static activation scales on {', '.join(names)}"
    return None


def merge_quant_linears(layers, names=None) -> QuantLinear:
    """One QuantLinear computing ``torch.cat([layer(x) for layer in layers], -1)``: weights, weight
    scales (per channel [N]; groups along K [Gk, N]; 128 x 128 blocks [Gk, ceil(N / 128)]) and
    biases concatenated along N (a missing bias becomes zeros when another part has one)."""
    names = names or [f"layers[{i}]" for i in range(len(layers))]
    why = merge_refusal(layers, names)
    if why is not None:
        raise UnsupportedError(expect("layers", "QuantLinear layers that can be merged", why))
    first = layers[0]
    axis = 0 if first.weight_scale.dim() == 1 else 1
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat([layer.bias if layer.bias is not None else
                          torch.zeros(layer.out_features, dtype=torch.float32, device=layer.weight.device)
                          for layer in layers])
    merged = QuantLinear.from_quantized(
        # Same config, same storage (pk_int4 bytes or prepacked words): rows concatenate as they are.
        torch.cat([layer.weight for layer in layers], 0),
        torch.cat([layer.weight_scale for layer in layers], axis),
        config=first.config, bias=bias,
        input_scale=None if first.input_scale is None else first.input_scale.clone(),
        in_features=first.in_features, dtype=first.dtype)
    if getattr(first, "tp_info", None) is not None:  # tensor-parallel shards: the parts' for the split
        merged.tp_parts = tuple(layer.tp_info for layer in layers)
    return merged


def split_quant_linear(merged: QuantLinear, sizes, has_bias) -> list[QuantLinear]:
    """The inverse of ``merge_quant_linears``: parts of ``sizes`` output features (fresh tensors)."""
    config = merged.config
    if merged.weight_scale.dim() == 1:
        scales = merged.weight_scale.split(list(sizes), 0)
    elif config.group_n == 1:
        scales = merged.weight_scale.split(list(sizes), 1)
    else:
        scales = merged.weight_scale.split([math.ceil(n / config.group_n) for n in sizes], 1)
    weights = merged.weight.split(list(sizes), 0)
    biases = merged.bias.split(list(sizes)) if merged.bias is not None else [None] * len(sizes)
    parts = []
    for w, s, b, hb in zip(weights, scales, biases, has_bias):
        parts.append(QuantLinear.from_quantized(
            w.clone(), s.contiguous().clone(), config=config, bias=b.clone() if hb else None,
            input_scale=None if merged.input_scale is None else merged.input_scale.clone(),
            in_features=merged.in_features, dtype=merged.dtype))
    for part, info in zip(parts, getattr(merged, "tp_parts", ())):  # tensor-parallel shards
        part.tp_info = info
    return parts


def unfused_layers(model: nn.Module) -> tuple[dict[str, QuantLinear], set[str]]:
    """(every QuantLinear of ``model`` by its name in the standard, unfused layout, the names of
    the merged layers it split): a fused decoder's ``qkv_proj`` / ``gate_up_proj`` become fresh
    ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj`` layers; the model is not
    modified (``save_pretrained`` writes checkpoints in the layout every loader knows)."""
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out, merged = {}, set()
    for name, mod in model.named_modules():
        if not isinstance(mod, QuantLinear):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if leaf in parts and hasattr(parent, "_tileq_split"):
            split = split_quant_linear(mod, parent._tileq_split, parent._tileq_bias)
            for part, layer in zip(parts[leaf], split):
                out[f"{parent_name}.{part}" if parent_name else part] = layer
            merged.add(name)
        else:
            out[name] = mod
    return out, merged


# ----------------------------------------------------------------------------- the fused steps


@tileq_op("rmsnorm_quantize", checks=True)
def rmsnorm_quantize_op(x: Tensor, weight: Tensor, eps: float, dtype: str, granularity: str, group_k: int,
                        preshuffled: bool) -> tuple[Tensor, Tensor]:
    """``add_rmsnorm_quantize(x, None, ...)``'s (q, s): RMSNorm then activation quantization."""
    q, s, _ = add_rmsnorm_quantize(x, None, weight, eps, dtype, granularity=granularity, group_k=group_k,
                                   preshuffled=preshuffled)
    return q, s


@rmsnorm_quantize_op.register_fake
def _rmsnorm_quantize_fake(x, weight, eps, dtype, granularity, group_k, preshuffled):
    return _quantize_activation_fake(x, dtype, granularity, group_k, None, preshuffled)


@tileq_op("add_rmsnorm_quantize", checks=True)
def add_rmsnorm_quantize_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float, dtype: str,
                            granularity: str, group_k: int, preshuffled: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``add_rmsnorm_quantize(x, residual, ...)``: (q, s, x + residual)."""
    q, s, h = add_rmsnorm_quantize(x, residual, weight, eps, dtype, granularity=granularity, group_k=group_k,
                                   preshuffled=preshuffled)
    if h is x or h is residual:  # a custom op's output may not alias an input
        h = h.clone()
    return q, s, h


@add_rmsnorm_quantize_op.register_fake
def _add_rmsnorm_quantize_fake(x, residual, weight, eps, dtype, granularity, group_k, preshuffled):
    q, s = _quantize_activation_fake(x, dtype, granularity, group_k, None, preshuffled)
    return q, s, x.new_empty(x.shape)


@tileq_op("silu_mul_quantize", checks=True)
def silu_mul_quantize_op(gate_up: Tensor, dtype: str, granularity: str, group_k: int,
                         preshuffled: bool) -> tuple[Tensor, Tensor]:
    """``silu_mul_quantize(gate_up, ...)``'s (q, s): silu(gate) * up, quantized."""
    return silu_mul_quantize(gate_up, dtype, granularity=granularity, group_k=group_k, preshuffled=preshuffled)


@silu_mul_quantize_op.register_fake
def _silu_mul_quantize_fake(gate_up, dtype, granularity, group_k, preshuffled):
    half = gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
    return _quantize_activation_fake(half, dtype, granularity, group_k, None, preshuffled)


def _is_silu(act: nn.Module) -> bool:
    """transformers' ``ACT2FN['silu']`` / ``'swish'`` (F.silu), the function the fused kernel computes."""
    return type(act) is nn.SiLU or (type(act).__name__ == "SiLUActivation"
                                     and type(act).__module__ == "transformers.activations")


def _silu_fuses(mlp: nn.Module, gate_up: Tensor) -> bool:
    """Whether ``act_fn(gate) * up`` and down_proj's activation quantization run as one
    ``silu_mul_quantize`` call: a SiLU MLP whose down_proj quantizes activations dynamically."""
    down = mlp.down_proj
    return (isinstance(down, QuantLinear) and _prequantizes(down) and _is_silu(mlp.act_fn)
            and gate_up.dtype in (torch.bfloat16, torch.float16))


def silu_mul_quantize_for(gate_up: Tensor, layer: QuantLinear) -> tuple[Tensor, Tensor]:
    """``act_fn(gate) * up`` quantized as ``layer``'s forward would quantize it: (q, s) in one call."""
    spec = layer.spec
    if torch.compiler.is_compiling():
        return silu_mul_quantize_op(gate_up, spec.act_dtype, spec.act_granularity, spec.group_k, False)
    return silu_mul_quantize(gate_up, spec.act_dtype, granularity=spec.act_granularity, group_k=spec.group_k)


def _prequantizes(layer: QuantLinear) -> bool:
    """Whether the norm before ``layer`` quantizes its output for it (dynamic activation scales)."""
    return layer.spec.act_dtype is not None and layer.input_scale is None


def _fuses(norm: nn.Module, layer: QuantLinear, x: Tensor, residual: Tensor | None = None) -> bool:
    """Whether ``norm`` (+ the residual add) and ``layer``'s quantization run as one call on ``x``:
    dynamic activation scales, and the norm weight (and residual) in x's dtype as
    ``add_rmsnorm_quantize`` requires (a model keeping its norms in fp32 takes the unfused path,
    where transformers' RMSNorm promotes). Under torch.compile these are guards, not per-call work."""
    return (_prequantizes(layer) and norm.weight.dtype == x.dtype
            and (residual is None or residual.dtype == x.dtype))


def rmsnorm_quantize(x: Tensor, norm: nn.Module, layer: QuantLinear) -> tuple[Tensor, Tensor]:
    """``norm(x)`` quantized as ``layer``'s forward would quantize it: (q, s) in one call."""
    spec = layer.spec
    if torch.compiler.is_compiling():
        return rmsnorm_quantize_op(x, norm.weight, float(norm.variance_epsilon), spec.act_dtype,
                                   spec.act_granularity, spec.group_k, False)
    q, s, _ = add_rmsnorm_quantize(x, None, norm.weight, norm.variance_epsilon, spec.act_dtype,
                                   granularity=spec.act_granularity, group_k=spec.group_k)
    return q, s


def add_rmsnorm_quantize_for(x: Tensor, residual: Tensor, norm: nn.Module,
                             layer: QuantLinear) -> tuple[Tensor, Tensor, Tensor]:
    """(q, s, h): h = x + residual, and ``norm(h)`` quantized as ``layer``'s forward would."""
    spec = layer.spec
    if torch.compiler.is_compiling():
        return add_rmsnorm_quantize_op(x, residual, norm.weight, float(norm.variance_epsilon), spec.act_dtype,
                                       spec.act_granularity, spec.group_k, False)
    return add_rmsnorm_quantize(x, residual, norm.weight, norm.variance_epsilon, spec.act_dtype,
                                granularity=spec.act_granularity, group_k=spec.group_k)


def linear_prequantized(layer: QuantLinear, q: Tensor, s: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``layer``'s GEMM on an activation already quantized for it (what ``quant_linear_forward``
    does after its quantization step): dequantization, bias and the cast fused."""
    y = layer.forward_quantized(q, s, out_dtype)
    reduce = layer.__dict__.get("tp_reduce")  # a row-wise tensor-parallel shard: the ranks' sum (+ bias)
    return y if reduce is None else reduce(y)


# ----------------------------------------------------------------------------- fused modules


@torch.compiler.assume_constant_result
def _qk_rope_switch() -> int:
    """TILEQ_QK_ROPE as 0 (off), 1 (eager code: the default) or 2 (eager and compiled code); a
    compiled graph reads it once while tracing and keeps the answer (torch 2.11's dynamo cannot
    trace the settings' environment lookup)."""
    value = settings.current().qk_rope
    return 1 if value is None else 2 * int(value)


def _rope_fuses(attn: nn.Module, qkv: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether the fused attention prepares q and k with ``qk_norm_rope`` (one launch) instead of
    transformers' operations: calls on a GPU (or Triton's interpreter), eager ones unless
    TILEQ_QK_ROPE=0, compiled ones (through ``torch.ops.tileq.qk_norm_rope[_cache]``) with
    TILEQ_QK_ROPE=1 (opt-in: graphed it is faster, compiled without a graph slower, on an H100;
    docs/performance.md section 7); 16-bit activations with cos / sin and the q/k norms' weights
    in the same dtype, the norms' epsilons equal, k and v of one width, a head dimension the kernel
    holds in registers."""
    if torch.compiler.is_compiling():
        if _qk_rope_switch() < 2:
            return False
    elif not _qk_rope_switch():
        return False
    if not keeps_launches(qkv):
        return False
    dtype, split, d = qkv.dtype, attn._tileq_split, attn.head_dim
    if (dtype not in (torch.bfloat16, torch.float16) or qkv.dim() != 3 or d not in _ROPE_HEAD_DIMS
            or split[1] != split[2] or cos.dtype != dtype or sin.dtype != dtype or cos.dim() != 3
            or cos.shape[-1] != d):
        return False
    if attn._tileq_qk_norm:
        qn, kn = attn.q_norm, attn.k_norm
        return (qn.weight.dtype == dtype and kn.weight.dtype == dtype
                and qn.variance_epsilon == kn.variance_epsilon)
    return True


def _static_cache_of(cache, idx: int, qkv: Tensor, kv_heads: int, d: int):
    """(keys, values, length) of layer ``idx`` of a transformers ``StaticCache`` (the class itself,
    5.17) that ``qk_norm_rope`` may write in place of ``StaticLayer.update``: no offloading, the
    layer made and initialized (its first update, the prefill, made its tensors), its tensors of
    this call's batch, heads, head size, dtype and device; else None (the cache's own update runs)."""
    cls = type(cache)
    if cls.__name__ != "StaticCache" or cls.__module__ != "transformers.cache_utils" or cache.offloading:
        return None
    layers = cache.layers
    if idx >= len(layers):
        return None
    layer = layers[idx]
    lcls = type(layer)
    if lcls.__name__ != "StaticLayer" or lcls.__module__ != "transformers.cache_utils" or not layer.is_initialized:
        return None
    keys, values, length = layer.keys, layer.values, layer.cumulative_length
    want = (qkv.shape[0], kv_heads)
    for t in (keys, values):
        if (t.dtype != qkv.dtype or t.device != qkv.device or t.dim() != 4 or tuple(t.shape[:2]) != want
                or t.shape[3] != d or not t.is_contiguous()):
            return None
    if values.shape != keys.shape or length.dtype != torch.int64 or length.device != qkv.device:
        return None
    return keys, values, length


def _prepare_qk(attn: nn.Module, qkv: Tensor, cos: Tensor, sin: Tensor, kv_heads: int, static):
    """(q, k, v) from ``qk_norm_rope``: v is the cache's values where ``static`` (the layer's
    (keys, values, length)) took k and v, else None. Compiled code calls the custom ops (inductor
    launches the kernel); eager code the function (its per-signature launch, no dispatcher)."""
    q_heads = attn._tileq_split[0] // attn.head_dim
    qw, kw = (attn.q_norm.weight, attn.k_norm.weight) if attn._tileq_qk_norm else (None, None)
    eps = attn.q_norm.variance_epsilon if attn._tileq_qk_norm else 0.0
    if torch.compiler.is_compiling():
        if static is None:
            return (*qk_norm_rope_op(qkv, cos, sin, qw, kw, q_heads, kv_heads, eps), None)
        return qk_norm_rope_cache_op(qkv, cos, sin, qw, kw, *static, q_heads, kv_heads, eps), static[0], static[1]
    out = qk_norm_rope(qkv, cos, sin, q_heads=q_heads, kv_heads=kv_heads, q_weight=qw, k_weight=kw, eps=eps,
                       cache=static)
    return out if static is not None else (*out, None)


@torch.compiler.assume_constant_result
def _decode_attn_switch() -> bool:
    """TILEQ_DECODE_ATTN (on unless 0); a compiled graph reads it once while tracing and keeps the
    answer, as ``_qk_rope_switch``."""
    return settings.current().decode_attn


def _transformers_sdpa():
    """transformers' own ``sdpa_attention_forward`` (a fused attention class keeps it: the function
    whose math ``decode_attention`` reproduces), or None."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return None
    return sdpa_attention_forward


# Keyword arguments of an attention call that change its math where a function reads them (a
# position bias, logit soft-capping, attention sinks): the call keeps transformers' function.
_MATH_KWARGS = ("position_bias", "softcap", "s_aux", "sinks")


def _attention_fuses(attn: nn.Module, interface, query: Tensor, keys: Tensor, values: Tensor, mask, cache,
                     kwargs: dict) -> bool:
    """Whether the fused attention runs ``tileq.attention.decode_attention`` (eagerly; compiled,
    ``torch.ops.tileq.decode_attention``) instead of transformers' ``interface``, which it then
    computes exactly (up to rounding; no attention weights, as sdpa returns none):

    * TILEQ_DECODE_ATTN is not 0, the module is not training (no dropout; the op has no autograd
      formula), no attention weights are asked for (``output_attentions``) and no keyword that
      changes the math is passed (``_MATH_KWARGS``). ``sliding_window`` may be: neither function
      below reads it, the mask carries the window (``create_sliding_window_causal_mask``);
    * one query token, on a GPU or Triton's interpreter (``keeps_launches``);
    * ``cache`` keeps its tensors' shapes from step to step (transformers' ``is_compileable``: a
      ``StaticCache`` and its kin). A ``DynamicCache`` grows by a position every step, so each of
      its steps would be a new launch signature (validation, a new launch, Triton's own launch
      path) in every layer: it keeps transformers' function;
    * the function is transformers' own ``sdpa_attention_forward`` (with a ``StaticCache``, 5.17's
      ``sdpa_mask`` passes a bool [B, 1, 1, L] mask at decode, True up to the current position), or
      the model's ``eager_attention_forward`` without a mask (eager adds its mask to the scores: its
      decode masks are float 0 / dtype-min tensors, which keep transformers' function);
    * ``decode_attention`` takes the tensors and the mask (``attention.takes``: one query token,
      16-bit, the head sizes and grouping its kernel holds, a bool [B or 1, 1, 1, L] mask or None).
    Under torch.compile these are guards on the traced call, not per-call work."""
    if (not _decode_attn_switch() or attn.training or kwargs.get("output_attentions")
            or getattr(attn.config, "output_attentions", False)):
        return False
    if any(kwargs.get(k) is not None for k in _MATH_KWARGS) or not getattr(cache, "is_compileable", False):
        return False
    if interface is not attn._tileq_sdpa and (interface is not attn._tileq_modeling.eager_attention_forward
                                              or mask is not None):
        return False
    return _attention_takes(query, keys, values, mask) and keeps_launches(query)


def _decode_attention(query: Tensor, keys: Tensor, values: Tensor, mask, scaling) -> Tensor:
    """[B, 1, Hq, D] from ``decode_attention``: compiled code calls the custom op (inductor launches
    the kernels), eager code the function (its per-signature launch, no dispatcher)."""
    if torch.compiler.is_compiling():
        return decode_attention_op(query, keys, values, mask, float(scaling))
    return decode_attention(query, keys, values, scaling=scaling, mask=mask)


class _FusedAttention:
    """Mixin over a transformers attention class whose q/k/v projections are one ``qkv_proj``.

    ``forward`` is the pinned transformers attention forward with the three projections replaced
    by one GEMM and a split. ``qkv=`` passes that GEMM's output when the caller ran it (on an
    activation it quantized together with the norm); otherwise ``qkv_proj(hidden_states)`` runs.
    """

    _tileq_fused = True
    _tileq_modeling = None  # the transformers modeling module (class attribute, set per subclass)
    _tileq_qk_norm = False
    _tileq_sliding = "none"
    _tileq_sdpa = None  # transformers' sdpa_attention_forward (a staticmethod, set per subclass)
    _tileq_update_kwargs = False  # Cache.update takes the call's kwargs (compat.update_takes_kwargs)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, *,
                qkv=None, past_key_values=None, **kwargs):
        # The KV cache by either name (compat.cache_argument: 'cache' from transformers 5.24 on)
        cache = past_key_values if cache is None else cache
        if qkv is None:
            qkv = self.qkv_proj(hidden_states)
        modeling = self._tileq_modeling
        input_shape = qkv.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        cos, sin = position_embeddings
        written = False  # k and v already in the cache
        if _rope_fuses(self, qkv, cos, sin):
            # One kernel for the q/k norms and the rotation, writing k and v into a static cache as
            # StaticLayer.update would.
            kv_heads = self._tileq_split[1] // self.head_dim
            static = _static_cache_of(cache, self.layer_idx, qkv, kv_heads, self.head_dim)
            query_states, key_states, value_states = _prepare_qk(self, qkv, cos, sin, kv_heads, static)
            written = static is not None
        else:
            q, k, _ = qkv.split(self._tileq_split, dim=-1)
            if self._tileq_qk_norm:
                query_states = self.q_norm(q.view(hidden_shape)).transpose(1, 2)
                key_states = self.k_norm(k.view(hidden_shape)).transpose(1, 2)
            else:
                query_states = q.view(hidden_shape).transpose(1, 2)
                key_states = k.view(hidden_shape).transpose(1, 2)
            query_states, key_states = modeling.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if not written:
            value_states = qkv[..., qkv.shape[-1] - self._tileq_split[2]:].view(hidden_shape).transpose(1, 2)
            if cache is not None:
                if self._tileq_update_kwargs:
                    key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
                else:
                    key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        attention_interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling.eager_attention_forward)
        if self._tileq_sliding == "attr":
            kwargs["sliding_window"] = self.sliding_window
        elif self._tileq_sliding == "config":
            kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)

        if _attention_fuses(self, attention_interface, query_states, key_states, value_states, attention_mask,
                            cache, kwargs):
            # One query token: tileq's split-KV kernel computes what the function would.
            attn_output = _decode_attention(query_states, key_states, value_states, attention_mask, self.scaling)
            attn_weights = None
        else:
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                **kwargs,
            )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class _FusedMLP:
    """Mixin over a transformers MLP class whose gate/up projections are one ``gate_up_proj``."""

    _tileq_fused = True

    def forward(self, x):
        return self.act_down(self.gate_up_proj(x))

    def act_down(self, gate_up: Tensor) -> Tensor:
        """down_proj(act_fn(gate) * up) from the merged gate_up output; with a dynamically
        quantized down_proj the SiLU, the product and the quantization are one kernel."""
        if _silu_fuses(self, gate_up):
            q, s = silu_mul_quantize_for(gate_up, self.down_proj)
            return linear_prequantized(self.down_proj, q, s, gate_up.dtype)
        gate, up = gate_up.split(self._tileq_split, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class _FusedDecoderLayer:
    """Mixin over a transformers decoder layer: the pinned forward with merged GEMMs and, for
    dynamically quantized activations, the norms fused with the quantization (module docstring)."""

    _tileq_fused = True

    def attention(self, hidden_states, attention_mask, position_ids, cache, use_cache,
                  position_embeddings, **kwargs):
        """input_layernorm (fused with the merged q/k/v GEMM's quantization where it can) and self
        attention: the attention half of the pinned forward, before its residual add."""
        attn = self.self_attn
        qkv_proj = attn.qkv_proj
        if _fuses(self.input_layernorm, qkv_proj, hidden_states):
            q, s = rmsnorm_quantize(hidden_states, self.input_layernorm, qkv_proj)
            qkv = linear_prequantized(qkv_proj, q, s, hidden_states.dtype)
        else:
            qkv = qkv_proj(self.input_layernorm(hidden_states))
        # Self Attention (called as a module: transformers' output_attentions hook is on it)
        hidden_states, _ = attn(
            hidden_states=None,
            qkv=qkv,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        return hidden_states

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, *, past_key_values=None, **kwargs):
        cache = past_key_values if cache is None else cache  # either name (compat.cache_argument)
        mlp = self.mlp
        residual = hidden_states
        hidden_states = self.attention(hidden_states, attention_mask, position_ids, cache, use_cache,
                                       position_embeddings, **kwargs)

        # Fully Connected
        gate_up_proj = mlp.gate_up_proj
        if _fuses(self.post_attention_layernorm, gate_up_proj, hidden_states, residual):
            q, s, residual = add_rmsnorm_quantize_for(hidden_states, residual, self.post_attention_layernorm,
                                                      gate_up_proj)
            gate_up = linear_prequantized(gate_up_proj, q, s, residual.dtype)
        else:
            residual = residual + hidden_states
            gate_up = gate_up_proj(self.post_attention_layernorm(residual))
        hidden_states = mlp.act_down(gate_up)
        hidden_states = residual + hidden_states
        return hidden_states


class _FusedMoeDecoderLayer(_FusedDecoderLayer):
    """The same for a decoder layer whose MLP is a sparse MoE block: the attention half fused, the
    post-attention norm and the block as transformers runs them (the router reads the normalized
    bf16 hidden state; the experts quantize their routed tokens in ``fused_moe``)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, *, past_key_values=None, **kwargs):
        cache = past_key_values if cache is None else cache  # either name (compat.cache_argument)
        residual = hidden_states
        hidden_states = self.attention(hidden_states, attention_mask, position_ids, cache, use_cache,
                                       position_embeddings, **kwargs)
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


_CLASSES: dict = {}


def _fused_class(orig: type, mixin: type, **attrs) -> type:
    """The subclass (mixin, orig), made once per original class; registered in this module under
    its name so pickling by reference works in a process that fused the same class."""
    cls = _CLASSES.get((orig, mixin))
    if cls is None:
        name = f"Tileq{orig.__name__}"
        cls = type(name, (mixin, orig), {"__module__": __name__, "__qualname__": name,
                                         "_tileq_original_class": orig, **attrs})
        _CLASSES[(orig, mixin)] = cls
        globals().setdefault(name, cls)
    return cls


# ----------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Plan:
    family: _Family
    modeling: object
    sparse_mlp: bool = False  # an MoE layer: q/k/v merged and the input norm fused, the MLP as it is


def _looks_like_decoder_layer(mod: nn.Module) -> bool:
    if type(mod).__name__.endswith("DecoderLayer"):
        return True
    return all(hasattr(mod, a) for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))


def _plan_layer(layer: nn.Module) -> tuple[_Plan | None, str]:
    """(plan, "") or (None, why the layer stays as it is). Reads, never modifies."""
    cls = type(layer)
    if getattr(cls, "_tileq_fused", False):
        return None, "already fused"
    fam = _FAMILIES.get(cls.__name__)
    modeling = sys.modules.get(cls.__module__)
    if fam is None or modeling is None or getattr(modeling, cls.__name__, None) is not cls:
        known = ", ".join(_FAMILIES)
        return None, f"unknown layer class {cls.__module__}.{cls.__name__} (fuse_decoder_ knows transformers' {known})"
    missing = [n for n in _MODELING_NAMES if not hasattr(modeling, n)]
    if missing:
        return None, f"{cls.__module__} has no {', '.join(missing)}"
    if "forward" in vars(layer):
        return None, "forward replaced on the instance"
    sparse = type(getattr(layer, "mlp", None)) is getattr(modeling, fam.prefix + _SPARSE_MLP, None)
    mlp_kind = _SPARSE_MLP if sparse else "MLP"
    parts = {"self_attn": (getattr(layer, "self_attn", None), "Attention"),
             "mlp": (getattr(layer, "mlp", None), mlp_kind),
             "input_layernorm": (getattr(layer, "input_layernorm", None), "RMSNorm"),
             "post_attention_layernorm": (getattr(layer, "post_attention_layernorm", None), "RMSNorm")}
    if fam.qk_norm:
        attn = parts["self_attn"][0]
        parts["self_attn.q_norm"] = (getattr(attn, "q_norm", None), "RMSNorm")
        parts["self_attn.k_norm"] = (getattr(attn, "k_norm", None), "RMSNorm")
    for where, (mod, kind) in parts.items():
        want = getattr(modeling, fam.prefix + kind, None)
        if type(mod) is not want:
            return None, f"{where} is {type(mod).__name__}, not transformers' {fam.prefix}{kind}"
        if "forward" in vars(mod):
            return None, f"{where}: forward replaced on the instance"
    attn, mlp = layer.self_attn, layer.mlp
    for norm in ("input_layernorm", "post_attention_layernorm"):
        n = getattr(layer, norm)
        if not isinstance(getattr(n, "weight", None), Tensor) or not isinstance(
                getattr(n, "variance_epsilon", None), (float, int)):
            return None, f"{norm} has no weight tensor and float variance_epsilon"
    qkv_names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    qkv = [getattr(attn, n.rsplit(".", 1)[1], None) for n in qkv_names]
    gu_names = ["mlp.gate_proj", "mlp.up_proj"]
    gu = [getattr(mlp, n.rsplit(".", 1)[1], None) for n in gu_names]
    merges = ((qkv, qkv_names),) if sparse else ((qkv, qkv_names), (gu, gu_names))
    for layers, names in merges:
        why = merge_refusal(layers, names)
        if why is not None:
            return None, why
    head_dim = attn.head_dim
    for proj, name in zip(qkv, qkv_names):
        if proj.out_features % head_dim:
            return None, f"{name} has N={proj.out_features}, not a multiple of head_dim={head_dim}"
    if not sparse and gu[0].out_features != gu[1].out_features:
        return None, f"gate_proj has N={gu[0].out_features}, up_proj {gu[1].out_features}"
    return _Plan(fam, modeling, sparse), ""


def _how(layer: nn.Module) -> str:
    def norm_words(norm: nn.Module, proj: QuantLinear) -> str:
        if proj.spec.act_dtype is None:
            return f"unchanged (weight-only {proj.config.name})"
        if proj.input_scale is not None:
            return "unchanged (static activation scale: the merged layer quantizes per tensor)"
        if norm.weight.dtype != proj.dtype:
            return f"unchanged (norm weight in {norm.weight.dtype}, activations in {proj.dtype})"
        spec = proj.spec
        gran = "per-token" if spec.act_granularity == "row" else f"1x{spec.group_k}-group"
        return f"fused with {spec.act_dtype} {gran} quantization"

    a = norm_words(layer.input_layernorm, layer.self_attn.qkv_proj)
    if isinstance(layer, _FusedMoeDecoderLayer):
        return (f"q/k/v GEMMs merged; input_layernorm {a}; the MoE block unchanged (its experts quantize "
                "their routed tokens)")
    b = norm_words(layer.post_attention_layernorm, layer.mlp.gate_up_proj)
    what = "q/k/v and gate/up GEMMs merged"
    if a == b:
        return f"{what}; input_layernorm and residual add + post_attention_layernorm {a}"
    return f"{what}; input_layernorm {a}; residual add + post_attention_layernorm {b}"


def _convert(layer: nn.Module, plan: _Plan) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    # Each (module, parts, their names, the merged leaf); an MoE layer's block is left as it is.
    groups = [(attn, [attn.q_proj, attn.k_proj, attn.v_proj], ("q_proj", "k_proj", "v_proj"), "qkv_proj")]
    if not plan.sparse_mlp:
        groups.append((mlp, [mlp.gate_proj, mlp.up_proj], ("gate_proj", "up_proj"), "gate_up_proj"))
    # Build every merged layer before touching the modules: a failure leaves the layer as it was.
    merged = [merge_quant_linears(parts, list(names)) for _, parts, names, _ in groups]
    for m, (_, parts, _, leaf) in zip(merged, groups):
        if parts[0].qualified_name:  # the merged layer's name in the model, for its errors
            m.qualified_name = f"{parts[0].qualified_name.rpartition('.')[0]}.{leaf}".lstrip(".")
    fam = plan.family
    classes = [_fused_class(type(attn), _FusedAttention, _tileq_modeling=plan.modeling,
                            _tileq_qk_norm=fam.qk_norm, _tileq_sliding=fam.sliding,
                            _tileq_sdpa=staticmethod(_transformers_sdpa()),
                            _tileq_update_kwargs=compat.update_takes_kwargs())]
    if not plan.sparse_mlp:
        classes.append(_fused_class(type(mlp), _FusedMLP))
    layer_cls = _fused_class(type(layer), _FusedMoeDecoderLayer if plan.sparse_mlp else _FusedDecoderLayer)
    for m, (mod, parts, names, leaf), cls in zip(merged, groups, classes):
        mod._tileq_split = tuple(p.out_features for p in parts)
        mod._tileq_bias = tuple(p.bias is not None for p in parts)
        _splice(mod, names, [(leaf, m)])
        mod.__class__ = cls
    layer.__class__ = layer_cls


def _splice(mod: nn.Module, old: tuple, new: list) -> None:
    """Replace the children ``old`` by ``new`` (name, module) pairs at the first one's place, so
    the state dict keeps transformers' order."""
    children = {}
    for name, child in mod._modules.items():
        if name == old[0]:
            children.update(new)
        elif name not in old:
            children[name] = child
    mod._modules.clear()
    mod._modules.update(children)


# ----------------------------------------------------------------------------- public


def fuse_decoder_(model: nn.Module) -> FuseSummary:
    """Fuse every supported decoder layer of ``model`` in place (module docstring) and say what
    was done. Every layer is checked before any is converted; a layer that cannot be fused is
    listed with the reason and left exactly as it was."""
    if not isinstance(model, nn.Module):
        raise UnsupportedError(expect("model", "a torch.nn.Module", type(model).__name__))
    compat.require_supported("fuse_decoder_")
    summary = FuseSummary()
    plans = []
    for name, mod in model.named_modules():
        if _looks_like_decoder_layer(mod):
            plan, why = _plan_layer(mod)
            if plan is None:
                summary.kept.append((name, why))
            else:
                plans.append((name, mod, plan))
    if not plans and not summary.kept:
        summary.notes.append("no decoder layers found (modules with self_attn, mlp, input_layernorm and "
                             "post_attention_layernorm)")
    for name, mod, plan in plans:
        try:
            _convert(mod, plan)
        except Exception as e:  # never leave the model half-converted: this layer stays as it was
            summary.kept.append((name, f"merging failed: {type(e).__name__}: {e}"))
            continue
        summary.fused.append(name)
        summary.how[name] = _how(mod)
    log.info("%s", summary)
    return summary


def unfuse_decoder_(model: nn.Module) -> list[str]:
    """Undo ``fuse_decoder_`` in place: split the merged projections back into q/k/v and gate/up
    QuantLinears (tensors equal to the pre-fusion ones) and restore the original classes, so the
    state dict has the per-projection layout again. Returns the names of the layers restored."""
    if not isinstance(model, nn.Module):
        raise UnsupportedError(expect("model", "a torch.nn.Module", type(model).__name__))
    restored = []
    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, _FusedDecoderLayer)]:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = split_quant_linear(attn.qkv_proj, attn._tileq_split, attn._tileq_bias)
        _splice(attn, ("qkv_proj",), [("q_proj", q), ("k_proj", k), ("v_proj", v)])
        del attn._tileq_split, attn._tileq_bias
        attn.__class__ = type(attn)._tileq_original_class
        if isinstance(mlp, _FusedMLP):  # an MoE layer's block was left as it was
            gate, up = split_quant_linear(mlp.gate_up_proj, mlp._tileq_split, mlp._tileq_bias)
            _splice(mlp, ("gate_up_proj",), [("gate_proj", gate), ("up_proj", up)])
            del mlp._tileq_split, mlp._tileq_bias
            mlp.__class__ = type(mlp)._tileq_original_class
        layer.__class__ = type(layer)._tileq_original_class
        restored.append(name)
    return restored
