"""A call on a prepacked int4 weight's route (a ``PrepackedSpec``): the path and its kernel, the
decode config or the prefill tiling, where each choice came from and why, from ``int4``'s rules.

The paths: 'decode' (the Triton decode kernel), 'gluon-prefill' (the sm_90 Gluon prefill kernel),
'fp8-gemm' (W4A8 on tileq's fp8 GEMM over the int4 values: ``dispatch.plan`` plans that GEMM as
the route's ``inner`` plan) and 'dequant+cublas'. ``api_prepacked`` launches the route, ``tileq
explain --prepacked`` prints ``describe``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..device import DeviceFacts
from ..dtypes import OperandType
from ..kernels.int4p.config import Int4pConfig, kernel_name
from ..kernels.int4p.prefill_launch import kernel_name as prefill_kernel_name
from ..kernels.int4p.prefill_launch import tiles
from ..kernels.int4p.spec import PrepackedSpec
from ..kernels.int4p.streamk import schedule as streamk_schedule
from ..problem import ProblemSpec, ScaleKind, Scheme
from .int4 import (T64, T128, T256, cast_min_bytes, compute_type, config_for, fused_for, fused_wide_rule,
                   overlap_for, plan_cost, prefill_tiling, prefill_waves, streamk_cost, streamk_for,
                   traced_config, unserved)
from .thresholds import for_arch as thresholds_for

if TYPE_CHECKING:
    from .plan import Plan


@dataclass(frozen=True)
class PrepackedRoute:
    """What runs one prepacked-int4 call, and why.

    ``path``: 'decode' (``config``, ``compute_type``: the activations' type the kernel runs),
    'gluon-prefill' (``tokens`` x 128-row tiles, ``split`` over K or ``streamk``; ``fused``: the
    fp8 build, else W4A8 activations cast to bf16; ``overlap``), 'fp8-gemm' (``inner``: the 8-bit
    GEMM's plan) or 'dequant+cublas'. ``kernel``: the kernel instance (the path's name for the last
    two). ``reason``: why this path and config or tiling; ``cast``: fp8 activations cast to bf16
    before the kernel; ``not_gluon``: why the Gluon prefill kernel does not take a prefill-sized
    call that runs elsewhere."""

    path: str
    kernel: str
    reason: str
    config: Int4pConfig | None = None
    config_source: str = ""  # 'tuned table' | 'heuristic: <why>' | 'given config'
    compute_type: str | None = None
    cast: bool = False
    tokens: int | None = None
    split: int = 1
    streamk: bool = False
    fused: bool = False
    overlap: bool = False
    not_gluon: str | None = None
    inner: Plan | None = None
    inner_error: Exception | None = field(default=None, compare=False)  # the call raises it

    def describe(self, plan: Plan) -> str:
        """The kernel (or path) and why, in one line (``tileq explain --prepacked``)."""
        s, T = plan.spec, thresholds_for(plan.arch.name)
        if self.path == "decode":
            return f"{self.kernel} ({self.reason})"
        if self.path == "gluon-prefill":
            overlap = " (the next slice while this one's wgmmas run)" if self.overlap else ""
            cast = ""
            if self.fused:
                cast = ("; its fp8 build: the fp8 activations as they are, the weight converted to e4m3, fp8 "
                        "wgmma promoted every 128 of K, their scale in the epilogue")
                if s.m >= T.INT4_W4A8_MAX_M:
                    cast += f"; from {T.INT4_W4A8_MAX_M} tokens only {fused_wide_rule(plan.facts)}"
            elif self.cast:
                cast = f"; {s.x_type} activations cast to bf16 first, their scale in the epilogue"
            return (f"{self.kernel} ({self.reason}: the sm_90 Gluon prefill kernel, {self.tokens}-token x 128-row "
                    f"tiles, int4 converted in registers{overlap}{cast})")
        if self.path == "fp8-gemm":
            scheme = "bquant" if s.w_kind == "group" else "rowcol"
            return (f"{self.kernel} ({self.reason}, W4A8: W's int4 values written as {s.x_type}, then tileq's "
                    f"fp8 {scheme} GEMM with its scales; not the Gluon prefill kernel: {self.not_gluon})")
        return (f"{self.kernel} ({self.reason}: W dequantized to 16 bits, then a cuBLAS product; not the Gluon "
                f"prefill kernel: {self.not_gluon})")


# ----------------------------------------------------------------------------- each path's route


def decode_route(spec: PrepackedSpec, cfg: Int4pConfig, ct: str, reason: str, source: str,
                 not_gluon: str | None = None) -> PrepackedRoute:
    """The decode kernel with ``cfg`` on activations of type ``ct`` (the call's, or bf16: cast first)."""
    return PrepackedRoute("decode", kernel_name(ct, spec.w_kind, cfg), reason, config=cfg, config_source=source,
                          compute_type=ct, cast=ct != spec.x_type, not_gluon=not_gluon)


def prefill_route(spec: PrepackedSpec, facts: DeviceFacts, tokens: int, split: int, streamk: bool, fused: bool,
                  reason: str) -> PrepackedRoute:
    """The Gluon prefill kernel with this tiling on the build that runs it: fp8 (``fused``), the
    16-bit one on W4A8 activations cast to bf16 (with their scale), else the call's 16-bit type."""
    w4a8 = spec.x_kind != "none"
    ct = "fp8" if fused else ("bf16" if w4a8 else spec.x_type)
    cast = w4a8 and not fused
    return PrepackedRoute("gluon-prefill", prefill_kernel_name(ct, spec.w_kind, tokens, split, streamk, cast), reason,
                          cast=cast, tokens=tokens, split=split, streamk=streamk, fused=fused,
                          overlap=overlap_for(ct, tokens, facts))


def fp8_gemm_route(reason: str, not_gluon: str | None = None) -> PrepackedRoute:
    """W4A8 on tileq's fp8 GEMM over the int4 values (its ``inner`` plan made by ``dispatch.plan``)."""
    return PrepackedRoute("fp8-gemm", "dequant-fp8+tileq", reason, not_gluon=not_gluon)


def dequant_route(reason: str, not_gluon: str | None = None) -> PrepackedRoute:
    """W4A16: the weight dequantized to 16 bits, then a cuBLAS product."""
    return PrepackedRoute("dequant+cublas", "dequant+cublas", reason, not_gluon=not_gluon)


def inner_spec(spec: PrepackedSpec) -> ProblemSpec:
    """The 8-bit GEMM of the fp8-gemm path: x [M, K] (fp8) times the int4 values as x's type,
    [K, N] K-major, group scales by scheme bquant (groups of one column), the others by rowcol."""
    a = OperandType(spec.x_type)
    scalar = ScaleKind.SCALAR
    b_kind = {"group": ScaleKind.GROUP, "vector": ScaleKind.VECTOR, "scalar": scalar}[spec.w_kind]
    return ProblemSpec(m=spec.m, n=spec.n, k=spec.k, a_type=a, b_type=a, layout="rcr",
                       scheme=Scheme.BQUANT if spec.w_kind == "group" else Scheme.ROWCOL,
                       a_scale_kind=ScaleKind.VECTOR if spec.x_kind == "vector" else scalar, b_scale_kind=b_kind,
                       out_dtype=spec.out_dtype, group_k=spec.group_k, group_n=1, has_bias=spec.has_bias)


# ----------------------------------------------------------------------------- the choice


def choose_route(spec: PrepackedSpec, facts: DeviceFacts, *, given: Int4pConfig | None = None,
                 device: torch.device | None = None, traced: bool = False) -> PrepackedRoute:
    """The route of ``spec`` on ``device`` (``facts`` its facts; None: a described call on a GPU of
    ``facts``' arch, compiled, with the default switches). ``given``: a decode config the decode
    kernel runs on the call's own activations; ``traced``: the launch is traced into a
    torch.compile graph (the decode kernel then runs ``traced_config``'s config). An fp8-gemm
    route comes without its ``inner`` plan (``dispatch.plan`` adds it)."""
    T = thresholds_for(facts.arch.name)
    m, n, k, x_type = spec.m, spec.n, spec.k, spec.x_type
    if given is not None:
        return decode_route(spec, given, x_type, "given config", "given config")
    w4a8 = spec.x_kind != "none"
    tiling = prefill_tiling(m, n, k, facts, w4a8)
    not_gluon = None
    if m >= T.INT4_DEQUANT_MIN_M or tiling is not None:
        fused = w4a8 and fused_for(m, x_type, spec.w_kind, n, k, facts)
        not_gluon = unserved(m, k, x_type, spec.x_kind, spec.w_kind, spec.out_dtype, tiling[0] if tiling else None,
                             fused, facts, device)
        if not_gluon is None:
            return _prefill(spec, tiling, fused, facts)
        if m >= T.INT4_DEQUANT_MIN_M:
            route = fp8_gemm_route if w4a8 else dequant_route
            return route(f"M >= {T.INT4_DEQUANT_MIN_M}", not_gluon)
    ct = compute_type(m, n, k, x_type, facts)
    cfg, source = config_for(m, n, k, ct, facts)  # (the device's SM count; 132 on an H200)
    if traced and cfg.maxnreg is not None:
        cfg, how = traced_config(cfg)
        source = f"{source}; traced into a compiled graph (no register cap): {how}"
    reason = source
    if ct != x_type:
        why = (f"M > {T.INT4_W4A8_CAST_MAX_M}" if m > T.INT4_W4A8_CAST_MAX_M else
               f"{n * k // 2 / 1e6:.1f} MB of int4 >= {cast_min_bytes(m, facts) / 1e6:.0f} MB")
        reason = f"{x_type} activations cast to {ct} first: {why}; {source}"
    return decode_route(spec, cfg, ct, reason, source, not_gluon)


def _prefill(spec: PrepackedSpec, tiling: tuple[int, int], fused: bool, facts: DeviceFacts) -> PrepackedRoute:
    """The Gluon prefill kernel's route for the tiling (stream-K where it beats it) and the reason."""
    T = thresholds_for(facts.arch.name)
    m, n, k, sms = spec.m, spec.n, spec.k, facts.num_sms
    t, split = tiling
    t_sk, streamk = streamk_for(m, n, k, t, split, facts, spec.x_kind != "none")
    count = tiles(m, n, t)
    if streamk:
        s = streamk_schedule(tiles(m, n, t_sk), k, sms)
        reason = (f"stream-K: {s.dp} whole tiles of {t_sk} tokens, then {s.per} of the other {s.units} "
                  f"(tile, K block) units per SM: {streamk_cost(m, n, k, t_sk, facts):.1f} K blocks "
                  f"per SM one after another against {plan_cost(m, n, k, t, split, facts):.1f} with "
                  f"{count} tiles of {t} tokens{f' split over K {split} ways' if split > 1 else ''} "
                  f"(x {T.INT4_STREAMK_MARGIN} needed)")
        t, split = t_sk, 1
    elif split > 1:
        reason = f"{count} tiles of {t} tokens for {sms} SMs, at most {T.INT4_SPLIT_FILL} x SMs: split over K {split} ways"
    elif m >= T.INT4_DEQUANT_MIN_M and t == T256:
        reason = (f"M >= {T.INT4_T256_MIN_M}: {prefill_waves(m, n, T256, facts)} waves of 256-token tiles "
                  f"(x {T.INT4_TILE256_COST}) against {prefill_waves(m, n, T128, facts)} of 128-token ones")
    elif m >= T.INT4_DEQUANT_MIN_M:
        reason = f"M >= {T.INT4_DEQUANT_MIN_M}"
    else:
        reason = f"M >= {T.INT4_PREFILL_MIN_M} with {tiles(m, n, T64)} tiles of 64 tokens for {sms} SMs"
    return prefill_route(spec, facts, t, split, streamk, fused, reason)

