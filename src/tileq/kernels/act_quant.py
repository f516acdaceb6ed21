"""Launchers of the activation-quantization kernels (``act_quant_kernel.py``) and their torch
references.

A launch object is built once per call signature (shapes, strides, dtypes, device, options) and
holds the grid, integer arguments and constexprs as a ``direct.KernelCall``: a repeated call only
allocates its outputs and launches (on a GPU straight through the compiled kernel's launcher,
as ``launch.GemmLaunch`` does). ``tileq.activation`` keeps them in a bounded cache.

The torch references compute the same function with the same operations (``quant``'s block amax
and expansion, IEEE divisions), so on finite rows they equal ``tileq.quant.quantize_a`` bit for
bit; rows or groups holding NaN/inf get a NaN scale and q = 0, as the kernels do.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from .. import quant
from ..dtypes import OperandType

from .act_quant_kernel import _add_rmsnorm_quantize_kernel, _quantize_activation_kernel  # noqa: F401
from .direct import KernelCall, direct_launch_enabled

_THIS = sys.modules[__name__]  # KernelCall looks the kernels up here at call time (tests stub them)

GRANULARITIES = ("row", "group", "tensor")
FUSED_GRANULARITIES = ("row", "group")
OUT_TYPES = (OperandType.I8, OperandType.FP8, OperandType.BF8)
_FLT_MAX = torch.finfo(torch.float32).max

# Register budget of a program holding a whole row (or its groups): 32768 fp32 values is 64 per
# thread at 16 warps; longer 'row'/'tensor' rows take the two-pass loop over LOOP_CHUNK elements.
MAX_REGISTER_ELEMS = 32768
LOOP_CHUNK = 8192
_X_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ActQuantConfig:
    """How a program covers its part of a row: a head piece [hr, hc] and an optional tail
    [tr, tc] held in registers (for groups a piece row is one group of ``hc`` >= group_k
    padded), or, when ``loop_c`` > 0, a two-pass loop over chunks of ``loop_c``; ``grid_k``
    programs per row."""

    hr: int
    hc: int
    tr: int
    tc: int
    loop_c: int
    num_warps: int
    grid_k: int

    @property
    def elems(self) -> int:
        return self.loop_c if self.loop_c else self.hr * self.hc + self.tr * self.tc


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def config_ok(cfg: ActQuantConfig, k: int, granularity: str, group_k: int) -> bool:
    """The one legality predicate: power-of-two pieces covering every element (and group) of a
    row exactly once per program layout, within the register budget."""
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.grid_k < 1:
        return False
    if cfg.loop_c:
        return granularity != "group" and _is_pow2(cfg.loop_c) and cfg.grid_k == 1
    if not (_is_pow2(cfg.hr) and _is_pow2(cfg.hc)) or cfg.elems > MAX_REGISTER_ELEMS:
        return False
    if cfg.tr and not (_is_pow2(cfg.tr) and _is_pow2(cfg.tc)):
        return False
    if granularity == "group":
        n_groups = -(-k // group_k)
        width_ok = cfg.hc >= min(group_k, k) and (not cfg.tr or cfg.tc == cfg.hc)
        return width_ok and cfg.grid_k * cfg.hr + cfg.tr >= n_groups
    return cfg.hr == 1 and cfg.tr in (0, 1) and cfg.grid_k == 1 and cfg.hc + cfg.tc >= k


# ----------------------------------------------------------------------------- launches


def _pdl_kwargs(pdl: bool) -> dict:
    """The kernel's PDL constexpr and, when on, Triton's launch option."""
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)


def _pointer_dtype(t):
    return None if t is None else t.dtype


class ActQuantLaunch:
    """``quantize_activation`` for one call signature: x rows [M, K] with row stride
    ``row_stride``, outputs q (contiguous, x's leading shape) and s (fp32 [M] or [M, Gk] with
    the given strides)."""

    __slots__ = ("call", "direct", "q_shape", "q_dtype", "s_shape", "s_strides", "device",
                 "ptr_dtypes")

    def __init__(self, *, x_shape, device, m: int, k: int, row_stride: int, x_dtype, otype,
                 granularity: str, group_k: int, s_shape, s_strides, scale_dtype, scale_val: float,
                 interpreted: bool, cfg: ActQuantConfig, pdl: bool):
        grouped = granularity == "group"
        self.q_shape, self.q_dtype = tuple(x_shape), otype.torch_dtype
        self.s_shape, self.s_strides, self.device = tuple(s_shape), tuple(s_strides), device
        stride_sm = s_strides[0]
        stride_sg = s_strides[1] if grouped else 0
        consts = dict(
            GRANULARITY=granularity, OUT_TYPE=otype.value, QMAX=quant.QMAX[otype], EPS=quant._EPS,
            GROUP_K=group_k if grouped else 1, HR=cfg.hr, HC=cfg.hc, TR=cfg.tr, TC=cfg.tc,
            LOOP_C=cfg.loop_c, INTERPRETED=interpreted, num_warps=cfg.num_warps, num_stages=1,
            **_pdl_kwargs(pdl),
        )
        ints = (float(scale_val), k, row_stride, stride_sm, stride_sg)
        dtypes = (x_dtype, otype.torch_dtype, torch.float32, scale_dtype)
        self.call = KernelCall(_THIS, "_quantize_activation_kernel", (m, cfg.grid_k), ints, consts,
                               dtypes)
        self.ptr_dtypes = dtypes
        # Straight through the compiled kernel's launcher only on a GPU, never interpreted.
        self.direct = device.type == "cuda" and not interpreted

    def outputs(self):
        q = torch.empty(self.q_shape, dtype=self.q_dtype, device=self.device)
        s = torch.empty_strided(self.s_shape, self.s_strides, dtype=torch.float32, device=self.device)
        return q, s

    def __call__(self, x, scale, out):
        q, s = self.outputs() if out is None else out
        self.call((x, q, s, scale), self.direct and direct_launch_enabled())
        return q, s


class AddRmsNormQuantLaunch:
    """``add_rmsnorm_quantize`` for one call signature; residual_out is a new contiguous tensor
    of x's shape (none without a residual)."""

    __slots__ = ("call", "direct", "q_shape", "q_dtype", "s_shape", "s_strides", "device",
                 "x_dtype", "has_residual", "ptr_dtypes")

    def __init__(self, *, x_shape, device, m: int, k: int, x_stride: int, r_stride: int | None,
                 x_dtype, otype, granularity: str, group_k: int, s_shape, s_strides, eps: float,
                 interpreted: bool, cfg: ActQuantConfig, pdl: bool):
        grouped = granularity == "group"
        self.q_shape, self.q_dtype, self.x_dtype = tuple(x_shape), otype.torch_dtype, x_dtype
        self.s_shape, self.s_strides, self.device = tuple(s_shape), tuple(s_strides), device
        self.has_residual = r_stride is not None
        consts = dict(
            GRANULARITY=granularity, X_TYPE=_X_TYPES[x_dtype], OUT_TYPE=otype.value,
            QMAX=quant.QMAX[otype], EPS=quant._EPS, GROUP_K=group_k if grouped else 1,
            HR=cfg.hr, HC=cfg.hc, TR=cfg.tr, TC=cfg.tc, INTERPRETED=interpreted,
            num_warps=cfg.num_warps, num_stages=1, **_pdl_kwargs(pdl),
        )
        ints = (float(eps), k, x_stride, r_stride or 0, s_strides[0], s_strides[1] if grouped else 0)
        rdt = x_dtype if self.has_residual else None
        dtypes = (x_dtype, rdt, x_dtype, rdt, otype.torch_dtype, torch.float32)
        self.call = KernelCall(_THIS, "_add_rmsnorm_quantize_kernel", (m, 1), ints, consts, dtypes)
        self.ptr_dtypes = dtypes
        self.direct = device.type == "cuda" and not interpreted

    def __call__(self, x, residual, weight):
        q = torch.empty(self.q_shape, dtype=self.q_dtype, device=self.device)
        s = torch.empty_strided(self.s_shape, self.s_strides, dtype=torch.float32, device=self.device)
        h = x
        if self.has_residual:
            h = torch.empty(self.q_shape, dtype=self.x_dtype, device=self.device)
        self.call((x, residual, weight, h if self.has_residual else None, q, s),
                  self.direct and direct_launch_enabled())
        return q, s, h


