"""``tileq.linear`` on a prepacked int4 weight (``PrepackedInt4``): y = x @ W^T with W's group
(bquant), per-channel or per-tensor scales, x 16-bit (W4A16) or fp8 with per-token or per-tensor
scales (W4A8).

A call is checked once (shapes, dtypes, the scales' kinds, the bias, ``out``); its signature
(everything the plan and the launch depend on, ``settings.key()`` included) finds its launch. A new
signature is planned (``dispatch.plan.make_plan`` on its ``PrepackedSpec``: path, kernel, config or
tiling) and its launch made from the plan by the launchers of ``kernels/int4p``, which decide
nothing. ``describe_prepacked`` says what runs for a call described by its sizes.
"""

from __future__ import annotations

import torch

from . import settings as _settings
from ._runtime import bounded_put, interpreter_active
from .dispatch.plan import Plan, make_plan
from .errors import DTypeError, ShapeError, expect
from .kernels.int4p.config import X_TYPES, Int4pConfig
from .kernels.int4p.dequant import DequantLaunch
from .kernels.int4p.fp8_prefill import Fp8PrefillLaunch
from .kernels.int4p.launch import Int4pLaunch
from .kernels.int4p.prefill_launch import GluonPrefillLaunch
from .kernels.int4p.spec import PrepackedSpec
from .prepacked import PrepackedInt4

_OUT = (torch.bfloat16, torch.float16, torch.float32)
LAUNCH_CACHE_SIZE = 1024
_LAUNCHES: dict[tuple, object] = {}


