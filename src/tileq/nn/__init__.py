"""The model layer: quantization configs, ``QuantLinear`` and ``quantize_``."""

from .configs import (
    A8W8Config,
    FP8BlockConfig,
    FP8RowConfig,
    QuantConfig,
    W4A8Config,
    W4A16Config,
    W8A16Config,
    config_from_dict,
    config_from_name,
)
from .linear import QuantLinear
from .quantize import QuantizeSummary, quantize_

__all__ = [
    "QuantConfig",
    "A8W8Config",
    "FP8RowConfig",
    "FP8BlockConfig",
    "W8A16Config",
    "W4A16Config",
    "W4A8Config",
    "config_from_dict",
    "config_from_name",
    "QuantLinear",
    "quantize_",
    "QuantizeSummary",
]