# ----------------------------------------------------------------------------- AOT builds

_TRITON_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
               torch.int8: "*i8", torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}
_FLOAT_ARGS = ("scale_val", "eps")


def aot_source(launch):
    """(JITFunction, signature, constexprs, attrs, options) to ``triton.compile`` what ``launch``
    runs, on any machine (Triton must not be in interpreter mode). attrs mark the pointers and
    the integer arguments that are multiples of 16 as the JIT does for aligned tensors."""
    import triton

    call = launch.call
    fn = getattr(_THIS, call.name)
    names = [p.name for p in fn.params]
    n_ptr = len(launch.ptr_dtypes)
    sig, consts = {}, {}
    for name, dt in zip(names, launch.ptr_dtypes):
        sig[name] = "constexpr" if dt is None else _TRITON_PTR[dt]
        if dt is None:
            consts[name] = None
    aligned = [names[i] for i, dt in enumerate(launch.ptr_dtypes) if dt is not None]
    for name, v in zip(names[n_ptr:], call.ints):
        sig[name] = "fp32" if name in _FLOAT_ARGS else "i32"
        if name not in _FLOAT_ARGS and v % 16 == 0:
            aligned.append(name)
    options = {k: v for k, v in call.kwargs.items() if k in ("num_warps", "num_stages", "launch_pdl")}
    for name, v in call.kwargs.items():
        if name not in options:
            sig[name], consts[name] = "constexpr", v
    order = list(sig)
    attrs = {(order.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return src, options


def aot_compile(launch, capability: int = 90) -> dict:
    """Compile ``launch``'s kernel for sm_<capability>; returns its PTX and cubin and the
    registers / spill bytes cuobjdump reports (None where the tool is missing)."""
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget

    from .binary import resource_usage

    src, options = aot_source(launch)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        regs, spills = resource_usage(path)
    return dict(ptx=compiled.asm["ptx"], registers=regs, spills=spills,
                shared=int(compiled.metadata.shared), num_warps=options["num_warps"])


# ----------------------------------------------------------------------------- references


def quantize_activation_ref(x2d: torch.Tensor, otype: OperandType, granularity: str,
                            group_k: int = 128, scale=None):
    """(q [M, K], s) in torch: s fp32 [M] ('row', 'tensor') or row-major [M, Gk] ('group').

    Finite rows: ``quant.quantize_a``'s operations exactly. A row ('tensor', 'row') or group
    holding NaN/inf: NaN scale, q = 0. 'tensor' takes ``scale`` (a Python float or a one-element
    tensor); an unusable one (not positive and finite) makes every row's scale NaN.
    """
    xf = x2d.float()
    m, k = xf.shape
    qmax = quant.QMAX[otype]
    if granularity == "tensor":
        st = (scale.float() if isinstance(scale, torch.Tensor) else xf.new_tensor(float(scale)))
        st = st.reshape(()).to(xf.device)
        amax = xf.abs().amax(dim=1) if k else xf.new_zeros(m)  # amax propagates NaN
        bad = ~(amax <= _FLT_MAX) | ~((st > 0) & (st <= _FLT_MAX))
        s = torch.where(bad, torch.full_like(amax, float("nan")), st.expand(m))
        y = xf / st
        bad_e = bad[:, None]
    else:
        block = (1, None) if granularity == "row" else (1, group_k)
        amax = quant._block_amax(xf.abs(), block)  # [M, 1] or [M, Gk]; NaN propagates
        bad = ~(amax <= _FLT_MAX)
        s = (amax / amax.new_tensor(qmax)).clamp_min(quant._EPS)
        s = torch.where(bad, torch.full_like(s, float("nan")), s)
        s_e = quant._expand(s, block, xf.shape)
        y = xf / s_e
        bad_e = torch.isnan(s_e)
        if granularity == "row":
            s = s.reshape(m)
    y = torch.where(bad_e, torch.zeros_like(y), y).clamp(-qmax, qmax)
    if otype.is_float8:
        return y.to(otype.torch_dtype), s
    return torch.round(y).to(torch.int8), s  # torch.round rounds half to even


def rms_normalize_ref(x2d: torch.Tensor, residual2d, weight: torch.Tensor, eps: float):
    """(normed, h): h = x + residual in x's dtype (x itself without residual), normed =
    weight * (h.float() * rstd).to(x dtype) with rstd = 1 / sqrt(mean(h.float()**2) + eps),
    each step rounded to nearest (transformers' formula with its rsqrt taken as 1 / sqrt)."""
    h = x2d if residual2d is None else (x2d.float() + residual2d.float()).to(x2d.dtype)
    hf = h.float()
    var = hf.pow(2).mean(-1, keepdim=True)
    rstd = torch.reciprocal(torch.sqrt(var + eps))
    normed = weight * (hf * rstd).to(x2d.dtype)
    return normed, h


def add_rmsnorm_quantize_ref(x2d, residual2d, weight, eps: float, otype: OperandType,
                             granularity: str = "row", group_k: int = 128):
    """(q, s, h) in torch: ``rms_normalize_ref`` then ``quantize_activation_ref``."""
    normed, h = rms_normalize_ref(x2d, residual2d, weight, eps)
    q, s = quantize_activation_ref(normed, otype, granularity, group_k)
    return q, s, h
