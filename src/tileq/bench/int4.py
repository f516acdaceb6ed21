"""Prepacked int4 calls forced onto one path, decode config or prefill tiling: the rows of
``tileq bench --int4-variants``, what ``tileq replay --rule int4-*`` checks the dispatch layer's
choices against (``dispatch/prepacked.py``'s route and the ``dispatch/int4.py`` rules it calls).

The ``tileq`` row of a prepacked case (``bquant:bf16xi4p:rcr``, ...) times ``tileq.linear`` on the
``PrepackedInt4``: whatever its plan runs. These rows time the same call with the plan's route
replaced by one forced route, launched by the launcher the API would make for it
(``api_prepacked.make_launch``). Each variant's name says what runs (``variant_name``; the row's
kernel column names the instance)::

    decode:<Int4pConfig tag>         the decode kernel with this config on the call's activations
    decode:<tag>:cast                W4A8: the fp8 activations cast to bf16, the 16-bit decode kernel
    gluon:t<T>[:sk<S>|:stk][:fused]  the sm_90 Gluon prefill kernel with T-token tiles, split over K
                                     S ways or stream-K; W4A8 on activations cast to bf16 (its 16-bit
                                     build with their scale), or ':fused' on its fp8 build
    fp8-gemm                         W4A8: the int4 values written as fp8, tileq's fp8 GEMM
    dequant+cublas                   W4A16: the weight dequantized to 16 bits, a cuBLAS product

What is timed per problem (``variants``), each gated against the reference first:

- M <= DECODE_SWEEP_MAX_M: the decode configs the decode rule chooses between (``decode_configs``:
  16-token tiles at three occupancy bands, 32-token tiles above INT4_DECODE_TILE16_MAX_M tokens,
  K split 1, 2, 4, 8 ways, stream-K for 16-bit activations), the tuned table's and the rule's;
- below INT4_DEQUANT_MIN_M: the decode kernel with ``config_for``'s config (W4A8: on its fp8
  activations and cast to bf16);
- from INT4_PREFILL_MIN_M: the Gluon kernel with 64- (below INT4_DEQUANT_MIN_M) and 128-token
  tiles, unsplit and, where the grid has fewer tiles than SMs, split over K every legal way up to
  INT4_MAX_SPLIT; W4A16 256-token tiles from INT4_T256_MIN_M, stream-K with 128- and (from
  INT4_STREAMK_T256_MIN_M) 256-token tiles from INT4_STREAMK_MIN_M; W4A8 on both builds;
- from PREFILL_PATHS_MIN_M: dequant+cublas (W4A16) or fp8-gemm (W4A8);
- always the plan's own choice (marked in its note).

Thresholds are read when the bench runs: a replay with a threshold changed far from them may ask
for a variant that was not timed (``tileq replay`` counts it as not measured).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .baselines import Context, Impl, NotApplicable, Runnable
from .cases import GROUP_K, Operands
from .gate import poisoned

KIND = "variant"
PREFIX = "tileq_int4:"  # + the variant's name
NA_NAME = "tileq_int4_variants"  # the one row of a case that is not a prepacked one
DECODE_SWEEP_MAX_M = 32  # the decode config sweep up to this M (below INT4_PREFILL_MIN_M: decode only)
PREFILL_PATHS_MIN_M = 128  # dequant+cublas / fp8-gemm timed from this M (the plan: INT4_DEQUANT_MIN_M)
SWEEP_SPLITS = (1, 2, 4, 8)  # the decode kernel's splits over K in the sweep
FORCED = "forced (tileq bench --int4-variants)"


# ----------------------------------------------------------------------------- names


def gluon_name(tokens: int, split: int = 1, streamk: bool = False, fused: bool = False) -> str:
    """The variant name of a Gluon prefill tiling: 'gluon:t128', 'gluon:t64:sk3', 'gluon:t256:stk',
    'gluon:t128:fused'."""
    return (f"gluon:t{tokens}" + (f":sk{split}" if split > 1 else "") + (":stk" if streamk else "")
            + (":fused" if fused else ""))


def decode_name(tag: str, cast: bool = False) -> str:
    return f"decode:{tag}" + (":cast" if cast else "")


def variant_name(plan) -> str:
    """The variant a prepacked plan runs (the module docstring's names)."""
    r = plan.route
    if r.path == "decode":
        return decode_name(r.config.tag, r.cast)
    if r.path == "gluon-prefill":
        return gluon_name(r.tokens, r.split, r.streamk, r.fused)
    return r.path  # 'fp8-gemm' | 'dequant+cublas'


def plan_kernel(plan) -> str:
    """The row's kernel column: the instance (fp8-gemm: with the inner 8-bit GEMM's instance)."""
    r = plan.route
    inner = r.inner.instance if r.path == "fp8-gemm" and r.inner is not None else None
    return f"{r.kernel} ({inner.name})" if inner is not None else r.kernel


# ----------------------------------------------------------------------------- the candidates


def decode_configs(m: int, n: int, k: int, x_type: str, facts) -> list:
    """The decode configs timed at ``m`` tokens (M <= DECODE_SWEEP_MAX_M): what ``decode_rule``
    chooses between (16-token tiles with three stages or two, group scales one K tile ahead under
    REGS_AHEAD registers, or two stages capped at REGS_CAPPED; 32-token tiles with two stages
    above INT4_DECODE_TILE16_MAX_M tokens; each split over K 1, 2, 4, 8 ways where every range
    keeps INT4_DECODE_SPLIT_MIN_KTILES K tiles, partials summed in the kernel; stream-K for 16-bit
    activations; fp8 activations converted to fp16 in the kernel), then ``config_for``'s and
    ``decode_rule``'s own, without repeats."""
    from ..dispatch import int4 as D
    from ..dispatch import thresholds
    from ..kernels.int4p.config import DECODE_TOKEN_TILES, REGS_AHEAD, REGS_CAPPED, Int4pConfig
    from ..prepacked import BLOCK_K

    T = thresholds.for_arch(facts.arch.name)
    d16, d32 = DECODE_TOKEN_TILES
    fp8 = x_type in ("fp8", "bf8")
    ktiles = -(-k // BLOCK_K)
    splits = [s for s in SWEEP_SPLITS if s == 1 or ktiles >= T.INT4_DECODE_SPLIT_MIN_KTILES * s]
    out = [D.config_for(m, n, k, x_type, facts)[0], D.decode_rule(m, n, k, x_type, facts)[0]]
    for s in splits:
        fx = {"fixup": s > 1, "fp16": fp8}
        out += [Int4pConfig(d16, s, 3, 4, REGS_AHEAD, True, **fx), Int4pConfig(d16, s, 2, 4, REGS_AHEAD, True, **fx),
                Int4pConfig(d16, s, 2, 4, REGS_CAPPED, **fx)]
        if m > T.INT4_DECODE_TILE16_MAX_M:
            out.append(Int4pConfig(d32, s, 2, **fx))
    if not fp8:
        out.append(D.STREAMK_CONFIG)
        if m > T.INT4_DECODE_TILE16_MAX_M:
            out.append(Int4pConfig(d32, 1, 2, streamk=True))
    return list(dict.fromkeys(out))


def gluon_tilings(m: int, n: int, k: int, x_type: str, w_kind: str, w4a8: bool, facts) -> list[tuple]:
    """(tokens, split, streamk, fused) of the Gluon prefill kernel timed at ``m`` tokens (from
    INT4_PREFILL_MIN_M; the module docstring says which), the builds that take the call."""
    from ..dispatch import int4 as D
    from ..dispatch import thresholds
    from ..kernels.int4p.prefill_launch import tiles
    from ..kernels.int4p.streamk import k_blocks

    T = thresholds.for_arch(facts.arch.name)
    if m < T.INT4_PREFILL_MIN_M:
        return []
    builds = [False] if k % 8 == 0 else []  # (the 16-bit build: 16-byte activation rows for TMA)
    if w4a8 and x_type == "fp8" and w_kind == "group" and k % 16 == 0:
        builds.append(True)  # the fp8 build
    tokens = ([D.T64] if m < T.INT4_DEQUANT_MIN_M else []) + [D.T128]
    out = []
    for fused in builds:
        for t in tokens:
            out.append((t, 1, False, fused))
            if tiles(m, n, t) < facts.num_sms:
                out += [(t, s, False, fused) for s in range(2, int(T.INT4_MAX_SPLIT) + 1)
                        if k_blocks(k) >= D.min_split_blocks(m, facts) * s]
        if not w4a8 and m >= T.INT4_T256_MIN_M:
            out.append((D.T256, 1, False, False))
        if not w4a8 and m >= T.INT4_STREAMK_MIN_M:
            out.append((D.T128, 1, True, False))
            if m >= T.INT4_STREAMK_T256_MIN_M:
                out.append((D.T256, 1, True, False))
    return out


def decode_plan(base, cfg, cast: bool = False):
    """The decode kernel with ``cfg`` (``cast``: fp8 activations cast to bf16 first)."""
    from ..dispatch.prepacked import decode_route

    ct = "bf16" if cast else base.spec.x_type
    return replace(base, route=decode_route(base.spec, cfg, ct, FORCED, "given config"))


def gluon_plan(base, tokens: int, split: int = 1, streamk: bool = False, fused: bool = False):
    """The Gluon prefill kernel with this tiling on the build that runs it."""
    from ..dispatch.prepacked import prefill_route

    return replace(base, route=prefill_route(base.spec, base.facts, tokens, split, streamk, fused, FORCED))


def fp8_gemm_plan(base, device):
    """W4A8 on tileq's fp8 GEMM over the int4 values, with the 8-bit GEMM's own plan."""
    from ..dispatch.plan import make_plan
    from ..dispatch.prepacked import fp8_gemm_route, inner_spec
    from ..errors import TileqError

    spec = inner_spec(base.spec)
    try:
        inner = make_plan(spec, device) if device is not None else make_plan(spec, torch.device("cuda"), arch="sm_90")
    except TileqError as e:
        raise NotApplicable(f"the fp8 GEMM does not plan this call: {e}") from None
    return replace(base, route=replace(fp8_gemm_route(FORCED), inner=inner))


def dequant_plan(base):
    """W4A16: the weight dequantized to 16 bits, then a cuBLAS product."""
    from ..dispatch.prepacked import dequant_route

    return replace(base, route=dequant_route(FORCED))


def plan_of(case, m: int, n: int, k: int, device=None, *, num_sms: int | None = None, **kw):
    """The plan ``tileq.linear`` makes for a prepacked case's call of (m, n, k) tokens on
    ``device`` (None: described for an sm_90 GPU of ``num_sms`` SMs, as ``tileq replay`` asks;
    ``kw``: ``config=``): bf16 output, group_k 128, no bias."""
    from ..dispatch.plan import make_plan
    from ..kernels.int4p.spec import PrepackedSpec

    x_type, x_kind, w_kind = case.prepacked_kinds
    if w_kind == "group" and -(-k // GROUP_K) == 1:
        w_kind = "vector"  # (one group over K: tileq.linear reads a [1, N] scale per channel)
    spec = PrepackedSpec(m, n, k, x_type, x_kind, w_kind, torch.bfloat16, GROUP_K)
    if device is None:
        return make_plan(spec, torch.device("cuda"), arch="sm_90", num_sms=num_sms, **kw)
    return make_plan(spec, device, **kw)


def call_plan(ops: Operands, **kw):
    """The plan ``tileq.linear`` makes for the case's call on its operands' device."""
    return plan_of(ops.case, ops.m, ops.n, ops.k, ops.a.device, **kw)


def variants(base, device=None, with_plan: bool = True) -> dict:
    """{variant name: a thunk making its plan} timed for the call of ``base`` (its plan; the
    module docstring's list), the plan's own choice included; ``device``: where the fp8 GEMM's
    plan is made (None: described for an sm_90 GPU); ``with_plan``: add the plan's own where the
    list does not hold it."""
    from ..dispatch import int4 as D
    from ..dispatch import thresholds

    m, n, k, facts = base.spec.m, base.spec.n, base.spec.k, base.facts
    x_type, w4a8 = base.spec.x_type, base.spec.x_kind != "none"
    T = thresholds.for_arch(facts.arch.name)
    out: dict = {}
    if m < T.INT4_DEQUANT_MIN_M:
        if m <= DECODE_SWEEP_MAX_M:
            cfgs = decode_configs(m, n, k, x_type, facts)
        else:
            cfgs = [D.config_for(m, n, k, x_type, facts)[0]]
        for cfg in cfgs:
            out[decode_name(cfg.tag)] = lambda cfg=cfg: decode_plan(base, cfg)
        if w4a8:  # the other decode route: the activations cast to bf16 (the bf16 rule's config)
            cfg = D.config_for(m, n, k, "bf16", facts)[0]
            out[decode_name(cfg.tag, cast=True)] = lambda cfg=cfg: decode_plan(base, cfg, cast=True)
    for t, s, stk, fused in gluon_tilings(m, n, k, x_type, base.spec.w_kind, w4a8, facts):
        out[gluon_name(t, s, stk, fused)] = lambda t=t, s=s, stk=stk, fused=fused: gluon_plan(base, t, s, stk, fused)
    if m >= PREFILL_PATHS_MIN_M:
        if w4a8:
            out["fp8-gemm"] = lambda: fp8_gemm_plan(base, device)
        else:
            out["dequant+cublas"] = lambda: dequant_plan(base)
    if with_plan and variant_name(base) not in out:
        out[variant_name(base)] = lambda: base
    return out


# ----------------------------------------------------------------------------- the rows


def _gluon_here(facts, device) -> str | None:
    """Why the Gluon prefill kernel cannot run here (no sm_90 GPU, the interpreter, another Triton),
    or None; a forced variant ignores TILEQ_GLUON."""
    from .._runtime import interpreter_active
    from ..dispatch.gluon import gluon_unavailable

    why = gluon_unavailable(facts.arch.name, interpreter_active(), None)
    if device.type != "cuda":
        return f"the Gluon prefill kernel needs a GPU ({why or 'CPU tensors'})"
    return why


def runnable(ops: Operands, plan, *, note: str) -> Runnable:
    """``plan`` run on the case's operands through the launch the API makes for it, made once."""
    from ..api_prepacked import make_launch

    device = ops.a.device
    w = ops.w_prepacked
    sw = ops.b_scale.float()
    w_kind, x_kind = plan.spec.w_kind, plan.spec.x_kind
    if w_kind == "group":
        sw_strides = (sw.stride(0), sw.stride(1))
    elif w_kind == "vector":
        sw = sw.reshape(-1)
        sw_strides = (0, sw.stride(0))
    else:
        sw, sw_strides = sw.reshape(()), (0, 0)
    sx = None
    if x_kind == "vector":
        sx = ops.a_scale.float().reshape(ops.m)
    elif x_kind == "scalar":
        sx = ops.a_scale.float().reshape(())
    x = ops.a
    if plan.route.path == "gluon-prefill" and ((0 if plan.route.cast else x.data_ptr()) | w.data.data_ptr()) & 15:
        raise NotApplicable("TMA cannot read these operands (base pointers not 16-byte aligned): the launch "
                            "would run the dequantize fallback")
    launch = make_launch(plan, x.dtype, sw_strides, sx.stride(0) if x_kind == "vector" else 0, device)
    args = (x, w.data, sx, sw, None)

    def gated():
        return launch(*args, poisoned(ops.m, ops.n, torch.bfloat16, device))

    return Runnable(lambda: launch(*args), "quantized", ops.bytes, note=note, gated=gated, kernel=plan_kernel(plan))


def _unreachable(ops, ctx):
    raise RuntimeError("an N/A entry is never built")


def int4_impls(ops: Operands, ctx: Context) -> tuple[Impl, ...]:
    """``--int4-variants``: one entry per variant of this prepacked call (N/A where it cannot run
    here, e.g. the Gluon kernel without a GPU), or a single N/A entry for a case that is not one."""
    if not ops.case.prepacked:
        why = "prepacked int4 cases only (B type i4p, e.g. bquant:bf16xi4p:rcr)"
        return (Impl(NA_NAME, KIND, "prepacked int4 variants", lambda *_: why, _unreachable),)
    base = call_plan(ops)
    chosen = variant_name(base)
    gluon_why = _gluon_here(base.facts, ops.a.device)
    impls = []
    for name, make in variants(base, ops.a.device).items():
        def build(ops, ctx, make=make, name=name):
            if name == chosen:
                return runnable(ops, base, note=f"the plan's choice: {base.route.reason}")
            return runnable(ops, make(), note=FORCED)

        why = gluon_why if name.startswith("gluon:") else None
        impls.append(Impl(PREFIX + name, KIND, f"tileq.linear forced onto {name}", lambda *_, why=why: why,
                          build, default=False))
    return tuple(impls)
