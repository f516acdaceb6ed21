"""tileq's operations as torch custom ops (``torch.ops.tileq.*``): what ``torch.compile`` traces
(no graph break: each op is one node with a fake implementation giving its output's shape, dtype
and strides, or its kernels' launches, below) and what CUDA graphs capture.

    torch.ops.tileq.linear(x, w, x_scale, w_scale, bias, scheme, out_dtype, group_k, group_n, w_int4_k)
    torch.ops.tileq.quantize_activation(x, dtype, granularity, group_k, scale, preshuffled)
    torch.ops.tileq.quant_linear(x, weight, weight_scale, bias, input_scale, layer)
    torch.ops.tileq.qk_norm_rope(qkv, cos, sin, q_weight, k_weight, q_heads, kv_heads, eps)
    torch.ops.tileq.qk_norm_rope_cache(qkv, cos, sin, q_weight, k_weight, keys, values, length, q_heads,
                                       kv_heads, eps)
    torch.ops.tileq.decode_attention(q, keys, values, mask, scaling)

The implementations are the public functions (``tileq.linear``, ``tileq.quantize_activation``,
``tileq.qk_rope.qk_norm_rope``, ``tileq.attention.decode_attention``, each with its per-signature
launch cache) and, for ``quant_linear``, a runner per call signature
(``quant_linear.quant_linear_cached``: after a signature's second call no validation, two
launches). ``QuantLinear`` calls them directly
when not compiling: a dispatcher round trip per layer would add host time to every eager decode
step (QuACK keeps per-call host cost low the same way).

Under ``torch.compile`` each op is called through its inline twin ``tileq::<name>_inline`` (a
``torch.library.triton_op``): tracing runs the op's own code on fake tensors with every kernel
launch turned into torch's ``wrap_triton`` node, so inductor launches tileq's kernels from its
generated code and no tileq Python runs per call. Whether its launches can be carried that way
the twin asks first, of the plans and the launchers they make (``tileq.tracing``; nothing is
launched or traced twice): not the Gluon kernels, whose TMA descriptors hold data pointers, nor a
launch option torch does not pass, nor a split over K summed with tile counters the caller did
not pass (``tile_counters``, which ``QuantLinear`` does: the graph would otherwise zero fresh
counters with a kernel of its own). Where they cannot, the twin calls the opaque op and the
``tileq`` logger says once per op why. ``TILEQ_INLINE_LAUNCH=0`` keeps every op opaque.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch import Tensor

from . import settings
from .activation import checks_values, quantize_activation
from .api import linear, linear_call, linear_rows
from .attention import decode_attention
from .qk_rope import qk_norm_rope
from .quant_linear import LayerRunner, quant_linear_cached, spec_of_key, weight_operand
from .tracing import launches_nothing, run_traced, untraced

log = logging.getLogger("tileq")

_QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "bf8": torch.float8_e5m2}

_LIB = torch.library.Library("tileq", "FRAGMENT")


class TileqOp:
    """``tileq::<name>``: the decorated function registered at the dispatcher as the op's CPU and
    CUDA kernel, its schema inferred from the annotations as ``torch.library.custom_op`` does.

    Not ``custom_op`` itself: its Python wrapper around every call (output aliasing checks,
    dispatch through ``backend_impl``) cost more host time per call than the tileq kernels' whole
    launch path on an H200 machine (docs/performance.md, host cost); a compiled graph calls the op
    once per layer and token. Calling the object calls the op (``torch.ops.tileq.<name>``), which
    is what dynamo traces; ``register_fake`` gives the shapes for tracing. Inference only: no
    autograd formula, as before.

    ``trace``: how a traced call runs, or why it cannot (``plain_trace``'s answer); by default the
    implementation itself, its launches plain kernels. ``checks``: its implementation quantizes
    activations, which in checking mode (TILEQ_CHECK_FINITE=1) reads their values.
    """

    def __init__(self, name: str, fn, mutates_args: tuple = (), trace=None, checks: bool = False):
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _LIB.define(name + schema)
        for key in ("CPU", "CUDA"):
            _LIB.impl(name, fn, key)
        self.name, self.impl, self.checks = name, fn, checks
        self.trace = trace or functools.partial(plain_trace, fn)
        self.op = getattr(torch.ops.tileq, name).default
        self.inline = _inline_twin(self, mutates_args)
        self.__doc__ = fn.__doc__

    def __call__(self, *args):
        # What compiled code calls: the inline twin decides at trace time (module docstring).
        return self.inline(*args)

    def register_fake(self, fake):
        torch.library.register_fake(f"tileq::{self.name}", fake, lib=_LIB)
        return fake


def _inline_twin(opaque: TileqOp, mutates_args: tuple):
    """``tileq::<name>_inline``: a triton_op over the opaque op's implementation. Called on real
    tensors it is the implementation; traced (fake tensors), it is the implementation with its
    launches traced, where its launchers say they all can be (``TileqOp.trace``), else the opaque
    op."""
    impl = opaque.impl

    @functools.wraps(impl)
    def body(*args):
        tensors = [a for a in args if isinstance(a, Tensor)]
        if not any(type(a) is not Tensor and _fake(a) for a in tensors):
            return impl(*args)
        # inductor launches user kernels on GPUs only; CPU tensors take the reference path.
        # Symbolic sizes (a dynamic graph) stay opaque too: the planner would specialize them
        # through guards.
        switches = settings.current()
        on_gpu = tensors[0].device.type == "cuda" and not switches.interpreted
        static = all(type(d) is int for t in tensors for d in t.shape)
        if on_gpu and static and switches.inline_launch:
            if opaque.checks and checks_values():
                run, why = None, "TILEQ_CHECK_FINITE=1: its checks read the values"
            else:
                run, why = opaque.trace(*args)
            if why is None:
                return run()
            _report(opaque.name, why)
        return opaque.op(*args)

    return torch.library.triton_op(f"tileq::{opaque.name}_inline", body, mutates_args=mutates_args)


def plain_trace(impl, *args, backend: str | None = None):
    """(run, why not): ``impl(*args)`` with its launches traced, for an op whose launchers are all
    plain ``@triton.jit`` kernels without launch options torch does not pass; not where it
    launches nothing (``backend``'s executor the reference, an empty input)."""
    first = next(a for a in args if isinstance(a, Tensor))
    return functools.partial(run_traced, impl, *args), launches_nothing(first, backend)


def _fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


_REPORTED: set = set()


def _report(name: str, reason: str) -> None:
    if (name, reason) not in _REPORTED:
        _REPORTED.add((name, reason))
        log.info("tileq::%s: launches not traced into the compiled graph (%s); it calls the op", name, reason)


def tileq_op(name: str, mutates_args: tuple = (), trace=None, checks: bool = False):
    """Decorator: the function becomes the kernel of op ``tileq::<name>`` (a ``TileqOp``)."""
    return lambda fn: TileqOp(name, fn, mutates_args, trace, checks)


# A layer's tile counters (``tracing.layer_tile_counters``): zeroed int32 that a split GEMM summed by
# the kernel itself counts on and puts back to zero. An argument the op mutates, so that the
# split's launch can be traced into a compiled graph (inductor writes to the layer's tensor).
_COUNTERS = ("tile_counters",)


def _linear_trace(x, w, x_scale, w_scale, bias, scheme, out_dtype, group_k, group_n, w_int4_k, tile_counters=None):
    """``linear_op``'s traced call: its GEMM's launch (``linear_call``, planned for a traced
    launch) on x's rows, as ``tileq.linear`` runs it."""
    x2, s2, lead, _ = linear_rows(x, x_scale)
    call = linear_call(x2, weight_operand(w, w_int4_k), s2, w_scale, scheme=scheme, out_dtype=out_dtype, bias=bias,
                       group_k=group_k, group_n=group_n or None, traced=True)
    if call is None:
        return None, "no launch"

    def run():
        y = call.run(x2, w, s2, w_scale, bias, None, None)
        return y.reshape(*lead, y.shape[-1])

    return functools.partial(run_traced, run, tile_counters=tile_counters), untraced(call, x.device, tile_counters)


@tileq_op("linear", mutates_args=_COUNTERS, trace=_linear_trace)
def linear_op(x: Tensor, w: Tensor, x_scale: Tensor | None, w_scale: Tensor | None, bias: Tensor | None,
              scheme: str, out_dtype: torch.dtype, group_k: int, group_n: int, w_int4_k: int,
              tile_counters: Tensor | None = None) -> Tensor:
    """``tileq.linear`` (y = x @ w.t(), nn.Linear convention); ``group_n`` 0 means unset.
    ``tile_counters``: the caller's, for a call traced into a compiled graph (``_linear_trace``)."""
    # Custom op schemas take tensors, not PackedInt4 objects: int4 travels as storage + K.
    return linear(x, weight_operand(w, w_int4_k), x_scale, w_scale, scheme=scheme, out_dtype=out_dtype, bias=bias,
                  group_k=group_k, group_n=group_n or None)


@linear_op.register_fake
def _linear_fake(x, w, x_scale, w_scale, bias, scheme, out_dtype, group_k, group_n, w_int4_k, tile_counters=None):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype)


@tileq_op("quantize_activation", checks=True)
def quantize_activation_op(x: Tensor, dtype: str, granularity: str, group_k: int, scale: Tensor | None,
                           preshuffled: bool) -> tuple[Tensor, Tensor]:
    """``tileq.quantize_activation`` (q, s)."""
    return quantize_activation(x, dtype, granularity=granularity, group_k=group_k, scale=scale,
                               preshuffled=preshuffled)


@quantize_activation_op.register_fake
def _quantize_activation_fake(x, dtype, granularity, group_k, scale, preshuffled):
    m = math.prod(x.shape[:-1])
    q = x.new_empty(x.shape, dtype=_QDTYPES[dtype])
    if granularity == "group":
        gk = -(-x.shape[-1] // group_k)
        strides = (1, max(m, 1)) if preshuffled else (gk, 1)
        return q, torch.empty_strided((m, gk), strides, dtype=torch.float32, device=x.device)
    return q, x.new_empty((m,), dtype=torch.float32)


def _quant_linear_trace(x, weight, weight_scale, bias, input_scale, layer, tile_counters=None):
    """``quant_linear_op``'s traced call: a runner made for it from the plans (its launches are
    traced once, its kept outputs are the graph's)."""
    spec = spec_of_key(layer)
    runner = LayerRunner.build(spec, x, weight_operand(weight, spec.int4_k), weight_scale, bias, input_scale,
                               traced=True)
    if runner is None:
        return None, "no launch"
    return (functools.partial(run_traced, runner, x, weight, weight_scale, bias, input_scale,
                              tile_counters=tile_counters), untraced(runner, x.device, tile_counters))


@tileq_op("quant_linear", mutates_args=_COUNTERS, trace=_quant_linear_trace, checks=True)
def quant_linear_op(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                    input_scale: Tensor | None, layer: str, tile_counters: Tensor | None = None) -> Tensor:
    """A ``QuantLinear`` forward: activation quantization + GEMM; ``layer`` is its spec's key.
    ``tile_counters``: the layer's, for a call traced into a compiled graph (``_quant_linear_trace``)."""
    return quant_linear_cached(spec_of_key(layer), x, weight, weight_scale, bias, input_scale)


@quant_linear_op.register_fake
def _quant_linear_fake(x, weight, weight_scale, bias, input_scale, layer, tile_counters=None):
    return x.new_empty((*x.shape[:-1], spec_of_key(layer).n))


@tileq_op("qk_norm_rope")
def qk_norm_rope_op(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
                    q_heads: int, kv_heads: int, eps: float) -> tuple[Tensor, Tensor]:
    """``tileq.qk_norm_rope`` without a cache: (q, k), [B, H, T, D] transposed views of new tensors."""
    return qk_norm_rope(qkv, cos, sin, q_heads=q_heads, kv_heads=kv_heads, q_weight=q_weight, k_weight=k_weight,
                        eps=eps)


def _qk_shapes(qkv, cos, q_heads, kv_heads):
    b, t, d = qkv.shape[0], qkv.shape[1], cos.shape[-1]
    return (b, t, q_heads, d), (b, t, kv_heads, d)


@qk_norm_rope_op.register_fake
def _qk_norm_rope_fake(qkv, cos, sin, q_weight, k_weight, q_heads, kv_heads, eps):
    qs, ks = _qk_shapes(qkv, cos, q_heads, kv_heads)
    return qkv.new_empty(qs).transpose(1, 2), qkv.new_empty(ks).transpose(1, 2)


@tileq_op("qk_norm_rope_cache", mutates_args=("keys", "values", "length"))
def qk_norm_rope_cache_op(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
                          keys: Tensor, values: Tensor, length: Tensor, q_heads: int, kv_heads: int,
                          eps: float) -> Tensor:
    """``tileq.qk_norm_rope`` writing k and v into a static cache (keys, values, length: mutated in
    place); returns q (the caller has keys and values)."""
    return qk_norm_rope(qkv, cos, sin, q_heads=q_heads, kv_heads=kv_heads, q_weight=q_weight, k_weight=k_weight,
                        eps=eps, cache=(keys, values, length))[0]


@qk_norm_rope_cache_op.register_fake
def _qk_norm_rope_cache_fake(qkv, cos, sin, q_weight, k_weight, keys, values, length, q_heads, kv_heads, eps):
    return qkv.new_empty(_qk_shapes(qkv, cos, q_heads, kv_heads)[0]).transpose(1, 2)


@tileq_op("decode_attention")
def decode_attention_op(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """``tileq.attention.decode_attention``: [B, 1, Hq, D] from q [B, Hq, 1, D] and a KV cache."""
    return decode_attention(q, keys, values, scaling=scaling, mask=mask)


@decode_attention_op.register_fake
def _decode_attention_fake(q, keys, values, mask, scaling):
    b, hq, _, d = q.shape
    return q.new_empty((b, 1, hq, d))
