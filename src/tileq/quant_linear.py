"""The one forward function of a quantized linear layer, shared by ``QuantLinear`` (eager) and the
``tileq::quant_linear`` custom op (what ``torch.compile`` sees), so the two cannot drift.

A layer is described by a ``LayerSpec`` (hashable; its ``key`` string is the custom op's argument
and parses back to the same spec).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from . import settings
from ._runtime import bounded_put, env_raw, tensor_signature
from .activation import quantize_activation, quantize_launch
from .api import linear, linear_call
from .dtypes import PackedInt4
from .prepacked import PrepackedInt4

_16BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LayerSpec:
    """What the forward of one layer needs besides its tensors."""

    n: int
    k: int
    scheme: str
    act_dtype: str | None
    act_granularity: str | None
    weight_int4: bool
    group_k: int
    group_n: int

    @classmethod
    def of(cls, config, in_features: int, out_features: int) -> "LayerSpec":
        return cls(out_features, in_features, config.scheme, config.act_dtype, config.act_granularity,
                   config.weight_dtype == "int4", config.group_k, config.group_n)

    def granularity_for(self, static_scale: bool) -> str | None:
        """The activation quantization of a call: 'tensor' with a static (calibrated) scale."""
        return "tensor" if static_scale else self.act_granularity

    def scheme_for(self, static_scale: bool) -> str:
        """The GEMM scheme of a call: a static per-tensor activation scale arrives as one value
        per row ([M]), which block-scaled weights read through 'bquant' instead of 'abquant'."""
        return "bquant" if static_scale and self.scheme == "abquant" else self.scheme

    @property
    def int4_k(self) -> int:
        """The logical K of an int4 weight, 0 for the 8-bit ones (``weight_operand``, the ops)."""
        return self.k if self.weight_int4 else 0

    @property
    def key(self) -> str:
        return (f"n={self.n};k={self.k};scheme={self.scheme};act={self.act_dtype}:{self.act_granularity};"
                f"int4={int(self.weight_int4)};gk={self.group_k};gn={self.group_n}")


@lru_cache(maxsize=4096)
def spec_of_key(key: str) -> LayerSpec:
    f = dict(part.split("=", 1) for part in key.split(";"))
    act, gran = f["act"].split(":")
    return LayerSpec(int(f["n"]), int(f["k"]), f["scheme"], None if act == "None" else act,
                     None if gran == "None" else gran, f["int4"] == "1", int(f["gk"]), int(f["gn"]))


def quant_linear_forward(spec: LayerSpec, x: torch.Tensor, weight, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, input_scale: torch.Tensor | None) -> torch.Tensor:
    """y = dequant(quant(x)) @ dequant(W).t() + bias, in x's dtype.

    ``weight`` is the stored tensor, or for int4 a PackedInt4 over it. Weight-only configs take
    16-bit activations: an fp32 x is rounded to bf16 first (the GEMMs have no fp32 x int operand
    pair); the output is in x's dtype in every case, as nn.Linear's.
    """
    if spec.act_dtype is None:
        a = x if x.dtype in _16BIT else x.to(torch.bfloat16)
        a_scale = None
    else:
        gran = spec.granularity_for(input_scale is not None)
        a, a_scale = quantize_activation(x, spec.act_dtype, granularity=gran, group_k=spec.group_k,
                                         scale=input_scale)
    return linear(a, weight, a_scale, weight_scale, scheme=spec.scheme_for(input_scale is not None),
                  out_dtype=x.dtype, bias=bias, group_k=spec.group_k, group_n=spec.group_n)


def weight_operand(weight: torch.Tensor, int4_k: int):
    """The stored weight as ``tileq.linear`` takes it: int4 (``int4_k``, its logical K, not 0)
    travels as uint8 storage [N, K / 2] and becomes a PackedInt4 over the same bytes, or as
    int32 words in the prepacked layout (``tileq.prepacked``) and becomes a PrepackedInt4."""
    if not int4_k:
        return weight
    if weight.dtype == torch.int32:
        return PrepackedInt4(weight, (weight.shape[0], int4_k))
    return PackedInt4(weight, (weight.shape[0], int4_k), 1)


# ----------------------------------------------------------------------------- eager fast path


def runner_key(x: torch.Tensor, has_input_scale: bool):
    """What a LayerRunner depends on besides the layer's tensors: x's signature, the stream (its
    scratch is ordered by the stream) and the environment switches the planners read."""
    dev = x.device
    # (torch's raw stream query, as Triton's launcher makes it: no Stream object per call)
    stream = torch._C._cuda_getCurrentRawStream(dev.index) if dev.type == "cuda" else 0
    return (x.shape, x.stride(), x.dtype, dev, stream, has_input_scale) + settings.key()


def keeps_launches(t: torch.Tensor) -> bool:
    """Whether calls on ``t`` may keep a per-signature launch: CUDA tensors, or CPU ones on
    Triton's interpreter (the tests run the same kept launches there)."""
    return t.device.type == "cuda" or settings.current().interpreted


