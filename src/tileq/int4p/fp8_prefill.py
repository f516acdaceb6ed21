"""W4A8 prefill on fp8 tensor cores: the prepacked int4 weight written once per call as fp8
values, then tileq's own fp8 GEMM with the weight's scales where the scheme applies them.

The weight's int4 values go to the activations' fp8 type alone (-8..7 are exact in e4m3 and in
e5m2: one byte per weight) and the scales stay in fp32 inside the GEMM, as the fused kernels
keep them:

- group scales ([K / group_k, N]): scheme bquant with b_scale groups of one column x group_k
  (``sa[m] * sum_g sb[g, n] * sum_{k in g} x * v``), which the sm_90 Gluon kernel runs swapped
  (the weight's rows on its 128-row side, their group scales per tile row);
- per-channel or per-tensor scales: scheme rowcol (``sa[m] * sb[n] * sum_k x * v``).

The activation scale is the per-token ([M]) or per-tensor one the call brought. The default
from DEQUANT_MIN_M tokens. ``TILEQ_W4A8_PREFILL=bf16`` takes the other path instead
(``dequant.DequantLaunch``: the fp8 activations converted to bf16, the weight written as bf16,
value times scale rounded, and a bf16 cuBLAS product). Measured on an H200 (18 weights, M 256,
1024, 2048, 4096, both paths in one run, bench/results/h200/int4/fp8-prefill/): with group
scales this path ran 1.28-1.36x faster (median per M; slower on one of 72 problems, 0.91x), and
reached 0.34 / 0.45 / 0.48 / 0.51x the speed of tileq's fp8 rowcol GEMM (when its bquant with
one-column groups ran the portable kernel); with per-channel scales 0.56 / 0.82 / 0.91 / 0.97x.
With that GEMM swapped on the Gluon kernel (bench/results/h200/int4/w4a8-swapped/, 18 weights,
medians): group scales 0.60 / 0.74 / 0.82 / 0.90x fp8 rowcol's speed at 512 / 1024 / 2048 / 4096
tokens (per-channel 0.69 / 0.82 / 0.91 / 0.96x); what remains is the fp8 copy of the weight,
written and read once per call.
"""

from __future__ import annotations

import os

import torch

from .dequant import dequantize_prepacked

PREFILL_ENV = "TILEQ_W4A8_PREFILL"  # 'fp8' (default): this path from DEQUANT_MIN_M tokens; 'bf16': dequant
# 'fused': the fused fp8 build of the Gluon int4 prefill kernel (the fp8 activations as they are,
# the weight converted to e4m3 in registers, fp8 wgmma) at every M where the Gluon plan gives it
# the call (a benchmarking switch: by default it runs below W4A8_MAX_M only, ``fused_for``).
PREFILL_MODES = ("fp8", "bf16", "fused")


def mode() -> str:
    """``TILEQ_W4A8_PREFILL``: 'fp8' (unset), 'bf16' or 'fused'; any other value is an error, not
    a silent default."""
    value = os.environ.get(PREFILL_ENV, "fp8")
    if value not in PREFILL_MODES:
        raise ValueError(f"{PREFILL_ENV}={value!r}: expected 'fp8' (fp8 GEMM), 'bf16' (dequantize + bf16 "
                         f"cuBLAS) or 'fused' (the fused fp8 kernel, group scales, sm_90)")
    return value


# The fused build also takes W4A8 calls from W4A8_MAX_M tokens on wide weights (N >= FUSED_WIDE_N)
# up to FUSED_WIDE_N_MAX_M tokens, and on deep ones (K >= FUSED_WIDE_K) up to FUSED_WIDE_MAX_M,
# where its waves of 128-token tiles cost less than the fp8 GEMM's copy of the weight. H200, 18
# weights, both paths in one run per M (bench/results/h200/int4/):
# - 256 tokens (round7/): on the 13 weights with N >= 16384 or K >= 8192 the fused build took
#   0.77-1.005x the fp8 GEMM path's time (median 0.90); on the other five 0.97-1.13x;
# - 264 tokens (fused-320/, with this rule routed): 0.80-0.93x on the six with N >= 16384;
# - 288 tokens (fp16-checks/): 0.84-0.96x on the six with N >= 16384, 0.93-1.29x on the seven deep ones;
# - 320 tokens (fused-320/): 0.94-1.10x on the wide ones (three slower), 1.00-1.43x on the others;
# - 384 tokens (fp16-checks/): 1.01-1.12x on the wide ones, slower on all 18; at 512 slower on all 18.
FUSED_WIDE_MAX_M = 256
FUSED_WIDE_N_MAX_M = 288
FUSED_WIDE_N = 16384
FUSED_WIDE_K = 8192


