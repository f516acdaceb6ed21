"""Prepacked int4 weights: a layout made for the kernel's loads and conversion (``layout.py``),
the Triton kernel that reads it (``kernel.py``) and its launcher (``launch.py``).

``PackedInt4`` (pk_int4, DESIGN.md) stays the interchange format: checkpoints, ``tileq.gemm``'s
operands and the reference all use it. ``prepack_int4`` turns an nn.Linear-oriented PackedInt4
weight into a ``PrepackedInt4`` and ``unprepack_int4`` is its exact inverse.
"""

from .layout import BLOCK_K, LAYOUT, PrepackedInt4, prepack_int4, unprepack_int4

__all__ = ["BLOCK_K", "LAYOUT", "PrepackedInt4", "prepack_int4", "unprepack_int4"]
