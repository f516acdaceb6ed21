"""``grouped_linear`` and ``explain_grouped``: many experts' quantized GEMMs in one launch.

Per expert e, ``y_e = dequant(x_e) @ dequant(w[e]).t()`` with ``tileq.linear``'s schemes, scale
meanings and rounding (docs/schemes.md), a leading expert dimension E on the weight and its scale,
and an optional per-row ``row_scale`` (the routing weights) multiplied before the cast. See
docs/grouped.md for the two input forms, the scale shapes and examples.

The hot path never reads ``offsets`` / ``counts`` on the host: the grid is sized from shapes
alone and the programs of an expert without rows exit at once, so a call can be captured in a
CUDA graph and replayed with new counts. Their VALUES are therefore not validated (that would
synchronize): offsets must be non-decreasing from 0 with offsets[E] <= T, counts in [0, C]. The
kernel clamps them to the tensors' extents (it never reads or writes out of bounds), but rows
described by wrong values get wrong results. The reference backend checks the values.

Repeated calls are cheap, as for ``tileq.linear`` (api.py): a call whose signature (type, shape,
strides, dtype and device of every tensor, every option, ``settings.key()``) was validated and
planned before reuses its launch and only upcasts non-fp32 scales and allocates the output.
"""

from __future__ import annotations

import math

import torch

from . import settings
from ._runtime import bounded_put, cache_get
from .api import _arg_key
from .dispatch.plan import make_plan
from .dtypes import OUT_DTYPES, OperandType, check_pair, operand_type
from .errors import (
    DTypeError,
    LayoutError,
    ScaleError,
    ShapeError,
    UnsupportedError,
    expect,
)
from .kernels.grouped.spec import GroupedSpec
from .problem import GROUP_NS, ScaleKind, Scheme, _check_int32_overflow, parse_scheme
from .reference_grouped import grouped_linear_ref

SCHEMES = (Scheme.ROWCOL, Scheme.BQUANT, Scheme.ABQUANT)
CALL_CACHE_SIZE = 1024
_CALLS: dict[tuple, object] = {}


def clear_call_cache() -> None:
    """Forget every remembered call signature (tests; memory)."""
    _CALLS.clear()


class Args:
    """Validated, normalized tensors of one call. Scales and row_scale are fp32; ``index`` is
    offsets (contiguous form) or counts (masked form)."""

    __slots__ = ("index", "out", "row_scale", "w", "w_scale", "x", "x_scale")

    def __init__(self, x, w, x_scale, w_scale, row_scale, index, out):
        self.x, self.w, self.x_scale, self.w_scale = x, w, x_scale, w_scale
        self.row_scale, self.index, self.out = row_scale, index, out


def _fp32(s, arg: str):
    if s is None:
        return None
    if not isinstance(s, torch.Tensor):
        raise DTypeError(expect(arg, "a torch.Tensor or None", type(s).__name__))
    if s.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise DTypeError(expect(arg, "dtype float32 (bfloat16/float16 are upcast)", s.dtype))
    return s if s.dtype is torch.float32 else s.float()


