"""Activation quantization on the hot path: one kernel launch per call, no host synchronization,
nothing allocated but the outputs, capturable in a CUDA graph (docs/schemes.md section 4).

``quantize_activation(x, dtype, granularity=...)`` returns ``(q, s)`` in the form ``tileq.gemm``
and ``tileq.linear`` take: ``scheme="rowcol"`` for 'row' and 'tensor' (s is fp32 [M]),
``scheme="aquant"``/``"abquant"`` for 'group' (s is fp32 [M, Gk], row-major or preshuffled).
``add_rmsnorm_quantize`` fuses a residual add and transformers' RMSNorm in front of it;
``silu_mul_quantize`` fuses a gated MLP's ``silu(gate) * up`` in front of it.

On finite data the result equals ``tileq.quant.quantize_a`` bit for bit. NaN policy: a row
('row', 'tensor') or a group ('group') holding NaN or ±inf gets a NaN scale and q = 0 there, so
the GEMM's outputs of that row are NaN: never an exception, never finite garbage. Checking mode
(``check=True``, or ``check=None`` with ``TILEQ_CHECK_FINITE=1``) raises the offline helper's
ScaleError instead; it synchronizes.

A call's signature (shapes, strides, dtypes, devices, options; never tensor values or data
pointers) keys a bounded cache of launch objects (``kernels/act_quant.py``): a repeated call
only allocates its outputs and launches.
"""

from __future__ import annotations

import math

import torch

from . import quant
from . import settings
from ._runtime import bounded_put, env_raw
from .dtypes import OperandType, parse_operand_type
from .errors import ArchError, DTypeError, LayoutError, ScaleError, ShapeError, UnsupportedError, expect
from .kernels import act_quant as _aq
from .kernels import silu_quant as _sq
from .device import facts as device_facts
from .dispatch.act_quant import act_quant_config, keeps_outputs
from .dispatch.pdl import pdl_enabled
from .dispatch.plan import resolve_backend

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE: dict = {}
_CACHE_CAP = 1024


# ----------------------------------------------------------------------------- public functions


def quantize_activation(x, dtype, *, granularity="row", group_k=128, scale=None, preshuffled=False,
                        check=None, out=None, backend=None):
    """Quantize activations x [..., K] (bf16/fp16/fp32) to int8 / fp8 / bf8; returns (q, s).

    - ``granularity='row'``: dynamic per-token scales, s fp32 [M] (M = prod of leading dims).
    - ``'group'``: dynamic 1×group_k scales, s fp32 [M, Gk] (Gk = ceil(K / group_k), the last
      group partial), row-major or, with ``preshuffled=True``, K-group-major (strides (1, M)).
    - ``'tensor'``: a static calibrated ``scale`` (0-d / one-element tensor, read on the device,
      or a Python float); s is fp32 [M] holding it for every row (NaN for a row with NaN/inf).

    q has x's shape and is contiguous. ``out=(q, s)`` writes into preallocated outputs of exactly
    those shapes, dtypes and strides. x's last dimension must have unit stride and its leading
    dimensions must flatten to rows of one stride (never copied). ``backend``: 'auto' (Triton on
    CUDA tensors, the torch reference on CPU), 'triton', 'reference'.
    """
    checking = _checking(check)
    try:
        key = ("q", _tensor_key(x), dtype, granularity, group_k.__class__, group_k,
               _scale_key(scale), preshuffled.__class__, preshuffled, _out_key(out), backend,
               settings.key())
        launch = _CACHE.get(key)
    except (TypeError, AttributeError):  # unhashable or odd arguments: validation reports them
        key, launch = None, None
    if launch is None:
        launch = _build_quantize(x, dtype, granularity, group_k, scale, preshuffled, out, backend)
        if key is not None:
            bounded_put(_CACHE, key, launch, _CACHE_CAP)
    if checking:
        _check_values(x, scale)
    return launch(x, scale if isinstance(scale, torch.Tensor) else None, out)


