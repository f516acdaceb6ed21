"""tileq: quantized GEMMs with fused dequantization for PyTorch, written in Triton.

    import tileq
    y = tileq.gemm(a_q, b_q, a_scale, b_scale, scheme="rowcol")
    summary = tileq.quantize_(model, tileq.A8W8Config())   # nn.Linear -> tileq.QuantLinear

See README.md for the schemes, layouts and scale shapes.
"""

from . import errors
from .activation import add_rmsnorm_quantize, quantize_activation
from .api import a8w8_matmul_dequant, explain, gemm, linear
from .dtypes import OperandType, PackedInt4
from .formats import from_pretrained, save_pretrained
from .nn import (
    A8W8Config,
    FP8BlockConfig,
    FP8RowConfig,
    QuantConfig,
    QuantLinear,
    W4A8Config,
    W4A16Config,
    W8A16Config,
    quantize_,
)
from .prepacked import PrepackedInt4, prepack_int4, unprepack_int4
from .problem import Scheme
from .warmup import describe, warmup

from .version import __version__  # noqa: E402

__all__ = [
    "gemm",
    "linear",
    "a8w8_matmul_dequant",
    "explain",
    "quantize_activation",
    "add_rmsnorm_quantize",
    "QuantLinear",
    "quantize_",
    "from_pretrained",
    "save_pretrained",
    "QuantConfig",
    "A8W8Config",
    "FP8RowConfig",
    "FP8BlockConfig",
    "W8A16Config",
    "W4A16Config",
    "W4A8Config",
    "describe",
    "warmup",
    "PackedInt4",
    "PrepackedInt4",
    "prepack_int4",
    "unprepack_int4",
    "OperandType",
    "Scheme",
    "errors",
    "__version__",
]