def fused_wide_rule() -> str:
    """Where the fused build takes W4A8 from ``prefill.W4A8_MAX_M`` tokens, in words."""
    return (f"on weights with N >= {FUSED_WIDE_N} up to {FUSED_WIDE_N_MAX_M} tokens, with K >= {FUSED_WIDE_K} "
            f"up to {FUSED_WIDE_MAX_M}")


def fused_for(m: int, x_type: str, w_kind: str, n: int, k: int) -> bool:
    """Whether a W4A8 call of ``m`` tokens on an N x K weight runs the fused fp8 build of the
    Gluon prefill kernel where that kernel takes it: by default (TILEQ_W4A8_PREFILL unset or
    'fp8') e4m3 activations with group scales below ``prefill.W4A8_MAX_M`` tokens (instead of the
    activations cast to bf16 for its bf16 build), and a little above on wide or deep weights
    (``fused_wide_rule``, instead of the fp8 GEMM); with 'fused' at every M (where it does not serve: the
    other paths, and ``prefill.unserved`` says why); never with 'bf16'. H200, 18 weights, every
    path in one run (bench/results/h200/int4/w4a8-fused/): against the bf16 build on the cast
    activations, 1.13x / 1.23x faster at 48 / 128 tokens (medians; faster on all 18 weights), and
    against the fp8 GEMM at 512 0.84x (slower on all): conversion-bound at 0.51-0.53x fp8
    rowcol's speed from 256 tokens."""
    from .prefill import W4A8_MAX_M

    value = mode()
    if value == "fused":
        return True
    if value != "fp8" or x_type != "fp8" or w_kind != "group":
        return False
    return (m < W4A8_MAX_M or (m <= FUSED_WIDE_N_MAX_M and n >= FUSED_WIDE_N)
            or (m <= FUSED_WIDE_MAX_M and k >= FUSED_WIDE_K))


def selected() -> bool:
    """Whether W4A8 calls from DEQUANT_MIN_M tokens take this path (where the fused kernel does
    not take them) rather than dequantize + bf16 cuBLAS."""
    return mode() != "bf16"


class Fp8PrefillLaunch:
    """The W4A8 prefill path for one call signature, called like ``launch.Int4pLaunch``:
    y = (x @ values(W)^T with the scales of ``scheme``) + bias, cast, through ``tileq.linear``."""

    name = "dequant-fp8+tileq"

    def __init__(self, n: int, k: int, w_kind: str, x_kind: str, group_k: int, out_dtype: torch.dtype,
                 x_dtype: torch.dtype, backend: str | None = None):
        if x_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or x_kind not in ("vector", "scalar"):
            raise ValueError(f"Fp8PrefillLaunch: fp8 activations with a per-token or per-tensor scale, "
                             f"not {x_dtype} / {x_kind}")
        self.n, self.k, self.w_kind, self.x_kind = n, k, w_kind, x_kind
        self.group_k, self.out_dtype, self.x_dtype, self.backend = group_k, out_dtype, x_dtype, backend
        self.scheme = "bquant" if w_kind == "group" else "rowcol"

    def __call__(self, x2, wdata, sx, sw, bias, out=None) -> torch.Tensor:
        from ..api import linear

        values = dequantize_prepacked(wdata, self.n, self.k, None, "none", (0, 0), self.group_k, self.x_dtype)
        if self.scheme == "bquant":
            w_scale, group_n = sw, 1  # [K / group_k, N]: one column per group
        else:
            w_scale, group_n = sw.reshape(-1) if sw.numel() > 1 else sw.reshape(()), None
        x_scale = sx.reshape(-1) if self.x_kind == "vector" else sx.reshape(())
        return linear(x2, values, x_scale, w_scale, scheme=self.scheme, out_dtype=self.out_dtype, bias=bias,
                      group_k=self.group_k, group_n=group_n, out=out, backend=self.backend)
