"""The one registry of implementations a case is measured with: tileq, torch baselines, peers.

Each entry says when it applies; otherwise the row is N/A with the reason (never a silent
substitute). Kinds:

  tileq        tileq.gemm through the Triton kernels (a prepacked int4 case: tileq.linear on the
               PrepackedInt4, whatever path its plan takes)
  fused        a torch kernel computing the same quantized product (cuBLASLt fp8, tinygemm int4)
  unfused      the same product in eager torch: dequantize, then a bf16 product / int8 product
               followed by a dequantization
  unquantized  bf16 torch.matmul on the unquantized operands: the speed a model has without
               quantization (reported beside, never as "the best baseline")
  raw          torch._int_mm alone: the int32 product with no dequantization (a lower bound)
  reference    tileq's torch reference (float64 products); only with --baselines reference
  peer         an optional library (vLLM, DeepGEMM, torchao), used only where importable
  pipeline     tileq with the prefill pipeline forced (the dispatcher's decode check)
  variant      tileq forced onto one kernel or one Gluon tiling (``variants.py``: ``--impls``,
               ``--gluon-tilings``) or a prepacked int4 call onto one path, config or tiling
               (``int4.py``: ``--int4-variants``); not in this registry, never a baseline

"The best baseline" of a shape is the fastest fused / unfused / peer entry that passed the gate.
Facts about the torch entry points are docs/schemes.md section 6's (checked on an H200).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..dtypes import OperandType
from ..problem import Scheme
from .cases import GROUP_K, Case, Operands, storage_bytes
from .gate import poisoned

SAME_MATH_KINDS = ("fused", "unfused", "peer")

T = OperandType


@dataclass
class Runnable:
    """A prepared implementation: ``fn`` is timed; ``gated`` (default ``fn``) is gated."""

    fn: Callable[[], torch.Tensor]
    expected: str  # 'quantized' (tileq's reference) | 'float' (bf16 product) | 'raw' (int product)
    bytes: int
    note: str = ""
    gated: Callable[[], torch.Tensor] | None = None
    kernel: str = ""  # the kernel it runs, for the row's kernel column (tileq's own rows: its plan's)


class NotApplicable(Exception):
    """Raised by a builder that finds out only from the operands (or their plan) that it does not
    apply: the row is N/A with this reason, not an error."""


@dataclass(frozen=True)
class Context:
    device: torch.device
    tileq_backend: str  # 'triton' (the interpreter on CPU)


@dataclass(frozen=True)
class Impl:
    name: str
    kind: str
    description: str
    requires: Callable[[Case, int, int, int], str | None]
    build: Callable[[Operands, Context], Runnable]
    default: bool = True
    cuda_only: bool = False
    module: str | None = None  # an optional peer's import name
    shared: bool = False  # one measurement serves every case of a shape (bf16 matmul)

    def unavailable(self, case: Case, m: int, n: int, k: int, device: torch.device) -> str | None:
        """Why this implementation cannot run the case at this shape here, or None."""
        # The most specific reason first: a peer that is absent, then a case the entry does not
        # compute at all, then a missing GPU.
        if self.module is not None and importlib.util.find_spec(self.module) is None:
            return "not installed"
        why = self.requires(case, m, n, k)
        if why is None and self.cuda_only and device.type != "cuda":
            return "needs CUDA"
        return why


# ----------------------------------------------------------------------------- requirements


def _always(case, m, n, k):
    return None


def _rc(case: Case) -> str | None:
    if not case.layout.startswith("rc"):
        return (f"measured in the nn.Linear layout only (A row-major, B column-major: 'rc'); "
                f"the case is '{case.layout}'")
    return None


def _multiple(**dims) -> str | None:
    for label, (value, mult) in dims.items():
        if value % mult:
            return f"{label}={value} is not a multiple of {mult}"
    return None


def _all(*reasons) -> str | None:
    return next((r for r in reasons if r), None)


def _scaled_tensorwise_req(case, m, n, k):
    if case.scheme is not Scheme.TENSOR or not (case.a.is_float8 and case.b.is_float8):
        return "fp8/bf8 tensor-wise scaling only"
    if case.a is T.BF8 and case.b is T.BF8:
        return "cuBLASLt has no e5m2 x e5m2 product"
    return _all(_rc(case), _multiple(K=(k, 16), N=(n, 16)))


def _scaled_rowwise_req(case, m, n, k):
    if case.scheme is not Scheme.ROWCOL or (case.a, case.b) != (T.FP8, T.FP8):
        return "fp8 (e4m3 x e4m3) row-wise scaling only"
    return _all(_rc(case), _multiple(K=(k, 16), N=(n, 16)))


def _blockwise_api() -> str | None:
    if not hasattr(F, "scaled_mm"):
        return f"torch.nn.functional.scaled_mm is missing in torch {torch.__version__}"
    st = getattr(F, "ScalingType", None)
    if st is None or not all(hasattr(st, r) for r in ("BlockWise1x128", "BlockWise128x128")):
        return f"F.ScalingType.BlockWise1x128 / BlockWise128x128 are missing in torch {torch.__version__}"
    return None


def _blockwise_req(case, m, n, k):
    if case.scheme not in (Scheme.AQUANT, Scheme.ABQUANT) or (case.a, case.b) != (T.FP8, T.FP8):
        return "fp8 (e4m3) 1x128 activation blocks with 128x128 (or one) weight scales only"
    return _all(_blockwise_api(), _rc(case), _multiple(K=(k, 16), N=(n, 16)))


def _int_mm_req(case, m, n, k):
    if (case.a, case.b) != (T.I8, T.I8) or case.scheme not in (Scheme.ROWCOL, Scheme.TENSOR):
        return "int8 x int8 with per-row / per-column or tensor scales only"
    return _all(_rc(case), _multiple(K=(k, 8), N=(n, 8)))


def _dequant_matmul_req(case, m, n, k):
    if T.I4 not in (case.a, case.b):
        return "used only for int4 cases (torch has no int4 product; other cases have fused ones)"
    return None


def _int4pack_req(case, m, n, k):
    if (case.scheme, case.a, case.b) != (Scheme.BQUANT, T.BF16, T.I4):
        return "bf16 x int4 with [K/group, N] weight scales only"
    if not all(hasattr(torch, f) for f in ("_weight_int4pack_mm", "_convert_weight_to_int4pack")):
        return f"torch._weight_int4pack_mm is missing in torch {torch.__version__}"
    return _all(_rc(case), _multiple(N=(n, 8), K=(k, 32)))


def _vllm_req(case, m, n, k):
    if case.scheme not in (Scheme.ROWCOL, Scheme.TENSOR) or (case.a, case.b) not in (
        (T.I8, T.I8), (T.FP8, T.FP8)
    ):
        return "cutlass_scaled_mm: int8 or fp8 with tensor / per-row x per-column scales only"
    return _all(_rc(case), _multiple(K=(k, 16), N=(n, 16)))


def _deep_gemm_req(case, m, n, k):
    if (case.scheme, case.a, case.b) != (Scheme.ABQUANT, T.FP8, T.FP8):
        return "fp8 1x128 x 128x128 (abquant) only"
    return _all(_rc(case), _multiple(K=(k, 128), N=(n, 64)))


def _torchao_req(case, m, n, k):
    # torchao's float8 row-wise and int4 weight-only inference call torch._scaled_mm and
    # torch._weight_int4pack_mm: those are measured as torch baselines already.
    return "torchao's kernels for these schemes are torch._scaled_mm / torch._weight_int4pack_mm, measured as torch baselines"


# ----------------------------------------------------------------------------- builders


def build_tileq(ops: Operands, ctx: Context) -> Runnable:
    def gated():
        out = poisoned(ops.m, ops.n, torch.bfloat16, ctx.device)
        return ops.tileq(backend=ctx.tileq_backend, out=out)

    return Runnable(lambda: ops.tileq(backend=ctx.tileq_backend), "quantized", ops.bytes,
                    gated=gated)


def _decode_sized(case, m, n, k):
    if case.prepacked:
        return "a prepacked int4 weight has no pipeline choice (its paths: tileq bench --int4-variants)"
    if m > 64:
        return "the planner itself runs prefill above M = 64"
    return None


def build_tileq_prefill(ops: Operands, ctx: Context) -> Runnable:
    """tileq forced through the prefill pipeline: the dispatcher's decode choice must not lose."""
    def gated():
        out = poisoned(ops.m, ops.n, torch.bfloat16, ctx.device)
        return ops.gemm(backend=ctx.tileq_backend, out=out, pipeline="prefill")

    return Runnable(lambda: ops.gemm(backend=ctx.tileq_backend, pipeline="prefill"), "quantized",
                    ops.bytes, gated=gated, note="pipeline='prefill' forced")