def _check_scales(x_type, m, n, k, x_scale, w_scale, group_k):
    """(w_kind, x_kind) of the call's scales: W's 'group' ([K / group_k, N]), 'vector' ([N]) or
    'scalar'; x's 'none' (16-bit activations), 'vector' (per token) or 'scalar'."""
    if w_scale is None:
        raise DTypeError(expect("w_scale", "the int4 weight's scales ([K/group_k, N], [N] or one value)", None))
    if not isinstance(w_scale, torch.Tensor) or not w_scale.dtype.is_floating_point:
        raise DTypeError(expect("w_scale", "a floating-point tensor", type(w_scale).__name__))
    if group_k % 128 or group_k <= 0:
        raise ShapeError(expect("group_k", "a positive multiple of 128 for prepacked int4 weights", group_k))
    gk = -(-k // group_k)
    if w_scale.numel() == 1:
        w_kind = "scalar"
    elif w_scale.dim() == 2 and tuple(w_scale.shape) == (gk, n) and gk > 1:
        w_kind = "group"
    elif tuple(w_scale.shape) in ((n,), (1, n)):
        w_kind = "vector"
    else:
        raise ShapeError(expect("w_scale", f"[{gk}, {n}] (group_k={group_k}), [{n}] or one value",
                                tuple(w_scale.shape)))
    if x_type in ("bf16", "fp16"):
        if x_scale is not None:
            raise DTypeError(expect("x_scale", "None for 16-bit activations", type(x_scale).__name__))
        return w_kind, "none"
    if x_scale is None or not isinstance(x_scale, torch.Tensor):
        raise DTypeError(expect("x_scale", "a tensor of per-token ([M] / [M, 1]) or per-tensor scales",
                                type(x_scale).__name__))
    if x_scale.numel() == 1:
        return w_kind, "scalar"
    if tuple(x_scale.shape) not in ((m,), (m, 1)):
        raise ShapeError(expect("x_scale", f"[{m}] or [{m}, 1] (per token) or one value", tuple(x_scale.shape)))
    return w_kind, "vector"


def check_x_k(x, w: PrepackedInt4) -> None:
    """x [..., K] for the prepacked weight w [N, K], or a ShapeError in linear's terms."""
    n, k = w.shape
    if not isinstance(x, torch.Tensor) or (x.dim() >= 1 and x.shape[-1] == k):
        return
    msg = expect("x", f"shape [..., {k}] (K: w is a PrepackedInt4 [N, K] = [{n}, {k}])", tuple(x.shape))
    if x.dim() >= 1 and x.shape[-1] == n:
        msg += ("; x's last dimension is w's N: was w prepacked from a transposed weight? "
                "tileq.prepack_int4 takes the nn.Linear weight [N, K]")
    raise ShapeError(msg)


def _f32(t):
    return t if t is None or t.dtype == torch.float32 else t.float()


def linear_prepacked(x: torch.Tensor, w: PrepackedInt4, x_scale=None, w_scale=None, *,
                     out_dtype: torch.dtype | None = None, bias=None, group_k: int = 128,
                     config: Int4pConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T for a prepacked int4 weight W [N, K]; x [..., K] (leading dims flattened).
    ``config``: run the decode kernel with this config (tests, benchmarks)."""
    prepared = _prepare(x, w, x_scale, w_scale, out_dtype, bias, group_k, config)
    if isinstance(prepared, torch.Tensor):  # nothing to launch (M, N or K is 0)
        return prepared
    launch, x2, sx, sw, b, lead = prepared
    if out is not None:
        _check_out(out, x2.shape[0], w.shape[0], launch.out_dtype, x.device)
    y = launch(x2, w.data, sx, sw, b, None if out is None else out.view(x2.shape[0], w.shape[0]))
    return y.view(*lead, w.shape[0])


def _check_out(out: torch.Tensor, m: int, n: int, out_dtype: torch.dtype, device: torch.device) -> None:
    """The same checks whichever path runs the call: every path writes [M, N] rows of N in place."""
    if out.dtype != out_dtype:
        raise DTypeError(expect("out", f"a {out_dtype} tensor (out_dtype)", out.dtype))
    if out.device != device or out.numel() != m * n or out.shape[-1] != n or not out.is_contiguous():
        raise ShapeError(expect("out", f"a contiguous tensor of {m} x {n} values on {device}",
                                f"{tuple(out.shape)} on {out.device}"))


def _prepare(x, w, x_scale, w_scale, out_dtype, bias, group_k, config, traced: bool = False):
    """Check a call and find (or plan and make) its launch: (launch, x2, x_scale, w_scale, bias,
    lead) with the scales and bias in fp32, or the finished result when there is nothing to
    launch. ``traced``: the launch is traced into a torch.compile graph (its plan says how)."""
    if not isinstance(w, PrepackedInt4):
        raise DTypeError(expect("w", "a tileq.PrepackedInt4", type(w).__name__))
    if not isinstance(x, torch.Tensor) or x.dtype not in X_TYPES:
        raise DTypeError(expect("x", "a bf16, fp16, fp8 e4m3 or e5m2 tensor",
                                getattr(x, "dtype", type(x).__name__)))
    n, k = w.shape
    if x.dim() < 1:
        raise ShapeError(expect("x", f"shape [..., {k}] (the weight's K)", tuple(x.shape)))
    check_x_k(x, w)
    if x.device != w.device:
        raise DTypeError(expect("x", f"on the weight's device {w.device}", x.device))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if k and x2.stride(1) != 1:
        raise ShapeError(expect("x", "unit stride along K", f"strides {tuple(x.stride())}"))
    m = x2.shape[0]
    x_type = X_TYPES[x.dtype]
    if out_dtype is None:
        out_dtype = x.dtype if x_type in ("bf16", "fp16") else torch.bfloat16
    if out_dtype not in _OUT:
        raise DTypeError(expect("out_dtype", "bf16, fp16 or fp32", out_dtype))
    if x_scale is not None and isinstance(x_scale, torch.Tensor) and x_scale.numel() == m and m > 1:
        x_scale = x_scale.reshape(m)
    w_kind, x_kind = _check_scales(x_type, m, n, k, x_scale, w_scale, group_k)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)):
        raise ShapeError(expect("bias", f"[{n}]", tuple(getattr(bias, "shape", ()))))
    if m == 0 or n == 0:
        return torch.empty(*lead, n, dtype=out_dtype, device=x.device)
    if k == 0:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        if bias is not None:
            y += bias.float()
        return y.to(out_dtype).view(*lead, n)
    sw = _f32(w_scale)
    sx = _f32(x_scale)
    b = _f32(bias)
    if w_kind == "group":
        sw_strides = (sw.stride(0), sw.stride(1))
    elif w_kind == "vector":
        sw_strides = (0, sw.stride(-1))
    else:
        sw_strides = (0, 0)
        sw = sw.reshape(())
    sx_stride = sx.stride(0) if x_kind == "vector" else 0
    if x2.stride(0) != k and m > 1:
        raise ShapeError(expect("x", "rows of stride K (a contiguous [..., K] tensor)", tuple(x.stride())))
    # The call's signature: everything its plan (the sizes, the kinds, the device, the given config,
    # the switches) and its launch (the strides) depend on.
    key = (m, n, k, x.dtype, out_dtype, w_kind, sw_strides, x_kind, sx_stride, group_k, b is not None,
           x2.stride(0), x.device, config, traced, _settings.key())
    launch = _LAUNCHES.get(key)
    if launch is None:
        spec = PrepackedSpec(m, n, k, x_type, x_kind, w_kind, out_dtype, group_k, b is not None)
        plan = make_plan(spec, x.device, config=config, traced=traced)
        launch = make_launch(plan, x.dtype, sw_strides, sx_stride, x.device)
        bounded_put(_LAUNCHES, key, launch, LAUNCH_CACHE_SIZE)
    return launch, x2, sx, sw, b, lead


def make_launch(plan: Plan, x_dtype: torch.dtype, sw_strides: tuple[int, int], sx_stride: int,
                device: torch.device):
    """The launch of ``plan`` (a prepacked plan) for tensors of these dtypes and strides on ``device``."""
    s, r = plan.spec, plan.route
    m, n, k, w_kind, x_kind = s.m, s.n, s.k, s.w_kind, s.x_kind
    if r.path == "gluon-prefill":
        fallback = DequantLaunch(n, k, w_kind, x_kind, sw_strides, s.group_k, s.out_dtype, x_dtype)
        return GluonPrefillLaunch(m, n, k, x_dtype, s.out_dtype, w_kind, sw_strides, s.group_k, s.has_bias,
                                  device, fallback, tokens=r.tokens, num_sms=plan.facts.num_sms,
                                  overlap=r.overlap, split=r.split, x_kind=x_kind, sx_stride=sx_stride,
                                  fused=r.fused, streamk=r.streamk)
    if r.path == "fp8-gemm":
        if r.inner is None:
            raise r.inner_error
        return Fp8PrefillLaunch(n, k, w_kind, x_kind, s.group_k, s.out_dtype, x_dtype, r.inner)
    if r.path == "dequant+cublas":
        return DequantLaunch(n, k, w_kind, x_kind, sw_strides, s.group_k, s.out_dtype, x_dtype)
    return Int4pLaunch(m, n, k, r.compute_type, s.out_dtype, w_kind, sw_strides, x_kind, sx_stride,
                       s.group_k, s.has_bias, device, r.config, cast_x=r.cast, num_sms=plan.facts.num_sms, pdl=plan.pdl)


class PrepackedCall:
    """A kept launch for one call signature: ``run(x, w_storage, x_scale, w_scale, bias, acc,
    out)`` as ``api.linear_call``'s objects, with no per-call checks (QuantLinear's runner)."""

    __slots__ = ("launch",)

    def __init__(self, launch):
        self.launch = launch

    @property
    def untraced(self) -> str | None:
        """Why its launch cannot be traced into a torch.compile graph, or None (the launcher's)."""
        return self.launch.untraced

    @property
    def counters(self) -> int:
        """The tile counters its launch's split sums with (0: none)."""
        return self.launch.counters

    def run(self, x, wdata, x_scale, w_scale, bias, acc, out):
        return self.launch(x, wdata, x_scale, w_scale, bias, out)


def prepacked_call(x, w: PrepackedInt4, x_scale, w_scale, *, out_dtype, bias, group_k, traced: bool = False):
    """The kept launch of ``linear_prepacked`` for x [M, K] on a GPU (``traced``: traced into a
    torch.compile graph), or None (CPU, interpreter, scales or bias not already fp32: those take
    ``linear_prepacked`` every call)."""
    if x.dim() != 2 or x.device.type != "cuda" or interpreter_active():
        return None
    if any(t is not None and t.dtype != torch.float32 for t in (x_scale, w_scale, bias)):
        return None
    prepared = _prepare(x, w, x_scale, w_scale, out_dtype, bias, group_k, None, traced)
    return None if isinstance(prepared, torch.Tensor) else PrepackedCall(prepared[0])


def described_plan(m: int, n: int, k: int, x_dtype: torch.dtype = torch.bfloat16, w_scale: str = "group",
                   config: Int4pConfig | None = None, device: torch.device | None = None) -> Plan:
    """The plan of a call described by its sizes: activations of ``x_dtype`` (fp8 with per-token
    scales), W's scales ``w_scale``, the output in the activations' 16-bit type (bf16 for fp8),
    group_k 128, no bias; on ``device``, or without one on an sm_90 GPU with the default switches."""
    x_type = X_TYPES[x_dtype]
    sixteen = x_type in ("bf16", "fp16")
    spec = PrepackedSpec(m, n, k, x_type, "none" if sixteen else "vector", w_scale,
                         x_dtype if sixteen else torch.bfloat16)
    if device is None:
        return make_plan(spec, torch.device("cuda"), arch="sm_90", config=config)
    return make_plan(spec, device, config=config)


def describe_prepacked(m: int, n: int, k: int, x_dtype: torch.dtype = torch.bfloat16, w_scale: str = "group",
                       config: Int4pConfig | None = None, device: torch.device | None = None) -> str:
    """What ``linear_prepacked`` runs for these sizes (``described_plan(...).describe()``)."""
    return described_plan(m, n, k, x_dtype, w_scale, config, device).describe()