def add_rmsnorm_quantize(x, residual, weight, eps, dtype, *, granularity="row", group_k=128,
                         preshuffled=False, check=None, backend=None):
    """h = x + residual (in x's dtype; ``residual=None``: h = x), then transformers' RMSNorm
    ``weight * (h.float() * rsqrt(mean(h.float()**2, -1) + eps)).to(x.dtype)``, quantized as
    ``quantize_activation`` would ('row' or 'group'), in one launch. Returns
    ``(q, s, residual_out)``: residual_out is h (a new tensor), or x itself without residual.

    The kernel takes rsqrt as 1 / sqrt, both rounded to nearest, and sums the squares in its own
    order: its normalized values may differ from torch's by one ulp of x's dtype.
    """
    checking = _checking(check)
    try:
        key = ("n", _tensor_key(x), _tensor_key(residual) if residual is not None else None,
               _tensor_key(weight), eps.__class__, eps, dtype, granularity, group_k.__class__,
               group_k, preshuffled.__class__, preshuffled, backend, settings.key())
        launch = _CACHE.get(key)
    except (TypeError, AttributeError):
        key, launch = None, None
    if launch is None:
        launch = _build_fused(x, residual, weight, eps, dtype, granularity, group_k, preshuffled,
                              backend)
        if key is not None:
            bounded_put(_CACHE, key, launch, _CACHE_CAP)
    if checking:
        normed, _ = _aq.rms_normalize_ref(_rows(x), None if residual is None else _rows(residual),
                                          weight, float(eps))
        quant._check_finite(normed, "add_rmsnorm(x, residual, weight)")
    return launch(x, residual, weight)


def silu_mul_quantize(gate_up, dtype, *, granularity="row", group_k=128, preshuffled=False,
                      check=None, backend=None):
    """h = silu(gate) * up from gate_up [..., 2I] (gate = the first I columns, up = the last I, in
    x's dtype as transformers' ``act_fn(gate) * up`` computes it), quantized as
    ``quantize_activation(h, dtype, ...)`` would ('row' or 'group'), in one launch; h is never
    stored. Returns ``(q, s)``: q [..., I] contiguous, s fp32 [M] or [M, Gk] (preshuffled:
    strides (1, M)).

    h equals torch's bit for bit except where the kernel's exp and torch's differ by an ulp that
    moves a rounding (rare; the quantized value then moves by at most one step).
    """
    checking = _checking(check)
    try:
        key = ("s", _tensor_key(gate_up), dtype, granularity, group_k.__class__, group_k,
               preshuffled.__class__, preshuffled, backend, settings.key())
        launch = _CACHE.get(key)
    except (TypeError, AttributeError):
        key, launch = None, None
    if launch is None:
        launch = _build_silu(gate_up, dtype, granularity, group_k, preshuffled, backend)
        if key is not None:
            bounded_put(_CACHE, key, launch, _CACHE_CAP)
    if checking:
        quant._check_finite(_sq.silu_mul_ref(_rows(gate_up)), "silu(gate) * up")
    return launch(gate_up)


def checks_values() -> bool:
    """Whether the quantizing calls check their values by default (TILEQ_CHECK_FINITE=1: they
    synchronize, and a call traced into a compiled graph cannot)."""
    return _checking(None)


def quantize_launch(x, dtype, *, granularity, group_k, scale):
    """(launch, kept) for a caller that keeps the Triton launch ``quantize_activation`` makes for
    this call signature (QuantLinear's runner): call it as ``launch(x, scale if it is a tensor else
    None, kept)``. ``kept``: outputs (q, s) it writes on every call, for calls of decode sizes
    (``dispatch.act_quant.keeps_outputs``), else None (each call allocates its own;
    ``launch.outputs()`` makes a pair). None when the call launches no Triton kernel (reference
    executor, M = 0, K = 0)."""
    launch = _build_quantize(x, dtype, granularity, group_k, scale, False, None, None)
    if not isinstance(launch, _aq.ActQuantLaunch):
        return None
    m = x.numel() // x.shape[-1]
    arch = _arch(x.device, resolve_backend(None, x.device)[1])
    return launch, launch.outputs() if keeps_outputs(m, arch) else None


