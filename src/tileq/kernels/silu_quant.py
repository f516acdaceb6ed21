"""Fused SiLU·mul + activation quantization: the kernel, its launcher and its torch reference.

Input gate_up [M, 2I] (bf16 / fp16 / fp32), gate = columns [0, I), up = columns [I, 2I) (transformers'
merged gate_up and tileq's fused decoder lay it out so). The kernel computes h = silu(gate) * up
exactly as torch does in x's dtype (``act_fn(gate) * up``): silu(g) = g / (1 + exp(-g)) in fp32,
rounded to x's dtype, times up in fp32, rounded again; then quantizes h as
``_quantize_activation_kernel`` does ('row' or 'group'), through the same @triton.jit helpers. h is
never written to memory.

Exactness: exp is libdevice's expf (CUDA's own, what torch's GPU silu calls) and the division is
IEEE, so h equals torch's h except where the two exps differ by an ulp and that ulp moves the bf16
rounding (rare); then (q, s) equal ``quantize_activation(h)`` bit for bit.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import quant
from .act_quant import _X_TYPES, ActQuantConfig, quantize_activation_ref
from .act_quant_kernel import _finish_pieces, _piece, _round_to, _to_f32
from .direct import KernelCall, direct_launch_enabled

_THIS = sys.modules[__name__]
GRANULARITIES = ("row", "group")


@triton.jit
def _silu_mul(x_row, k, ok, I, X_TYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """h = silu(gate) * up at columns k of one row, each step rounded to x's dtype as torch does."""
    g = _to_f32(tl.load(x_row + k, mask=ok, other=0.0), INTERPRETED)
    u = _to_f32(tl.load(x_row + I + k, mask=ok, other=0.0), INTERPRETED)
    if INTERPRETED:
        e = tl.exp(-g)  # numpy's exp
    else:
        e = libdevice.exp(-g)  # __nv_expf, not tl.exp's ex2.approx
    a = _round_to(tl.math.div_rn(g, 1.0 + e), X_TYPE, INTERPRETED)
    return _round_to(_to_f32(a, INTERPRETED) * u, X_TYPE, INTERPRETED)


@triton.jit
def _silu_mul_quantize_kernel(
    x_ptr, q_ptr, s_ptr,
    I, stride_xm, stride_sm, stride_sg,
    GRANULARITY: tl.constexpr, X_TYPE: tl.constexpr, OUT_TYPE: tl.constexpr, QMAX: tl.constexpr,
    EPS: tl.constexpr, GROUP_K: tl.constexpr, HR: tl.constexpr, HC: tl.constexpr, TR: tl.constexpr,
    TC: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Grid (M, programs along I): program (m, g) computes and quantizes row m's groups
    g*HR .. g*HR+HR-1 ('group') or the whole row m ('row'). q is contiguous [M, I]; the scale of
    row m, group j lives at s_ptr + m * stride_sm + j * stride_sg."""
    m = tl.program_id(0).to(tl.int64)
    pid_g = tl.program_id(1)
    x_row = x_ptr + m * stride_xm
    GROUPED: tl.constexpr = GRANULARITY == "group"
    if GROUPED:
        base = pid_g * (HR * GROUP_K)
        tail = base + HR * GROUP_K
    else:
        base = 0
        tail = HC
    kh, okh = _piece(base, HR, HC, GROUPED, GROUP_K, I)
    vh = _silu_mul(x_row, kh, okh, I, X_TYPE, INTERPRETED)
    kt, okt, vt = kh, okh, vh
    if TR > 0:
        kt, okt = _piece(tail, TR, TC, GROUPED, GROUP_K, I)
        vt = _silu_mul(x_row, kt, okt, I, X_TYPE, INTERPRETED)
    _finish_pieces(q_ptr + m * I, s_ptr + m * stride_sm, stride_sg, I, pid_g, kh, okh, vh, kt, okt, vt,
                   GRANULARITY, OUT_TYPE, QMAX, EPS, GROUP_K, HR, TR, 1.0, False, INTERPRETED)


class SiluMulQuantLaunch:
    """``silu_mul_quantize`` for one call signature: gate_up rows [M, 2I] with row stride
    ``row_stride``; outputs q (contiguous, shape ``q_shape``) and s (fp32 [M] or [M, Gk] with the
    given strides)."""

    __slots__ = ("call", "device", "direct", "ptr_dtypes", "q_dtype", "q_shape", "s_shape", "s_strides")

    def __init__(self, *, q_shape, device, m: int, i: int, row_stride: int, x_dtype, otype,
                 granularity: str, group_k: int, s_shape, s_strides, interpreted: bool,
                 cfg: ActQuantConfig):
        grouped = granularity == "group"
        self.q_shape, self.q_dtype = tuple(q_shape), otype.torch_dtype
        self.s_shape, self.s_strides, self.device = tuple(s_shape), tuple(s_strides), device
        consts = {
            "GRANULARITY": granularity, "X_TYPE": _X_TYPES[x_dtype], "OUT_TYPE": otype.value,
            "QMAX": quant.QMAX[otype], "EPS": quant._EPS, "GROUP_K": group_k if grouped else 1,
            "HR": cfg.hr, "HC": cfg.hc, "TR": cfg.tr, "TC": cfg.tc, "INTERPRETED": interpreted,
            "num_warps": cfg.num_warps, "num_stages": 1,
        }
        ints = (i, row_stride, s_strides[0], s_strides[1] if grouped else 0)
        dtypes = (x_dtype, otype.torch_dtype, torch.float32)
        self.call = KernelCall(_THIS, "_silu_mul_quantize_kernel", (m, cfg.grid_k), ints, consts, dtypes)
        self.ptr_dtypes = dtypes
        self.direct = device.type == "cuda" and not interpreted

    def __call__(self, x):
        q = torch.empty(self.q_shape, dtype=self.q_dtype, device=self.device)
        s = torch.empty_strided(self.s_shape, self.s_strides, dtype=torch.float32, device=self.device)
        self.call((x, q, s), self.direct and direct_launch_enabled())
        return q, s


def silu_mul_ref(x2d: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up in x's dtype, as transformers' ``act_fn(gate) * up`` computes it."""
    gate, up = x2d.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul_quantize_ref(x2d: torch.Tensor, otype, granularity: str, group_k: int = 128):
    """(q [M, I], s) in torch: ``silu_mul_ref`` then ``quantize_activation_ref``."""
    return quantize_activation_ref(silu_mul_ref(x2d), otype, granularity, group_k)


def aot_source(launch: SiluMulQuantLaunch):
    """(ASTSource, options) to ``triton.compile`` what ``launch`` runs on any machine (Triton not
    in interpreter mode); integer arguments that are multiples of 16 are marked as the JIT does."""
    call = launch.call
    fn = _silu_mul_quantize_kernel
    names = [p.name for p in fn.params]
    sig = {n: {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
               torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}[dt]
           for n, dt in zip(names, launch.ptr_dtypes)}
    aligned = list(sig)
    for name, v in zip(names[len(sig):], call.ints):
        sig[name] = "i32"
        if v % 16 == 0:
            aligned.append(name)
    options = {k: v for k, v in call.kwargs.items() if k in ("num_warps", "num_stages")}
    consts = {k: v for k, v in call.kwargs.items() if k not in options}
    sig.update({k: "constexpr" for k in consts})
    order = list(sig)
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), options
