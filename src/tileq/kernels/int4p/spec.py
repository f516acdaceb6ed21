"""What a call on a prepacked int4 weight is, for its plan (``PrepackedSpec``).

Hashable and tensor-free: ``tileq.api_prepacked`` builds one from validated arguments,
``dispatch.plan.make_plan`` plans it, the launchers of this package run the plan. Imports no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrepackedSpec:
    """y = x @ W^T on a prepacked int4 weight W [N, K] with x [M, K]."""

    m: int
    n: int
    k: int
    x_type: str  # the activations: 'bf16' | 'fp16' | 'fp8' | 'bf8'
    x_kind: str  # their scale: 'none' (16-bit, W4A16) | 'vector' (per token) | 'scalar' (W4A8)
    w_kind: str  # the weight's scales: 'group' ([K / group_k, N]) | 'vector' ([N]) | 'scalar'
    out_dtype: torch.dtype
    group_k: int = 128
    has_bias: bool = False