# ----------------------------------------------------------------------------- call keys


def _tensor_key(t):
    if not isinstance(t, torch.Tensor):
        raise TypeError
    return (t.shape, t.stride(), t.dtype, t.device)


def _scale_key(scale):
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        return ("t",) + _tensor_key(scale)
    if type(scale) in (float, int):
        return ("f", float(scale))  # the value is a kernel argument fixed per launch object
    raise TypeError


def _out_key(out):
    if out is None:
        return None
    if type(out) not in (tuple, list) or len(out) != 2:
        raise TypeError
    return (_tensor_key(out[0]), _tensor_key(out[1]))


def _checking(check) -> bool:
    if check is None:
        return env_raw("TILEQ_CHECK_FINITE") is not None and settings.current().check_finite
    if check is True or check is False:
        return check
    raise ScaleError(expect("check", "None, True or False", repr(check)))


# ----------------------------------------------------------------------------- validation


def _out_type(dtype) -> OperandType:
    otype = None
    if isinstance(dtype, (str, torch.dtype, OperandType)):
        try:
            otype = parse_operand_type(dtype)
        except DTypeError:
            pass
    if otype not in _aq.OUT_TYPES:
        raise DTypeError(expect(
            "dtype", "'int8', 'fp8' or 'bf8' (or torch.int8, torch.float8_e4m3fn, "
            "torch.float8_e5m2)", repr(dtype)))
    return otype


def _check_x(x, arg: str = "x") -> tuple[int, int, int]:
    """(M, K, row stride) of an activation [..., K]; refuses what would need a copy."""
    if not isinstance(x, torch.Tensor):
        raise DTypeError(expect(arg, "a torch.Tensor", type(x).__name__))
    if x.dtype not in _X_DTYPES:
        raise DTypeError(expect(arg, "dtype bfloat16, float16 or float32", x.dtype))
    if x.dim() < 1:
        raise ShapeError(expect(arg, "a tensor of shape [..., K] (at least 1-D)", f"shape {tuple(x.shape)}"))
    shape, strides = tuple(x.shape), x.stride()
    k = shape[-1]
    if k > 1 and strides[-1] != 1:
        raise LayoutError(expect(arg, "unit stride along the last dimension (K); tileq never copies",
                                 f"shape {shape} with strides {strides}"))
    row = nxt = None
    if x.numel() == 0:  # nothing is read
        return math.prod(shape[:-1]), k, k
    for size, st in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if row is None:
            row, nxt = st, st * size
        elif st != nxt:
            raise LayoutError(expect(
                arg, "leading dimensions that flatten to rows of a single stride (tileq never "
                "copies)", f"shape {shape} with strides {strides}"))
        else:
            nxt = st * size
    return math.prod(shape[:-1]), k, (k if row is None else row)


def _check_granularity(granularity, allowed) -> str:
    if not isinstance(granularity, str) or granularity not in allowed:
        valid = ", ".join(repr(g) for g in allowed)
        raise ScaleError(expect("granularity", f"one of {valid}", repr(granularity)))
    return granularity


def _check_preshuffled(preshuffled, granularity: str) -> bool:
    if preshuffled is not True and preshuffled is not False:
        raise ScaleError(expect("preshuffled", "True or False", repr(preshuffled)))
    if preshuffled and granularity != "group":
        raise ScaleError(expect("preshuffled", f"False for granularity {granularity!r} "
                                "(only group scales have a storage order)", True))
    return preshuffled


