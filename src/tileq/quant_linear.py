"""The one forward function of a quantized linear layer, shared by ``QuantLinear`` (eager) and the
``tileq::quant_linear`` custom op (what ``torch.compile`` sees), so the two cannot drift.

A layer is described by a ``LayerSpec`` (hashable; its ``key`` string is the custom op's argument
and parses back to the same spec).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .activation import quantize_activation
from .api import linear
from .dtypes import PackedInt4

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
    elif input_scale is not None:
        a, a_scale = quantize_activation(x, spec.act_dtype, granularity="tensor", scale=input_scale)
    else:
        a, a_scale = quantize_activation(x, spec.act_dtype, granularity=spec.act_granularity,
                                         group_k=spec.group_k)
    return linear(a, weight, a_scale, weight_scale, scheme=spec.scheme, out_dtype=x.dtype, bias=bias,
                  group_k=spec.group_k, group_n=spec.group_n)


def weight_operand(spec: LayerSpec, weight: torch.Tensor):
    """The stored weight as ``tileq.linear`` takes it (int4: a PackedInt4 over the same bytes)."""
    return PackedInt4(weight, (spec.n, spec.k), 1) if spec.weight_int4 else weight
