"""Whether a quantized layer's call quantizes its activations inside the GEMM kernel (one launch,
``kernels/fused_quant.py``) instead of an activation-quantization launch before the GEMM.

It serves rowcol layers with int8 x int8 or fp8 x fp8 weights and dynamic per-token activation
scales (A8W8, FP8 row-wise), bf16/fp16 activations, where the portable kernel runs the GEMM.
Every program re-reads its tokens' rows over the whole K for their scales, which costs more L2
traffic per token; below ``FUSED_QUANT_MAX_M`` tokens the saved launch is worth more (the
threshold table). ``TILEQ_FUSED_QUANT`` forces it off ('0') or on wherever it serves ('1').
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import device as _device
from .. import settings as _settings
from ..dtypes import OperandType
from ..kernels.fused_quant import FusedQuantLaunch
from ..kernels.launch import GemmLaunch
from . import thresholds

_X_DTYPES = (torch.bfloat16, torch.float16)
_TYPES = (OperandType.I8, OperandType.FP8)


@dataclass(frozen=True)
class FusedQuantChoice:
    fused: bool
    reason: str


def choose_fused_quant(*, m: int, scheme: str, act_type: OperandType | None, weight_type: OperandType | None,
                       granularity: str | None, x_dtype: torch.dtype, portable: bool,
                       arch: str | None = None) -> FusedQuantChoice:
    """The rule. ``portable``: the GEMM's launch is the portable kernel's and can take 16-bit
    activations (``GemmLaunch.fusable``); ``arch`` names the thresholds' table."""
    if scheme != "rowcol" or granularity != "row":
        return FusedQuantChoice(False, "not rowcol with dynamic per-token activation scales")
    if act_type not in _TYPES or weight_type is not act_type:
        return FusedQuantChoice(False, "not int8 x int8 or fp8 x fp8")
    if x_dtype not in _X_DTYPES:
        return FusedQuantChoice(False, f"activations of dtype {x_dtype} (bf16 or fp16 only)")
    if not portable:
        return FusedQuantChoice(False, "the GEMM does not run on the portable kernel")
    switch = _settings.current().fused_quant
    if switch == "0":
        return FusedQuantChoice(False, "TILEQ_FUSED_QUANT=0")
    if switch == "1":
        return FusedQuantChoice(True, "TILEQ_FUSED_QUANT=1")
    limit = thresholds.for_arch(arch).FUSED_QUANT_MAX_M
    return FusedQuantChoice(m <= limit, f"M={m} {'<=' if m <= limit else '>'} FUSED_QUANT_MAX_M={limit}")


def fused_quant_launch(gemm_launch, x2d: torch.Tensor, *, scheme: str, act_dtype, granularity: str | None,
                       weight_dtype: torch.dtype) -> FusedQuantLaunch | None:
    """The one launch replacing (quantize ``x2d`` per token, ``gemm_launch`` on the result) for
    x2d's signature ([M, K], unit stride along K), or None where the rule says no.
    ``gemm_launch`` is the launch ``tileq.linear`` made for the quantized problem: the fused
    launch runs its kernel, config and grid, so the results are the same bit for bit."""
    act, weight = _ACTS.get(act_dtype), _WEIGHTS.get(weight_dtype)
    portable = isinstance(gemm_launch, GemmLaunch) and gemm_launch.fusable is not None
    facts = _device.facts(x2d.device if not _settings.current().interpreted else torch.device("cpu"))
    choice = choose_fused_quant(m=x2d.shape[0], scheme=scheme, act_type=act, weight_type=weight,
                                granularity=granularity, x_dtype=x2d.dtype, portable=portable,
                                arch=facts.arch.name)
    if not choice.fused:
        return None
    return FusedQuantLaunch(gemm_launch, x2d.dtype, x2d.stride(0))


_ACTS = {"int8": OperandType.I8, "fp8": OperandType.FP8}  # a layer config's act_dtype
_WEIGHTS = {torch.int8: OperandType.I8, torch.float8_e4m3fn: OperandType.FP8}