def _scale_layout(m: int, k: int, granularity: str, group_k: int, preshuffled: bool):
    """(shape, strides) of s as this module allocates it."""
    if granularity != "group":
        return (m,), (1,)
    gk = -(-k // group_k)
    if preshuffled:
        return (m, gk), (1, max(m, 1))  # quant.preshuffle_scale's strides
    return (m, gk), (max(gk, 1), 1)


def _check_static_scale(scale, granularity: str, device):
    """The static scale's (pointer dtype, value for a Python float)."""
    if granularity != "tensor":
        if scale is not None:
            raise ScaleError(expect("scale", f"None for granularity {granularity!r} (a calibrated "
                                    "scale needs granularity='tensor')", type(scale).__name__))
        return None, 1.0
    if scale is None:
        raise ScaleError(expect("scale", "a calibrated scale for granularity 'tensor' (0-d or "
                                "one-element fp32 tensor, or a Python float)", None))
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ShapeError(expect("scale", "a 0-d or one-element tensor", f"shape {tuple(scale.shape)}"))
        if scale.dtype not in _SCALE_DTYPES:
            raise DTypeError(expect("scale", "dtype float32, bfloat16 or float16", scale.dtype))
        if scale.device != device:
            raise UnsupportedError(expect("scale", f"a tensor on {device} (the device of x)", scale.device))
        return scale.dtype, 1.0
    if type(scale) not in (float, int) or not 0 < scale < math.inf:
        raise ScaleError(expect("scale", "a positive finite number or a one-element tensor", repr(scale)))
    return None, float(scale)


def _check_out(out, x_shape, otype, s_shape, s_strides, device):
    if type(out) not in (tuple, list) or len(out) != 2:
        raise ShapeError(expect("out", "a pair (q, s) of tensors", type(out).__name__))
    q, s = out
    for name, t, dt in (("out[0]", q, otype.torch_dtype), ("out[1]", s, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(expect(name, "a torch.Tensor", type(t).__name__))
        if t.device != device:
            raise UnsupportedError(expect(name, f"a tensor on {device} (the device of x)", t.device))
        if t.dtype != dt:
            raise DTypeError(expect(name, f"dtype {dt}", t.dtype))
    if tuple(q.shape) != tuple(x_shape):
        raise ShapeError(expect("out[0]", f"shape {tuple(x_shape)} (x's)", tuple(q.shape)))
    if not q.is_contiguous():
        raise LayoutError(expect("out[0]", "a contiguous tensor", f"strides {q.stride()}"))
    if tuple(s.shape) != tuple(s_shape):
        raise ShapeError(expect("out[1]", f"shape {tuple(s_shape)}", tuple(s.shape)))
    if any(n > 1 and a != b for n, a, b in zip(s_shape, s.stride(), s_strides)):
        raise LayoutError(expect("out[1]", f"strides {tuple(s_strides)}", s.stride()))


def _check_arch(device, otype) -> None:
    if device.type == "cuda" and otype.is_float8:
        cap = device_facts(device).arch.capability
        if cap < (8, 9):
            raise ArchError(expect("dtype", f"int8 on sm_{cap[0]}{cap[1]} (fp8/bf8 conversions need "
                                   "sm_89 or newer)", str(otype)))


def _check_finite_x(x):
    quant._check_finite(x, "x")


def _check_values(x, scale) -> None:
    """Checking mode: the offline helper's refusal of non-finite data (synchronizes)."""
    _check_finite_x(x)
    if isinstance(scale, torch.Tensor):
        v = float(scale.reshape(()))
        if not 0 < v < math.inf:
            raise ScaleError(expect("scale", "a positive finite calibrated scale", v))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


# ----------------------------------------------------------------------------- quantize_activation


def _check_options(dtype, granularity, allowed, group_k, preshuffled):
    """(output type, granularity, group size, preshuffled) of a quantizing call, each checked."""
    otype = _out_type(dtype)
    granularity = _check_granularity(granularity, allowed)
    return otype, granularity, quant._group(group_k, "group_k"), _check_preshuffled(preshuffled, granularity)


def _build_quantize(x, dtype, granularity, group_k, scale, preshuffled, out, backend):
    m, k, row_stride = _check_x(x)
    otype, granularity, gk, preshuffled = _check_options(dtype, granularity, _aq.GRANULARITIES, group_k,
                                                         preshuffled)
    scale_dtype, scale_val = _check_static_scale(scale, granularity, x.device)
    s_shape, s_strides = _scale_layout(m, k, granularity, gk, preshuffled)
    if out is not None:
        _check_out(out, x.shape, otype, s_shape, s_strides, x.device)
        s_strides = tuple(out[1].stride())
    executor, interpreted = resolve_backend(backend, x.device)
    if m == 0:
        return _Empty(tuple(x.shape), otype, s_shape, s_strides, x.device)
    if executor == "reference" or k == 0:
        return _Reference(otype, granularity, gk, preshuffled, scale_val if scale_dtype is None else None)
    _check_arch(x.device, otype)
    return _aq.ActQuantLaunch(
        x_shape=tuple(x.shape), device=x.device, m=m, k=k, row_stride=row_stride, x_dtype=x.dtype,
        otype=otype, granularity=granularity, group_k=gk, s_shape=s_shape, s_strides=s_strides,
        scale_dtype=scale_dtype, scale_val=scale_val, interpreted=interpreted,
        cfg=act_quant_config(k, granularity, gk, m=m, arch=_arch(x.device, interpreted)),
        pdl=pdl_enabled(x.device, interpreted))


class _Empty:
    """M = 0: empty outputs, nothing launched."""

    def __init__(self, x_shape, otype, s_shape, s_strides, device):
        self.x_shape, self.otype, self.s_shape, self.s_strides, self.device = (
            x_shape, otype, s_shape, s_strides, device)

    def __call__(self, x, scale, out):
        if out is not None:
            return tuple(out)
        q = torch.empty(self.x_shape, dtype=self.otype.torch_dtype, device=self.device)
        s = torch.empty_strided(self.s_shape, self.s_strides, dtype=torch.float32, device=self.device)
        return q, s


class _Reference:
    """The torch reference (backend 'reference', CPU 'auto', and K = 0)."""

    def __init__(self, otype, granularity, group_k, preshuffled, scale_val):
        self.otype, self.granularity, self.group_k = otype, granularity, group_k
        self.preshuffled, self.scale_val = preshuffled, scale_val

    def __call__(self, x, scale, out):
        q, s = _aq.quantize_activation_ref(_rows(x), self.otype, self.granularity, self.group_k,
                                           self.scale_val if scale is None else scale)
        q = q.reshape(x.shape)
        if self.preshuffled:
            s = quant.preshuffle_scale(s)
        if out is None:
            return q, s
        out[0].copy_(q)
        out[1].copy_(s)
        return tuple(out)


# ----------------------------------------------------------------------------- add_rmsnorm_quantize


def _build_fused(x, residual, weight, eps, dtype, granularity, group_k, preshuffled, backend):
    m, k, x_stride = _check_x(x)
    r_stride = None
    if residual is not None:
        _, _, r_stride = _check_x(residual, "residual")
        if tuple(residual.shape) != tuple(x.shape):
            raise ShapeError(expect("residual", f"shape {tuple(x.shape)} (x's)", tuple(residual.shape)))
        if residual.dtype != x.dtype:
            raise DTypeError(expect("residual", f"dtype {x.dtype} (x's)", residual.dtype))
        if residual.device != x.device:
            raise UnsupportedError(expect("residual", f"a tensor on {x.device}", residual.device))
    if not isinstance(weight, torch.Tensor):
        raise DTypeError(expect("weight", "a torch.Tensor", type(weight).__name__))
    if tuple(weight.shape) != (k,):
        raise ShapeError(expect("weight", f"shape ({k},) (K of x)", tuple(weight.shape)))
    if weight.dtype != x.dtype:
        raise DTypeError(expect("weight", f"dtype {x.dtype} (x's)", weight.dtype))
    if weight.device != x.device:
        raise UnsupportedError(expect("weight", f"a tensor on {x.device}", weight.device))
    if k > 1 and weight.stride(0) != 1:
        raise LayoutError(expect("weight", "unit stride", f"strides {weight.stride()}"))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ScaleError(expect("eps", "a finite number >= 0", repr(eps)))
    otype, granularity, gk, preshuffled = _check_options(dtype, granularity, _aq.FUSED_GRANULARITIES, group_k,
                                                         preshuffled)
    s_shape, s_strides = _scale_layout(m, k, granularity, gk, preshuffled)
    executor, interpreted = resolve_backend(backend, x.device)
    if executor == "reference" or m == 0 or k == 0:
        return _FusedReference(otype, granularity, gk, preshuffled, float(eps))
    _check_arch(x.device, otype)
    return _aq.AddRmsNormQuantLaunch(
        x_shape=tuple(x.shape), device=x.device, m=m, k=k, x_stride=x_stride, r_stride=r_stride,
        x_dtype=x.dtype, otype=otype, granularity=granularity, group_k=gk, s_shape=s_shape,
        s_strides=s_strides, eps=float(eps), interpreted=interpreted,
        cfg=act_quant_config(k, granularity, gk, fused=True, m=m, arch=_arch(x.device, interpreted)),
        pdl=pdl_enabled(x.device, interpreted))


def _arch(device, interpreted: bool) -> str:
    """The arch whose thresholds size the kernel: the GPU's (the interpreter plans for sm_90)."""
    return device_facts(device if not interpreted else torch.device("cpu")).arch.name


class _FusedReference:
    def __init__(self, otype, granularity, group_k, preshuffled, eps):
        self.otype, self.granularity, self.group_k = otype, granularity, group_k
        self.preshuffled, self.eps = preshuffled, eps

    def __call__(self, x, residual, weight):
        q, s, h = _aq.add_rmsnorm_quantize_ref(
            _rows(x), None if residual is None else _rows(residual), weight, self.eps, self.otype,
            self.granularity, self.group_k)
        if self.preshuffled:
            s = quant.preshuffle_scale(s)
        return q.reshape(x.shape), s, (x if residual is None else h.reshape(x.shape))


# ----------------------------------------------------------------------------- silu_mul_quantize


def _build_silu(x, dtype, granularity, group_k, preshuffled, backend):
    m, k2, row_stride = _check_x(x, "gate_up")
    if k2 % 2:
        raise ShapeError(expect("gate_up", "an even last dimension 2I (gate and up halves)",
                                f"shape {tuple(x.shape)}"))
    i = k2 // 2
    otype, granularity, gk, preshuffled = _check_options(dtype, granularity, _sq.GRANULARITIES, group_k,
                                                         preshuffled)
    s_shape, s_strides = _scale_layout(m, i, granularity, gk, preshuffled)
    executor, interpreted = resolve_backend(backend, x.device)
    if executor == "reference" or m == 0 or i == 0:
        return _SiluReference(otype, granularity, gk, preshuffled)
    _check_arch(x.device, otype)
    # 'row' holds the whole row in one program (the fused layout); 'group' spreads groups over
    # programs as quantize_activation does.
    cfg = act_quant_config(i, granularity, gk, fused=granularity == "row", m=m,
                           arch=_arch(x.device, interpreted))
    return _sq.SiluMulQuantLaunch(
        q_shape=(*x.shape[:-1], i), device=x.device, m=m, i=i, row_stride=row_stride, x_dtype=x.dtype,
        otype=otype, granularity=granularity, group_k=gk, s_shape=s_shape, s_strides=s_strides,
        interpreted=interpreted, cfg=cfg)


class _SiluReference:
    def __init__(self, otype, granularity, group_k, preshuffled):
        self.otype, self.granularity, self.group_k, self.preshuffled = otype, granularity, group_k, preshuffled

    def __call__(self, x):
        q, s = _sq.silu_mul_quantize_ref(_rows(x), self.otype, self.granularity, self.group_k)
        if self.preshuffled:
            s = quant.preshuffle_scale(s)
        return q.reshape(*x.shape[:-1], x.shape[-1] // 2), s


__all__ = ["add_rmsnorm_quantize", "quantize_activation", "silu_mul_quantize"]
