"""The catalog: every kernel family tileq names, builds ahead of time and tests.

Any legal problem runs (the kernel is specialized at run time); the catalog is the set whose
names are stable, which ``tileq build`` compiles and ``tileq selftest`` checks. It contains CK's
AQuant matrix ({fp8, bf8, fp8i4, bf8i4} x 4 layouts decode + x {rcr, rrr, crr} preshufflequant).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..dtypes import OperandType as T
from ..problem import LAYOUTS, ProblemSpec, ScaleKind, ScaleLayout, Scheme
from .names import KernelFamily

# (scheme, pairs) for the prefill and decode pipelines in all four layouts.
_PAIRS = {
    Scheme.TENSOR: [(T.I8, T.I8), (T.FP8, T.FP8), (T.BF8, T.BF8)],
    Scheme.ROWCOL: [
        (T.I8, T.I8), (T.FP8, T.FP8), (T.BF8, T.BF8), (T.FP8, T.BF8),
        (T.BF16, T.I8), (T.BF16, T.FP8), (T.FP16, T.I8), (T.FP16, T.FP8),
    ],
    # CK's AQuant names: fp8, bf8, fp8i4 (int4 A x fp8 B), bf8i4.
    Scheme.AQUANT: [(T.FP8, T.FP8), (T.BF8, T.BF8), (T.I4, T.FP8), (T.I4, T.BF8)],
    Scheme.BQUANT: [
        (T.FP8, T.I4), (T.BF8, T.I4), (T.I8, T.I4), (T.BF16, T.I4), (T.FP16, T.I4),
        (T.FP8, T.FP8), (T.BF16, T.I8), (T.BF16, T.FP8),
    ],
    Scheme.ABQUANT: [(T.FP8, T.FP8), (T.BF8, T.BF8), (T.I8, T.I8), (T.FP8, T.I4)],
}

_PRESHUFFLE_LAYOUTS = ("rcr", "rrr", "crr")


@lru_cache(maxsize=1)
def catalog() -> tuple[KernelFamily, ...]:
    fams: list[KernelFamily] = []
    for scheme, pairs in _PAIRS.items():
        for a, b in pairs:
            for layout in LAYOUTS:
                for pipeline in ("prefill", "decode"):
                    fams.append(KernelFamily(scheme, a, b, layout, pipeline))
            if scheme is Scheme.AQUANT:
                for layout in _PRESHUFFLE_LAYOUTS:
                    fams.append(KernelFamily(scheme, a, b, layout, "preshufflequant"))
    return tuple(fams)


def aquant_matrix() -> list[KernelFamily]:
    """The 28 families of CK's AQuant parity matrix (16 decode + 12 preshufflequant)."""
    return [
        f for f in catalog()
        if f.scheme is Scheme.AQUANT and f.pipeline in ("decode", "preshufflequant")
    ]


def canonical_scale_kinds(scheme: Scheme, a: T, b: T) -> tuple[ScaleKind, ScaleKind, int]:
    """The scale kinds (and group_n) a family is built and tested with.

    tensor: scalar x scalar; rowcol: per-row x per-column (no a_scale for a bf16/fp16 A);
    aquant: [M, Gk] x none; bquant: per-row (none for bf16/fp16 A) x [Gk, N] (group_n = 1);
    abquant: [M, Gk] x [Gk, ceil(N/128)] (DeepSeek's 1x128 x 128x128).
    """
    wide_a = a.is_wide_float
    if scheme is Scheme.TENSOR:
        return ScaleKind.SCALAR, ScaleKind.SCALAR, 1
    if scheme is Scheme.ROWCOL:
        return (ScaleKind.NONE if wide_a else ScaleKind.VECTOR), ScaleKind.VECTOR, 1
    if scheme is Scheme.AQUANT:
        return ScaleKind.GROUP, ScaleKind.NONE, 1
    if scheme is Scheme.BQUANT:
        return (ScaleKind.NONE if wide_a else ScaleKind.VECTOR), ScaleKind.GROUP, 1
    return ScaleKind.GROUP, ScaleKind.GROUP, 128


def family_spec(fam: KernelFamily, m: int, n: int, k: int, *, group_k: int = 128,
                out_dtype: torch.dtype = torch.bfloat16) -> ProblemSpec:
    """A ProblemSpec of this family at the given shape with its canonical scales."""
    sa, sb, group_n = canonical_scale_kinds(fam.scheme, fam.a, fam.b)
    preshuffled = fam.pipeline == "preshufflequant" or fam.scale_layout == "preshuffled"
    return ProblemSpec(
        m=m, n=n, k=k, a_type=fam.a, b_type=fam.b, layout=fam.layout, scheme=fam.scheme,
        a_scale_kind=sa, b_scale_kind=sb, out_dtype=out_dtype, group_k=group_k, group_n=group_n,
        a_scale_layout=ScaleLayout.PRESHUFFLED if preshuffled else ScaleLayout.ROWMAJOR,
    )
