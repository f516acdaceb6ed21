"""The loader of one quantized nn.Linear of a checkpoint, chosen by the checkpoint's
quantization method (``tileq.from_pretrained``'s own path and the tensor-parallel sharded one)."""

from __future__ import annotations

from . import compressed_tensors as ct
from . import deepseek_fp8 as dsf
from . import tileq_format as tqf


def load_layer(method: str, reader, name: str, linear, plan, parsed, *, device, dtype):
    """(QuantLinear, the tensor names read) for layer ``name`` shaped as ``linear``: ``plan`` is
    the layer's plan of its format (compressed-tensors, tileq's), ``parsed`` DeepSeek fp8's."""
    if method == ct.QUANT_METHOD:
        return ct.load_layer(reader, name, linear, plan, device=device, dtype=dtype)
    if method == dsf.QUANT_METHOD:
        return dsf.load_layer(reader, name, linear, parsed, device=device, dtype=dtype)
    return tqf.load_layer(reader, name, linear, *plan, device=device, dtype=dtype)