def _int_index(t, arg: str, shape: tuple, what: str, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(expect(arg, f"an int32 tensor {what}", type(t).__name__))
    if t.dtype != torch.int32:
        raise DTypeError(expect(arg, f"dtype torch.int32 ({what})", t.dtype))
    if tuple(t.shape) != shape:
        raise ShapeError(expect(arg, f"shape {shape} ({what})", tuple(t.shape)))
    if t.device != device:
        raise UnsupportedError(expect(arg, f"a tensor on {device} (the device of x)", t.device))
    if shape[0] > 1 and t.stride(0) != 1:
        raise LayoutError(expect(arg, "a contiguous vector", f"strides {tuple(t.stride())}"))


def validate(x, w, x_scale, w_scale, *, scheme, offsets, counts, out_dtype, group_k, group_n,
             row_scale, out) -> tuple[GroupedSpec, Args]:
    """Check every argument of ``grouped_linear`` (names, expected and got in every message) and
    return the spec and the normalized tensors. Reads no tensor values."""
    scheme = parse_scheme(scheme)
    if scheme not in SCHEMES:
        raise UnsupportedError(expect("scheme", f"one of {', '.join(s.value for s in SCHEMES)} for "
                                      "grouped_linear", repr(scheme.value)))
    if (offsets is None) == (counts is None):
        raise ShapeError(expect("offsets, counts", "exactly one: offsets with x [T, K] (contiguous form) "
                                "or counts with x [E, C, K] (masked form)",
                                "both" if offsets is not None else "neither"))
    masked = counts is not None
    if not isinstance(x, torch.Tensor):
        raise DTypeError(expect("x", "a torch.Tensor", type(x).__name__))
    x_type = operand_type(x, "x")
    want = 3 if masked else 2
    if x.dim() != want:
        form = "[E, C, K] with counts (masked form)" if masked else "[T, K] with offsets (contiguous form)"
        raise ShapeError(expect("x", f"a {want}-D tensor {form}", f"shape {tuple(x.shape)}"))
    k = x.shape[-1]
    if k > 1 and x.stride(-1) != 1:
        raise LayoutError(expect("x", "unit stride along K (no silent copy)", f"strides {tuple(x.stride())}"))
    if not isinstance(w, torch.Tensor):
        raise DTypeError(expect("w", "a torch.Tensor [E, N, K] (uint8 [E, N, K // 2] for packed int4)",
                                type(w).__name__))
    if w.dim() != 3:
        raise ShapeError(expect("w", "a 3-D tensor [E, N, K] (uint8 [E, N, K // 2] for packed int4)",
                                f"shape {tuple(w.shape)}"))
    if w.dtype == torch.uint8:
        w_type, w_k = OperandType.I4, 2 * w.shape[2]
    else:
        w_type, w_k = operand_type(w, "w"), w.shape[2]
    e, n = w.shape[0], w.shape[1]
    if w_k != k:
        what = f"uint8 [E, N, K // 2] = [{e}, {n}, {k // 2}]" if w_type is OperandType.I4 else f"[E, N, K] with K={k}"
        raise ShapeError(expect("w", f"{what} (K is x's last dimension)", f"shape {tuple(w.shape)}"))
    if w.shape[2] > 1 and w.stride(2) != 1:
        raise LayoutError(expect("w", "unit stride along K (the nn.Linear layout of each expert)",
                                 f"strides {tuple(w.stride())}"))
    check_pair(x_type, w_type, "x, w")
    if e < 1:
        raise ShapeError(expect("w", "at least one expert (E >= 1)", f"shape {tuple(w.shape)}"))
    if masked and x.shape[0] != e:
        raise ShapeError(expect("x", f"[E, C, K] with E={e} (w's experts)", f"shape {tuple(x.shape)}"))
    rows = x.shape[1] if masked else x.shape[0]
    device = x.device
    if w.device != device:
        raise UnsupportedError(expect("w", f"a tensor on {device} (the device of x)", w.device))
    if masked:
        _int_index(counts, "counts", (e,), "the valid rows of each expert", device)
    else:
        _int_index(offsets, "offsets", (e + 1,), "each expert's first row, then T's end", device)
    if isinstance(group_k, bool) or not isinstance(group_k, int) or group_k <= 0:
        raise ShapeError(expect("group_k", "a positive int", repr(group_k)))
    if group_n is not None and (isinstance(group_n, bool) or group_n not in GROUP_NS):
        raise ShapeError(expect("group_n", "1 or 128, or None to read it off w_scale's shape", repr(group_n)))
    if out_dtype not in OUT_DTYPES:
        raise DTypeError(expect("out_dtype", "torch.bfloat16, torch.float16 or torch.float32", out_dtype))

    lead = (e, rows) if masked else (rows,)
    lead_txt = "[E, C]" if masked else "[T]"
    gk = math.ceil(k / group_k) if k else 0
    sx, x_kind = _x_scale(x_scale, scheme, x_type, lead, lead_txt, gk, device)
    sw, w_kind, gn_width = _w_scale(w_scale, scheme, e, n, gk, group_k, group_n, device)
    rs = _fp32(row_scale, "row_scale")
    if rs is not None:
        if tuple(rs.shape) != lead:
            raise ShapeError(expect("row_scale", f"shape {lead_txt} = {lead} (one fp32 per row)", tuple(rs.shape)))
        if rs.device != device:
            raise UnsupportedError(expect("row_scale", f"a tensor on {device} (the device of x)", rs.device))
    if out is not None:
        _check_out(out, (*lead, n), out_dtype, device)
    spec = GroupedSpec(
        form="masked" if masked else "contiguous", e=e, rows=rows, n=n, k=k, x_type=x_type, w_type=w_type,
        scheme=scheme, x_scale=x_kind, w_scale=w_kind, out_dtype=out_dtype, group_k=group_k,
        group_n=gn_width, has_row_scale=rs is not None,
    )
    _check_int32_overflow(spec.expert(), "w")
    return spec, Args(x, w, sx, sw, rs, counts if masked else offsets, out)


def _x_scale(s, scheme: Scheme, x_type: OperandType, lead: tuple, lead_txt: str, gk: int, device):
    """(fp32 tensor, kind): per row ([T] / [T, 1] or [E, C] / [E, C, 1]) or per 1 x group_k
    group ([T, Gk] / [E, C, Gk]), as the scheme wants."""
    if scheme is Scheme.ABQUANT:
        allowed, txt = (ScaleKind.GROUP,), f"shape {lead_txt[:-1]}, Gk] = {(*lead, gk)}"
    elif scheme is Scheme.ROWCOL and not x_type.is_wide_float:
        allowed, txt = (ScaleKind.VECTOR,), f"shape {lead_txt} = {lead} or {(*lead, 1)}"
    else:  # bquant, or a bf16/fp16 x (weight-only): the scale is optional
        allowed, txt = (ScaleKind.NONE, ScaleKind.VECTOR), f"None or shape {lead_txt} = {lead} or {(*lead, 1)}"
    full = f"{txt} for scheme '{scheme.value}' with x {x_type}"
    if s is None:
        if ScaleKind.NONE in allowed:
            return None, ScaleKind.NONE
        raise ScaleError(expect("x_scale", full, "None"))
    s = _fp32(s, "x_scale")
    shape = tuple(s.shape)
    if ScaleKind.VECTOR in allowed and shape in (lead, (*lead, 1)):
        kind = ScaleKind.VECTOR
    elif ScaleKind.GROUP in allowed and shape == (*lead, gk):
        kind = ScaleKind.GROUP
    else:
        raise ShapeError(expect("x_scale", full, shape))
    if s.device != device:
        raise UnsupportedError(expect("x_scale", f"a tensor on {device} (the device of x)", s.device))
    return s, kind


def _w_scale(s, scheme: Scheme, e: int, n: int, gk: int, group_k: int, group_n, device):
    """(fp32 tensor, kind, group_n): per output channel [E, N] (rowcol) or per group
    [E, Gn, Gk] (bquant, abquant; Gn = N or ceil(N / 128), read off the shape unless given)."""
    if s is None:
        raise ScaleError(expect("w_scale", f"a scale for scheme '{scheme.value}'", "None"))
    s = _fp32(s, "w_scale")
    shape = tuple(s.shape)
    if s.device != device:
        raise UnsupportedError(expect("w_scale", f"a tensor on {device} (the device of x)", s.device))
    if scheme is Scheme.ROWCOL:
        if shape != (e, n):
            raise ShapeError(expect("w_scale", f"shape [E, N] = {(e, n)} (per output channel) for scheme "
                                    "'rowcol'", shape))
        return s, ScaleKind.VECTOR, 1
    widths = {1: n, 128: math.ceil(n / 128)}
    if group_n is None and len(shape) == 3:
        group_n = next((g for g, gn in widths.items() if shape[1] == gn), None)
    if group_n is not None and shape == (e, widths[group_n], gk):
        return s, ScaleKind.GROUP, group_n
    gn_txt = f"{widths[group_n]} (group_n={group_n})" if group_n else f"N={n} or ceil(N/128)={widths[128]}"
    msg = expect("w_scale", f"shape [E, Gn, Gk] with E={e}, Gn={gn_txt}, Gk=ceil(K/{group_k})={gk} for "
                 f"scheme '{scheme.value}'", shape)
    if len(shape) == 3 and shape[0] == e and shape[1] == gk and shape[2] in widths.values():
        msg += "; did you mean w_scale.transpose(1, 2)? grouped_linear takes the weight's orientation [E, Gn, Gk]"
    raise ShapeError(msg)


def _check_out(out, shape: tuple, out_dtype, device) -> None:
    if not isinstance(out, torch.Tensor):
        raise DTypeError(expect("out", "a torch.Tensor or None", type(out).__name__))
    if tuple(out.shape) != shape:
        raise ShapeError(expect("out", f"shape {shape}", tuple(out.shape)))
    if out.dtype != out_dtype:
        raise DTypeError(expect("out", f"dtype {out_dtype} (out_dtype)", out.dtype))
    if out.device != device:
        raise UnsupportedError(expect("out", f"a tensor on {device} (the device of x)", out.device))
    if shape[-1] > 1 and out.stride(-1) != 1:
        raise LayoutError(expect("out", "unit stride along N", f"strides {tuple(out.stride())}"))


def _call_key(x, w, x_scale, w_scale, offsets, counts, row_scale, out, scheme, out_dtype, group_k,
              group_n, backend):
    try:
        return (
            _arg_key(x), _arg_key(w), _arg_key(x_scale), _arg_key(w_scale), _arg_key(offsets),
            _arg_key(counts), _arg_key(row_scale), _arg_key(out), type(scheme), scheme,
            out_dtype, type(group_k), group_k, type(group_n), group_n, type(backend), backend,
            settings.key(),
        )
    except Exception:  # noqa: BLE001 - an argument the key cannot describe: the full path decides
        return None


def _lookup(key):
    return cache_get(_CALLS, key)


def _up(s):
    return s if s is None or s.dtype is torch.float32 else s.float()


def grouped_linear(x, w, x_scale=None, w_scale=None, *, scheme, offsets=None, counts=None,
                   out_dtype: torch.dtype = torch.bfloat16, group_k: int = 128, group_n: int | None = None,
                   row_scale=None, out=None, backend: str | None = None) -> torch.Tensor:
    """Per expert e: ``y_e = dequant(x_e) @ dequant(w[e]).t()`` (``* row_scale``), one launch.

    x: contiguous form [T, K] with rows sorted by expert and ``offsets`` int32 [E + 1] on the
    device (rows offsets[e]:offsets[e+1] are expert e's) -> y [T, N]; masked form [E, C, K] with
    ``counts`` int32 [E] (rows 0..counts[e]-1 of x[e] are valid) -> y [E, C, N]. Rows that belong
    to no expert are left unwritten. w: [E, N, K] int8 / float8_e4m3fn / float8_e5m2, or packed
    int4 as uint8 [E, N, K // 2] (docs/schemes.md section 3). Schemes and scales:

    - 'rowcol': x_scale per row ([T] / [E, C], or with a trailing 1; None for bf16/fp16 x),
      w_scale [E, N];
    - 'bquant': x_scale None or per row, w_scale [E, Gn, Gk] (K groups of ``group_k``; Gn = N,
      or ceil(N / 128) with group_n=128);
    - 'abquant': x_scale [T, Gk] / [E, C, Gk] (1 x group_k), w_scale [E, Gn, Gk] (128 x 128
      blocks: Gn = ceil(N / 128)).

    row_scale: optional fp32 [T] / [E, C], multiplied into each row after the dequantization,
    before the cast to ``out_dtype``. backend: None / 'auto' (the kernel for CUDA tensors, the
    reference for CPU ones, as tileq.linear), 'triton' (also the interpreter on CPU tensors with
    TRITON_INTERPRET=1), 'reference'. Never synchronizes with the host on the kernel path.
    """
    key = _call_key(x, w, x_scale, w_scale, offsets, counts, row_scale, out, scheme, out_dtype,
                    group_k, group_n, backend)
    hit = _lookup(key)
    if hit is not None:
        return hit(x, w, _up(x_scale), _up(w_scale), _up(row_scale),
                   counts if offsets is None else offsets, out)
    spec, args = validate(x, w, x_scale, w_scale, scheme=scheme, offsets=offsets, counts=counts,
                          out_dtype=out_dtype, group_k=group_k, group_n=group_n, row_scale=row_scale,
                          out=out)
    plan = make_plan(spec, x.device, backend=backend)
    if plan.executor == "reference":
        return grouped_linear_ref(x, w, args.x_scale, args.w_scale, scheme=spec.scheme, offsets=offsets,
                                  counts=counts, out_dtype=out_dtype, group_k=group_k,
                                  group_n=spec.group_n, row_scale=args.row_scale, out=out)
    from .kernels.grouped.launch import GroupedLaunch

    launch = GroupedLaunch(spec, plan.config, args, plan.interpreted)
    if key is not None:
        bounded_put(_CALLS, key, launch, CALL_CACHE_SIZE)
    return launch(args.x, args.w, args.x_scale, args.w_scale, args.row_scale, args.index, args.out)


def explain_grouped(x, w, x_scale=None, w_scale=None, *, scheme, offsets=None, counts=None,
                    out_dtype: torch.dtype = torch.bfloat16, group_k: int = 128, group_n: int | None = None,
                    row_scale=None, out=None, backend: str | None = None, arch: str | None = None) -> str:
    """The plan ``grouped_linear`` would run for these arguments, as text (nothing is launched;
    meta tensors work). ``arch``: plan for a named arch (e.g. 'sm_90') instead of x's device."""
    spec, _ = validate(x, w, x_scale, w_scale, scheme=scheme, offsets=offsets, counts=counts,
                       out_dtype=out_dtype, group_k=group_k, group_n=group_n, row_scale=row_scale, out=out)
    return make_plan(spec, x.device, backend=backend, arch=arch).describe()

