"""Where ``bench`` and ``demo`` run: the CUDA device, or the CPU through Triton's interpreter.

Triton decides between compiling and interpreting a kernel when the ``@triton.jit`` decorator
runs, i.e. when a kernel module is imported, and ``import tileq`` already imports some (the
activation-quantization kernels). So without CUDA, TRITON_INTERPRET=1 must be set before that:
the ``tileq`` command (``python -m tileq`` or the console script) restarts itself with it set;
a library caller gets an error saying so (rather than silently measuring the torch reference).
"""

from __future__ import annotations

import os
import sys

import torch

from ..errors import UnsupportedError, expect

# Modules whose import runs @triton.jit decorators.
_KERNEL_MODULES = ("tileq.kernels.gemm_kernel", "tileq.kernels.act_quant_kernel", "tileq.kernels.int4p.kernel",
                   "tileq.kernels.int4p.dequant")


def _kernels_imported() -> bool:
    return any(m in sys.modules for m in _KERNEL_MODULES)


def _is_tileq_command() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (spec is not None and spec.name == "tileq.__main__") or os.path.basename(sys.argv[0]) == "tileq"


def prepare_device(requested: str | None = None) -> torch.device:
    """The device to run on ('auto' = CUDA when available, else the CPU interpreter)."""
    want = (requested or "auto").lower()
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UnsupportedError(expect("device", "a visible CUDA device for 'cuda'",
                                          "torch.cuda.is_available() == False"))
        return torch.device(want)
    if want != "cpu":
        raise UnsupportedError(expect("device", "'auto', 'cuda', 'cuda:N' or 'cpu'", repr(requested)))
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return torch.device("cpu")
    if _kernels_imported() and _is_tileq_command():
        # The command's own process imported the kernels compiled: run it again interpreted.
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "tileq", *sys.argv[1:]],
                  dict(os.environ, TRITON_INTERPRET="1"))
    if _kernels_imported():
        raise UnsupportedError(
            expect("TRITON_INTERPRET", "=1 before tileq's kernels are imported (CPU runs use "
                   "Triton's interpreter)", "the kernels already imported without it in this process")
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")