def build_reference(ops: Operands, ctx: Context) -> Runnable:
    def gated():
        out = poisoned(ops.m, ops.n, torch.bfloat16, ctx.device)
        return ops.gemm(backend="reference", out=out)

    return Runnable(lambda: ops.gemm(backend="reference"), "quantized", ops.bytes, gated=gated)


def build_bf16_matmul(ops: Operands, ctx: Context) -> Runnable:
    x, w = ops.x, ops.w  # bf16 [M, K] row-major, [N, K]: w.t() is column-major, as in nn.Linear
    nbytes = 2 * (ops.m * ops.k + ops.n * ops.k + ops.m * ops.n)
    return Runnable(lambda: torch.matmul(x, w.t()), "float", nbytes)


def build_scaled_tensorwise(ops: Operands, ctx: Context) -> Runnable:
    a, b, sa, sb = ops.a, ops.b, ops.a_scale, ops.b_scale

    fast = ops.case.fast_accum  # same accumulation as the tileq case it is compared with

    def fn():
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    return Runnable(fn, "quantized", ops.bytes, note=f"use_fast_accum={fast}")


def build_scaled_rowwise(ops: Operands, ctx: Context) -> Runnable:
    a, b = ops.a, ops.b
    sa = ops.a_scale.reshape(ops.m, 1).contiguous()  # [M, 1] fp32
    sb = ops.b_scale.reshape(1, ops.n).contiguous()  # [1, N] fp32

    fast = ops.case.fast_accum

    def fn():
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    return Runnable(fn, "quantized", ops.bytes, note=f"use_fast_accum={fast}")