class LayerRunner:
    """One QuantLinear call signature (CUDA), bound to its two launches: the activation
    quantization (into outputs it keeps for decode sizes) and the GEMM's cached launch
    (``linear_call``). Computes exactly ``quant_linear_forward``. Built from the plans, launching
    nothing: eagerly after a signature's first call, and for each call traced into a
    torch.compile graph (``traced``; ``untraced`` and ``counters`` say whether it can be)."""

    __slots__ = ("aq", "scratch", "m", "k", "out_shape", "gemm", "weight_only", "cast")

    @classmethod
    def build(cls, spec: LayerSpec, x, weight, weight_scale, bias, input_scale, traced: bool = False):
        """A runner, or None where the plain path must serve (CPU / reference executor, empty
        x, signatures the caches do not keep)."""
        if not keeps_launches(x) or x.dim() < 1 or x.numel() == 0 or env_raw("TILEQ_CHECK_FINITE"):
            return None
        r = cls()
        r.k = x.shape[-1]
        r.m = x.numel() // r.k
        r.out_shape = (*x.shape[:-1], spec.n)
        r.weight_only = spec.act_dtype is None
        r.aq, r.scratch = None, None
        # weight-only layers take 16-bit activations: an fp32 x is rounded to bf16 first
        r.cast = torch.bfloat16 if r.weight_only and x.dtype not in _16BIT else None
        if r.weight_only:
            a, a_scale = x.reshape(r.m, r.k), None
            if r.cast is not None:
                a = a.to(r.cast)
        else:
            gran = spec.granularity_for(input_scale is not None)
            made = quantize_launch(x, spec.act_dtype, granularity=gran, group_k=spec.group_k, scale=input_scale)
            if made is None:
                return None
            r.aq, r.scratch = made
            q, a_scale = r.scratch if r.scratch is not None else r.aq.outputs()
            a = q.view(r.m, r.k)
        r.gemm = linear_call(a, weight, a_scale, weight_scale, scheme=spec.scheme_for(input_scale is not None),
                             out_dtype=x.dtype, bias=bias, group_k=spec.group_k, group_n=spec.group_n,
                             traced=traced)
        return r if r.gemm is not None else None

    @property
    def untraced(self) -> str | None:
        """Why its launches cannot be traced into a torch.compile graph, or None: the GEMM's
        (the quantization's is a plain kernel)."""
        return self.gemm.untraced

    @property
    def counters(self) -> int:
        """The tile counters its GEMM's split sums with (0: none)."""
        return self.gemm.counters

    def __call__(self, x, weight_storage, weight_scale, bias, input_scale):
        if self.weight_only:
            a, a_scale = x.reshape(self.m, self.k), None
            if self.cast is not None:
                a = a.to(self.cast)
        else:
            q, a_scale = self.aq(x, input_scale, self.scratch)
            a = q.view(self.m, self.k)
        y = self.gemm.run(a, weight_storage, a_scale, weight_scale, bias, None, None)
        return y.view(self.out_shape)


# ----------------------------------------------------------------------------- the custom op's path

# Runners of the tileq::quant_linear op (what torch.compile calls), shared by every layer of one
# signature: the op has tensors, not a layer, so the key holds the weight's, scales' and bias's
# signatures too. A shared runner's scratch is safe: its calls are ordered on one stream (the key).
OP_RUNNERS_MAX = 4096
_OP_RUNNERS: dict = {}
_SEEN, _PLAIN = object(), object()


def quant_linear_cached(spec: LayerSpec, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, input_scale: torch.Tensor | None) -> torch.Tensor:
    """``quant_linear_forward`` through a runner per call signature, as ``QuantLinear``'s eager
    path does: the first call of a signature takes the validating path, the second builds the
    runner, later ones only launch. ``weight``: the stored tensor (int4 as storage)."""
    key = (spec, runner_key(x, input_scale is not None), tensor_signature(weight), tensor_signature(weight_scale),
           tensor_signature(bias), tensor_signature(input_scale))
    runner = _OP_RUNNERS.get(key)
    if type(runner) is LayerRunner:
        return runner(x, weight, weight_scale, bias, input_scale)
    operand = weight_operand(weight, spec.int4_k)
    y = quant_linear_forward(spec, x, operand, weight_scale, bias, input_scale)
    learn(_OP_RUNNERS, key, runner, OP_RUNNERS_MAX, True, spec, x, operand, weight_scale, bias, input_scale)
    return y


def learn(runners: dict, key, runner, cap: int, room: bool, spec: LayerSpec, x, operand, weight_scale, bias,
          input_scale) -> None:
    """After a call of signature ``key`` took the plain path (``runner``: what ``runners`` held
    for it): note its first call (where ``room`` says so), build its runner on its second (or mark
    it plain for good where none can be built). Shared by ``QuantLinear`` and the custom op."""
    if runner is None:
        if room:
            bounded_put(runners, key, _SEEN, cap)
    elif runner is _SEEN:
        built = LayerRunner.build(spec, x, operand, weight_scale, bias, input_scale)
        runners[key] = built if built is not None else _PLAIN
