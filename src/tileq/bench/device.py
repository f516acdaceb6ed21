"""Where ``bench`` and ``demo`` run: the CUDA device, or the CPU through Triton's interpreter.

Triton decides between compiling and interpreting a kernel when the ``@triton.jit`` decorator
runs, i.e. when ``tileq.kernels.gemm_kernel`` is imported. So without CUDA, TRITON_INTERPRET=1
must be set before that import; this module does it first thing and refuses (rather than
silently measuring the torch reference) when it is too late.
"""

from __future__ import annotations

import os
import sys

import torch

from ..errors import UnsupportedError, expect

_KERNEL_MODULE = "tileq.kernels.gemm_kernel"


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
    if _KERNEL_MODULE in sys.modules:
        raise UnsupportedError(
            expect("TRITON_INTERPRET", "=1 before tileq's kernels are imported (CPU runs use "
                   "Triton's interpreter)", "the kernels already imported without it in this process")
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")
