"""tileq: quantized GEMMs with fused dequantization for PyTorch, written in Triton.

    import tileq
    y = tileq.gemm(a_q, b_q, a_scale, b_scale, scheme="rowcol")
    summary = tileq.quantize_(model, tileq.A8W8Config())   # nn.Linear -> tileq.QuantLinear

See README.md for the schemes, layouts and scale shapes.
"""

import importlib
import importlib.util

from . import errors, extensions
from .version import __version__


def _import_hf_moe() -> None:
    from .integrations import hf_moe  # noqa: F401 - registers transformers' experts modules with quantize_


def _import_distributed() -> None:
    from . import distributed  # noqa: F401 - registers the sharded-model paths of quantize_ and the checkpoints


# The parts of quantize_ and from_pretrained / save_pretrained that live on the floors above them,
# imported on those calls' first use (they import torch): whichever tileq module a program imports
# first, this file runs before it.
extensions.add("tileq.integrations.hf_moe", _import_hf_moe)
extensions.add("tileq.distributed", _import_distributed)


def _register_hf_quantizer() -> None:
    from .formats import hf_quantizer  # noqa: F401 - registers "tileq" with transformers' quantizers


# transformers finds quantization methods by name when from_pretrained runs: "tileq" is registered
# as soon as both are imported, in either order, without tileq importing transformers.
extensions.when_imported("transformers.quantizers.auto", _register_hf_quantizer)


def _import_api() -> None:
    """The public API below, imported on first use of any of its names (PEP 562's ``__getattr__``):
    ``import tileq.cli`` (``tileq --help``) then costs no torch, Triton or kernel import. Everything
    is imported at once, as an eager ``import tileq`` did, so the first name used brings them all."""
    from .activation import add_rmsnorm_quantize, quantize_activation, silu_mul_quantize
    from .api import a8w8_matmul_dequant, explain, gemm, linear
    from .api_grouped import explain_grouped, grouped_linear
    from .dtypes import OperandType, PackedInt4
    from .formats import from_pretrained, save_pretrained
    from .moe import QuantExperts, fused_moe
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

    globals().update((name, value) for name, value in locals().items() if name in __all__)


def __getattr__(name: str):
    if name in __all__:
        _import_api()
        return globals()[name]
    # A submodule not imported yet (``tileq.quant`` after ``import tileq``; the import system's own
    # probe for ``from . import cli``): that module alone, not the whole API.
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "gemm",
    "linear",
    "a8w8_matmul_dequant",
    "explain",
    "grouped_linear",
    "explain_grouped",
    "quantize_activation",
    "add_rmsnorm_quantize",
    "silu_mul_quantize",
    "fused_moe",
    "QuantExperts",
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
