"""tileq: quantized GEMMs with fused dequantization for PyTorch, written in Triton.

    import tileq
    y = tileq.gemm(a_q, b_q, a_scale, b_scale, scheme="rowcol")

See README.md for the schemes, layouts and scale shapes.
"""

from . import errors
from .api import a8w8_matmul_dequant, explain, gemm, linear
from .dtypes import OperandType, PackedInt4
from .problem import Scheme
from .warmup import describe, warmup

__version__ = "0.1.0"

__all__ = [
    "gemm",
    "linear",
    "a8w8_matmul_dequant",
    "explain",
    "describe",
    "warmup",
    "PackedInt4",
    "OperandType",
    "Scheme",
    "errors",
    "__version__",
]