def build_blockwise(ops: Operands, ctx: Context) -> Runnable:
    """cuBLASLt 1x128 x 128x128 through F.scaled_mm, with docs/schemes.md section 6's padding."""
    m, n, k = ops.m, ops.n, ops.k
    gk, gn = -(-k // GROUP_K), -(-n // 128)
    m4 = -(-m // 4) * 4  # M must be a multiple of 4
    kb4 = -(-gk // 4) * 4  # the weight scale's kb is padded to a multiple of 4
    dev = ops.a.device
    # scale_a: (M4, Gk) with strides (1, M4). Laid out once, outside the timed region: an
    # activation-quantization kernel can write either order at no cost.
    sa_t = torch.ones(gk, m4, dtype=torch.float32, device=dev)
    sa_t[:, :m].copy_(ops.a_scale.t())
    sa = sa_t.t()
    # The weight scale [ceil(N/128), kb] (nn.Linear orientation), kb padded, passed transposed.
    w_scale = torch.ones(gn, kb4, dtype=torch.float32, device=dev)
    if ops.case.scheme is Scheme.ABQUANT:
        w_scale[:, :gk].copy_(ops.b_scale.t())
    else:  # aquant: one weight multiplier, spread over the 128x128 blocks
        w_scale[:, :gk].fill_(float(ops.b_scale.reshape(())) if ops.b_scale is not None else 1.0)
    sb = w_scale.t()
    a, b = ops.a, ops.b
    swz = getattr(F, "SwizzleType", None)
    no_swizzle = swz.NO_SWIZZLE if swz is not None else None
    rec_a, rec_b = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    note = "scale_b kb padded to a multiple of 4 (outside timing)"

    def mm(a_in):
        return F.scaled_mm(a_in, b, sa, rec_a, sb, rec_b, swizzle_a=no_swizzle,
                           swizzle_b=no_swizzle, output_dtype=torch.bfloat16)

    if m4 == m:
        return Runnable(lambda: mm(a), "quantized", ops.bytes, note=note)

    a_pad = torch.zeros(m4, k, dtype=torch.float32, device=dev).to(a.dtype)

    def fn():
        a_pad[:m].copy_(a)  # the per-call padding of M is part of what a caller pays
        return mm(a_pad)[:m]

    return Runnable(fn, "quantized", ops.bytes,
                    note=f"M padded to {m4} (a multiple of 4) inside the timed region; {note}")


def _int_mm_pieces(ops: Operands):
    a, b, m, k = ops.a, ops.b, ops.m, ops.k
    if m > 16:
        return (lambda: torch._int_mm(a, b)), ""
    a_pad = torch.zeros(17, k, dtype=torch.int8, device=a.device)

    def raw():
        a_pad[:m].copy_(a)
        return torch._int_mm(a_pad, b)[:m]

    return raw, "M padded to 17 (torch._int_mm needs M > 16) inside the timed region"


def build_int_mm_dequant(ops: Operands, ctx: Context) -> Runnable:
    raw, note = _int_mm_pieces(ops)
    sa = ops.a_scale.reshape(-1, 1) if ops.a_scale.dim() else ops.a_scale  # rows, never columns
    sb = ops.b_scale.reshape(1, -1) if ops.b_scale.dim() else ops.b_scale

    def fn():
        return (raw().float() * sa * sb).to(torch.bfloat16)

    return Runnable(fn, "quantized", ops.bytes, note=note)


def build_int_mm(ops: Operands, ctx: Context) -> Runnable:
    raw, note = _int_mm_pieces(ops)
    nbytes = storage_bytes(ops.a) + storage_bytes(ops.b) + 4 * ops.m * ops.n  # int32 output
    return Runnable(raw, "raw", nbytes, note=(note + "; " if note else "") + "int32 output, no scales")


def build_dequant_matmul(ops: Operands, ctx: Context) -> Runnable:
    from ..quant import dequantize_a, dequantize_b

    a, b, sa, sb = ops.a, ops.b, ops.a_scale, ops.b_scale
    group_n = ops.case.group_n

    def fn():
        if sa is None:
            a16 = a
        else:
            a16 = dequantize_a(a, sa, group_k=GROUP_K).to(torch.bfloat16)
        if sb is None:
            b16 = b.to(torch.bfloat16)
        else:
            b16 = dequantize_b(b, sb, group_k=GROUP_K, group_n=group_n).to(torch.bfloat16)
        return torch.matmul(a16, b16)

    return Runnable(fn, "quantized", ops.bytes,
                    note="tileq.quant dequantization (fp32) + bf16 torch.matmul, every call")


def build_int4pack(ops: Operands, ctx: Context) -> Runnable:
    """tinygemm: torch._weight_int4pack_mm. Its dequantization is (q - 8) * scale + zero, which
    with zero = 0 is tileq's pk_int4 value times the scale; its uint8 packing puts element 2j in
    the high nibble along K, as tileq's does, so the packed bytes are reused as they are."""
    k = ops.k
    inner = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
    w_u8 = ops.b.data.t().contiguous()  # logical [K, N] packed along K -> [N, K/2] bytes
    packed = torch._convert_weight_to_int4pack(w_u8, inner)
    scale = ops.b_scale  # [K/128, N]
    sz = torch.stack([scale, torch.zeros_like(scale)], dim=-1).to(torch.bfloat16).contiguous()
    x = ops.a

    def fn():
        return torch._weight_int4pack_mm(x, packed, GROUP_K, sz)

    return Runnable(fn, "quantized", ops.bytes,
                    note=f"innerKTiles={inner}; scales rounded to bf16 (tinygemm's format)")


def build_vllm(ops: Operands, ctx: Context) -> Runnable:
    from vllm import _custom_ops as vops  # noqa: PLC0415 - optional peer

    sa = ops.a_scale.reshape(-1, 1).contiguous() if ops.a_scale.dim() else ops.a_scale.reshape(1)
    sb = ops.b_scale.reshape(-1, 1).contiguous() if ops.b_scale.dim() else ops.b_scale.reshape(1)
    a, b = ops.a, ops.b
    return Runnable(lambda: vops.cutlass_scaled_mm(a, b, sa, sb, torch.bfloat16), "quantized",
                    ops.bytes, note="adapter not yet validated on hardware; the gate guards it")


def build_deep_gemm(ops: Operands, ctx: Context) -> Runnable:
    import deep_gemm  # noqa: PLC0415 - optional peer

    fn_dg = getattr(deep_gemm, "fp8_gemm_nt", None) or getattr(deep_gemm, "gemm_fp8_fp8_bf16_nt", None)
    if fn_dg is None:
        raise RuntimeError("deep_gemm: expected fp8_gemm_nt or gemm_fp8_fp8_bf16_nt, got neither")
    sfa = ops.a_scale.contiguous()
    align = getattr(deep_gemm, "get_col_major_tma_aligned_tensor", None)
    if align is not None:
        sfa = align(sfa)
    b_nk = ops.b.t()  # [N, K], K contiguous
    sfb = ops.b_scale.t().contiguous()  # [N/128, K/128]
    out = torch.empty(ops.m, ops.n, dtype=torch.bfloat16, device=ops.a.device)
    a = ops.a

    def fn():
        fn_dg((a, sfa), (b_nk, sfb), out)
        return out

    return Runnable(fn, "quantized", ops.bytes,
                    note="adapter not yet validated on hardware; the gate guards it")


def _unreachable(ops, ctx):  # torchao is always N/A (see _torchao_req)
    raise RuntimeError("torchao: no adapter (its kernels are measured as torch baselines)")


REGISTRY: tuple[Impl, ...] = (
    Impl("tileq", "tileq", "tileq.gemm (Triton kernels; the interpreter on CPU)", _always, build_tileq),
    # Not a baseline (kind 'pipeline' is outside SAME_MATH_KINDS): the dispatcher check.
    Impl("tileq_prefill", "pipeline", "tileq.gemm with pipeline='prefill' forced (M <= 64 only)",
         _decode_sized, build_tileq_prefill),
    Impl("torch_bf16_matmul", "unquantized", "bf16 torch.matmul on the unquantized X, W",
         _always, build_bf16_matmul, shared=True),
    Impl("torch_scaled_mm_tensor", "fused", "torch._scaled_mm, tensor-wise scales (cuBLASLt)",
         _scaled_tensorwise_req, build_scaled_tensorwise, cuda_only=True),
    Impl("torch_scaled_mm_rowwise", "fused", "torch._scaled_mm, row-wise scales [M,1] x [1,N] (cuBLASLt)",
         _scaled_rowwise_req, build_scaled_rowwise, cuda_only=True),
    Impl("torch_scaled_mm_blockwise", "fused",
         "F.scaled_mm BlockWise1x128 x BlockWise128x128 (cuBLASLt)", _blockwise_req,
         build_blockwise, cuda_only=True),
    Impl("torch_int_mm_dequant", "unfused", "torch._int_mm + torch dequantization",
         _int_mm_req, build_int_mm_dequant, cuda_only=True),
    Impl("torch_int_mm", "raw", "torch._int_mm alone (int32 output, no dequantization)",
         _int_mm_req, build_int_mm, cuda_only=True),
    Impl("torch_int4pack_mm", "fused", "torch._weight_int4pack_mm (tinygemm; torchao's int4 path)",
         _int4pack_req, build_int4pack, cuda_only=True),
    Impl("torch_dequant_matmul", "unfused", "dequantize to bf16 in torch, then torch.matmul",
         _dequant_matmul_req, build_dequant_matmul),
    Impl("vllm_cutlass_scaled_mm", "peer", "vLLM cutlass_scaled_mm", _vllm_req, build_vllm,
         cuda_only=True, module="vllm"),
    Impl("deep_gemm_fp8", "peer", "DeepGEMM fp8 1x128 x 128x128", _deep_gemm_req, build_deep_gemm,
         cuda_only=True, module="deep_gemm"),
    Impl("torchao", "peer", "torchao", _torchao_req, _unreachable, cuda_only=True, module="torchao"),
    Impl("reference", "reference", "tileq's torch reference (float64 products)", _always,
         build_reference, default=False),
)

BY_NAME = {impl.name: impl for impl in REGISTRY}


def select(names: list[str] | None) -> tuple[Impl, ...]:
    """tileq plus the named baselines (default: every default entry), in registry order."""
    from ..errors import UnsupportedError, expect

    if names is None:
        return tuple(i for i in REGISTRY if i.default)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise UnsupportedError(expect("baselines", f"names from {', '.join(BY_NAME)}", ", ".join(unknown)))
    wanted = set(names) | {"tileq"}
    return tuple(i for i in REGISTRY if i.name in wanted)
