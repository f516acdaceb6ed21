"""Validation and normalization of one GEMM call into a ``Problem``.

Everything a call can get wrong is checked here, once, before any executor runs: operand types,
shapes, layouts from strides, scale shapes for the scheme, bias / acc / out. The result is a
``Problem``: a hashable ``ProblemSpec`` (what kernels specialize on) plus the normalized tensors.
Rank-1 scales are normalized explicitly ([M] -> rows, [N] -> columns), never by broadcasting.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from .dtypes import (
    OUT_DTYPES,
    OperandType,
    PackedInt4,
    check_pair,
    integer_mainloop,
    operand_type,
)
from .errors import DTypeError, LayoutError, ScaleError, ShapeError, UnsupportedError, expect


class Scheme(str, enum.Enum):
    TENSOR = "tensor"
    ROWCOL = "rowcol"
    AQUANT = "aquant"
    BQUANT = "bquant"
    ABQUANT = "abquant"

    def __str__(self) -> str:
        return self.value

    @property
    def a_grouped(self) -> bool:
        return self in (Scheme.AQUANT, Scheme.ABQUANT)

    @property
    def b_grouped(self) -> bool:
        return self in (Scheme.BQUANT, Scheme.ABQUANT)

    @property
    def grouped(self) -> bool:
        return self.a_grouped or self.b_grouped


def parse_scheme(scheme) -> Scheme:
    if isinstance(scheme, Scheme):
        return scheme
    try:
        return Scheme(str(scheme).lower())
    except ValueError:
        names = ", ".join(s.value for s in Scheme)
        raise UnsupportedError(expect("scheme", f"one of {names}", repr(scheme))) from None


class ScaleKind(str, enum.Enum):
    """How a normalized scale is applied."""

    NONE = "none"  # no scale (1.0)
    SCALAR = "scalar"  # one value, in the epilogue
    VECTOR = "vector"  # a_scale per row [M] / b_scale per column [N], in the epilogue
    GROUP = "group"  # a_scale [M, Gk] / b_scale [Gk, Gn], promoted inside the K loop

    def __str__(self) -> str:
        return self.value


class ScaleLayout(str, enum.Enum):
    """Storage of a 2-D group a_scale [M, Gk]."""

    ROWMAJOR = "rowmajor"  # stride (Gk-ish, 1)
    PRESHUFFLED = "preshuffled"  # K-group-major: stride (1, >= M)

    def __str__(self) -> str:
        return self.value


# Which scale kinds each scheme accepts (before the "unquantized operand may omit" rule).
_A_KINDS = {
    Scheme.TENSOR: (ScaleKind.SCALAR,),
    Scheme.ROWCOL: (ScaleKind.VECTOR, ScaleKind.SCALAR),
    Scheme.AQUANT: (ScaleKind.GROUP,),
    Scheme.BQUANT: (ScaleKind.NONE, ScaleKind.SCALAR, ScaleKind.VECTOR),
    Scheme.ABQUANT: (ScaleKind.GROUP,),
}
_B_KINDS = {
    Scheme.TENSOR: (ScaleKind.SCALAR,),
    Scheme.ROWCOL: (ScaleKind.VECTOR, ScaleKind.SCALAR),
    Scheme.AQUANT: (ScaleKind.NONE, ScaleKind.SCALAR),
    Scheme.BQUANT: (ScaleKind.GROUP,),
    Scheme.ABQUANT: (ScaleKind.GROUP,),
}

LAYOUTS = ("rcr", "rrr", "crr", "ccr")
# The widths of a b_scale group along N that the kernels take (docs/schemes.md section 1).
GROUP_NS = (1, 128)


@dataclass(frozen=True)
class ArgNames:
    """The caller's names of gemm's four arguments, for the messages of ``build_problem``'s errors.

    ``weight``: the caller passed B as an nn.Linear weight w [N, K] and build_problem gets its
    transpose (``tileq.linear``): messages about B then show w's own shape, strides and dims.
    ``logical``: the caller transposes with flags (``a8w8_matmul_dequant``'s a_trans / b_trans):
    shapes are called logical, and no ``.t()`` is suggested.
    """

    a: str = "a"
    b: str = "b"
    a_scale: str = "a_scale"
    b_scale: str = "b_scale"
    weight: bool = False
    logical: bool = False


GEMM_NAMES = ArgNames()
LINEAR_NAMES = ArgNames("x", "w", "x_scale", "w_scale", weight=True)


class GroupCounts:
    """``gk`` / ``gn``: the scale groups along K and N of a spec with k, n, group_k, group_n
    (a dense problem's, one expert's of a grouped call)."""

    @property
    def gk(self) -> int:
        return math.ceil(self.k / self.group_k) if self.k else 0

    @property
    def gn(self) -> int:
        return math.ceil(self.n / self.group_n) if self.n else 0


@dataclass(frozen=True)
class ProblemSpec(GroupCounts):
    """Everything a kernel specializes on; hashable, tensor-free (``tileq explain`` builds one)."""

    m: int
    n: int
    k: int
    a_type: OperandType
    b_type: OperandType
    layout: str  # 'rcr' | 'rrr' | 'crr' | 'ccr'
    scheme: Scheme
    a_scale_kind: ScaleKind
    b_scale_kind: ScaleKind
    out_dtype: torch.dtype = torch.bfloat16
    group_k: int = 128
    group_n: int = 1
    a_scale_layout: ScaleLayout = ScaleLayout.ROWMAJOR
    has_bias: bool = False
    has_acc: bool = False
    # fp8/bf8 pairs only: let sm_90's reduced-precision wgmma accumulator run over the whole K
    # loop (torch._scaled_mm's use_fast_accum) instead of promoting to fp32 after every K tile.
    fast_accum: bool = False

    @property
    def integer_mainloop(self) -> bool:
        return integer_mainloop(self.a_type, self.b_type)

    @property
    def acc_dtype(self) -> torch.dtype:
        """The raw accumulator kind: int32 for integer non-group schemes, fp32 otherwise."""
        if self.integer_mainloop and not self.scheme.grouped:
            return torch.int32
        return torch.float32

    @property
    def a_layout(self) -> str:
        return self.layout[0]

    @property
    def b_layout(self) -> str:
        return self.layout[1]


@dataclass
class Problem:
    """A validated call: the spec plus normalized tensors.

    a, b: the logical operands ([M, K] / [K, N] tensors, or PackedInt4 of those logical shapes).
    a_scale: None, 0-d fp32, [M, 1] fp32, or [M, Gk] fp32 (either storage).
    b_scale: None, 0-d fp32, [1, N] fp32, or [Gk, Gn] fp32.
    bias: None or [N] fp32; acc: None or [M, N] of spec.acc_dtype; out: None or [M, N].
    """

    spec: ProblemSpec
    a: object
    b: object
    a_scale: torch.Tensor | None
    b_scale: torch.Tensor | None
    bias: torch.Tensor | None = None
    acc: torch.Tensor | None = None
    out: torch.Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def _storage_tensor(x) -> torch.Tensor:
    return x.data if isinstance(x, PackedInt4) else x


def _matrix_layout(x, arg: str, dims: tuple[str, str], rowchar_dim: int, shown_transposed: bool = False) -> str:
    """'r' or 'c' for a logical 2-D operand from its strides.

    ``rowchar_dim`` is the logical dim whose unit stride means 'r' (1 for A: K contiguous;
    1 for B: N contiguous). A size-1 (or empty) dimension's stride is meaningless and ignored.
    ``shown_transposed``: the caller passed the transpose of ``x`` (linear's weight [N, K]); an
    error shows the caller's shape and strides.
    """
    if isinstance(x, PackedInt4):
        # The packing direction fixes the layout: pairs run along the unit-stride dim.
        return "r" if x.packed_dim == rowchar_dim else "c"
    shape, stride = tuple(x.shape), tuple(x.stride())
    other = 1 - rowchar_dim
    if any(s < 0 for s in stride):
        shown = stride[::-1] if shown_transposed else stride
        raise LayoutError(expect(arg, "non-negative strides", f"strides {shown}"))

    def fits(inner: int) -> bool:
        outer = 1 - inner
        inner_ok = shape[inner] <= 1 or stride[inner] == 1
        outer_ok = shape[outer] <= 1 or stride[outer] >= max(shape[inner], 1)
        return inner_ok and outer_ok

    if fits(rowchar_dim):
        return "r"
    if fits(other):
        return "c"
    names = f"[{dims[0]}, {dims[1]}]"
    along = f"{dims[rowchar_dim]} ('r') or {dims[other]} ('c')"
    if shown_transposed:  # the caller's matrix: its dims, shape and strides; B's layout letters mean nothing
        names, shape, stride = f"[{dims[1]}, {dims[0]}]", shape[::-1], stride[::-1]
        along = f"{dims[other]} or {dims[rowchar_dim]}"
    raise LayoutError(
        expect(
            arg,
            f"a {names} matrix with unit stride along {along} and a leading dimension >= the "
            "other extent (no silent copy)",
            f"shape {shape} with strides {stride}",
        )
    )


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape)


def _check_operand(x, arg: str) -> OperandType:
    t = operand_type(x, arg)
    if len(_shape(x)) != 2:
        raise ShapeError(expect(arg, "a 2-D matrix", f"{len(_shape(x))}-D shape {_shape(x)}"))
    return t


def _as_fp32_scale(s, arg: str) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        if isinstance(s, (int, float)):
            return torch.tensor(float(s), dtype=torch.float32)
        raise DTypeError(expect(arg, "a torch.Tensor, a Python float or None", type(s).__name__))
    if s.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise DTypeError(expect(arg, "dtype float32 (bfloat16/float16 are upcast)", s.dtype))
    return s if s.dtype == torch.float32 else s.float()


def _normalize_a_scale(s, m: int, gk: int, scheme: Scheme, unquantized: bool, arg: str = "a_scale"):
    """Return (kind, tensor, layout) for a_scale (named ``arg`` in errors), or raise naming the
    expected shapes."""
    allowed = _A_KINDS[scheme]
    if s is None:
        if ScaleKind.NONE in allowed or unquantized:
            return ScaleKind.NONE, None, ScaleLayout.ROWMAJOR
        raise ScaleError(expect(arg, f"a scale for scheme '{scheme}'", "None"))
    s = _as_fp32_scale(s, arg)
    shape = tuple(s.shape)
    if s.numel() == 1 and s.dim() <= 1 and ScaleKind.SCALAR in allowed:
        return ScaleKind.SCALAR, s.reshape(()), ScaleLayout.ROWMAJOR
    if ScaleKind.VECTOR in allowed and (shape == (m,) or shape == (m, 1)):
        return ScaleKind.VECTOR, s.reshape(m, 1), ScaleLayout.ROWMAJOR
    if ScaleKind.GROUP in allowed and shape == (m, gk):
        st = tuple(s.stride())
        rowmajor = (gk <= 1 or st[1] == 1) and (m <= 1 or st[0] >= gk)
        preshuffled = (m <= 1 or st[0] == 1) and (gk <= 1 or st[1] >= m)
        if not (rowmajor or preshuffled):
            raise LayoutError(
                expect(
                    arg,
                    f"[M, Gk] = ({m}, {gk}) stored row-major (strides (>=Gk, 1)) or K-group-major "
                    "(strides (1, >=M))",
                    f"strides {st}",
                )
            )
        layout = ScaleLayout.ROWMAJOR if rowmajor else ScaleLayout.PRESHUFFLED
        return ScaleKind.GROUP, s, layout
    raise ShapeError(expect(arg, _a_expectation(allowed, m, gk, scheme), shape))


def _a_expectation(allowed, m: int, gk: int, scheme: Scheme) -> str:
    parts = []
    if ScaleKind.VECTOR in allowed:
        parts.append("shape (M,) or (M, 1)")
    if ScaleKind.SCALAR in allowed:
        parts.append("a scalar")
    if ScaleKind.GROUP in allowed:
        parts.append("shape (M, Gk)")
    if ScaleKind.NONE in allowed:
        parts.append("None")
    return f"{' or '.join(parts)} for scheme '{scheme}' with M={m}, Gk={gk}"


def _normalize_b_scale(s, n: int, gk: int, group_n, group_k: int, scheme: Scheme, unquantized: bool,
                       arg: str = "b_scale"):
    """Return (kind, tensor, group_n) for b_scale (named ``arg`` in errors)."""
    allowed = _B_KINDS[scheme]
    if s is None:
        if ScaleKind.NONE in allowed or unquantized:
            return ScaleKind.NONE, None, group_n or 1
        raise ScaleError(expect(arg, f"a scale for scheme '{scheme}'", "None"))
    s = _as_fp32_scale(s, arg)
    shape = tuple(s.shape)
    if s.numel() == 1 and s.dim() <= 1 and ScaleKind.SCALAR in allowed:
        return ScaleKind.SCALAR, s.reshape(()), group_n or 1
    if ScaleKind.VECTOR in allowed and (shape == (n,) or shape == (1, n)):
        return ScaleKind.VECTOR, s.reshape(1, n), group_n or 1
    if ScaleKind.GROUP in allowed and s.dim() == 2 and shape[0] == gk:
        if group_n is None:
            # Infer the column group from the scale's width: N columns -> 1, ceil(N/128) -> 128.
            if shape[1] == n:
                group_n = 1
            elif shape[1] == math.ceil(n / 128):
                group_n = 128
        if group_n is not None and shape[1] == math.ceil(n / group_n):
            if s.stride(1) != 1 and shape[1] > 1 and s.stride(0) != 1:
                raise LayoutError(
                    expect(arg, "a unit stride along one dimension", f"strides {s.stride()}")
                )
            return ScaleKind.GROUP, s, group_n
        gn_txt = f"ceil(N/{group_n})" if group_n else "N (group_n=1) or ceil(N/128) (group_n=128)"
        raise ShapeError(
            expect(arg, f"shape (Gk, {gn_txt}) = ({gk}, ...) for scheme '{scheme}' with N={n}, "
                   f"group_k={group_k}", shape)
        )
    raise ShapeError(expect(arg, _b_expectation(allowed, n, gk, scheme), shape))


def _b_expectation(allowed, n: int, gk: int, scheme: Scheme) -> str:
    parts = []
    if ScaleKind.VECTOR in allowed:
        parts.append("shape (N,) or (1, N)")
    if ScaleKind.SCALAR in allowed:
        parts.append("a scalar")
    if ScaleKind.GROUP in allowed:
        parts.append("shape (Gk, Gn)")
    if ScaleKind.NONE in allowed:
        parts.append("None")
    return f"{' or '.join(parts)} for scheme '{scheme}' with N={n}, Gk={gk}"


def _check_device(tensors: dict, device: torch.device, a_name: str = "a") -> None:
    for name, t in tensors.items():
        if t is None:
            continue
        dev = t.device
        if dev.type != device.type or (
            dev.index is not None and device.index is not None and dev.index != device.index
        ):
            raise UnsupportedError(expect(name, f"a tensor on {device} (the device of {a_name})", dev))


def build_problem(
    a,
    b,
    a_scale,
    b_scale,
    *,
    scheme,
    out_dtype=torch.bfloat16,
    bias=None,
    acc=None,
    group_k: int = 128,
    group_n: int | None = None,
    out=None,
    fast_accum: bool = False,
    names: ArgNames = GEMM_NAMES,
) -> Problem:
    """Validate a ``gemm`` call and return its normalized Problem. ``names``: the caller's names of
    a, b and their scales, used in every message (``LINEAR_NAMES`` for ``tileq.linear``)."""
    scheme = parse_scheme(scheme)
    a_type = _check_operand(a, names.a)
    b_type = _check_operand(b, names.b)
    check_pair(a_type, b_type, f"{names.a}, {names.b}")
    m, k = _shape(a)
    k_b, n = _shape(b)
    if k != k_b:
        raise ShapeError(_k_mismatch(m, k, _shape(b), names))
    if not isinstance(group_k, int) or group_k <= 0:
        raise ShapeError(expect("group_k", "a positive int", group_k))
    if group_n is not None and (isinstance(group_n, bool) or not isinstance(group_n, int)
                                or group_n not in GROUP_NS):
        raise ShapeError(expect("group_n", "1 or 128 (the columns of N one scale group spans), or None "
                                "to read it off the scale's shape", repr(group_n)))
    if out_dtype not in OUT_DTYPES:
        raise DTypeError(expect("out_dtype", "torch.bfloat16, torch.float16 or torch.float32", out_dtype))

    layout = (
        _matrix_layout(a, names.a, ("M", "K"), 1)
        + _matrix_layout(b, names.b, ("K", "N"), 1, shown_transposed=names.weight)
        + "r"
    )
    gk = math.ceil(k / group_k) if k else 0
    a_kind, a_s, a_sl = _normalize_a_scale(a_scale, m, gk, scheme, a_type.is_wide_float, names.a_scale)
    b_kind, b_s, gn = _normalize_b_scale(
        b_scale, n, gk, group_n, group_k, scheme, b_type.is_wide_float, names.b_scale
    )

    spec = ProblemSpec(
        m=m, n=n, k=k, a_type=a_type, b_type=b_type, layout=layout, scheme=scheme,
        a_scale_kind=a_kind, b_scale_kind=b_kind, out_dtype=out_dtype, group_k=group_k,
        group_n=gn, a_scale_layout=a_sl, has_bias=bias is not None, has_acc=acc is not None,
        fast_accum=bool(fast_accum) and a_type.is_float8 and b_type.is_float8,
    )
    _check_int32_overflow(spec, names.b)

    device = _storage_tensor(a).device
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise DTypeError(expect("bias", "a torch.Tensor or None", type(bias).__name__))
        if tuple(bias.shape) != (n,):
            raise ShapeError(expect("bias", f"shape (N,) = ({n},)", tuple(bias.shape)))
        if not bias.is_floating_point() or bias.dtype.itemsize < 2:
            raise DTypeError(expect("bias", "a float32, bfloat16 or float16 tensor", bias.dtype))
        bias = bias.float()
    if acc is not None:
        if not isinstance(acc, torch.Tensor):
            raise DTypeError(expect("acc", "a torch.Tensor or None", type(acc).__name__))
        if tuple(acc.shape) != (m, n):
            raise ShapeError(expect("acc", f"shape (M, N) = ({m}, {n})", tuple(acc.shape)))
        if acc.dtype != spec.acc_dtype:
            raise DTypeError(
                expect("acc", f"dtype {spec.acc_dtype} (the raw accumulator of this problem)", acc.dtype)
            )
        if n > 1 and acc.stride(1) != 1 or m > 1 and acc.stride(0) < n:
            raise LayoutError(
                expect("acc", "a row-major [M, N] tensor (unit column stride, leading dim >= N)",
                       f"strides {tuple(acc.stride())}")
            )
    if out is not None:
        _check_out(out, m, n, out_dtype, device)
    _check_device(
        {names.b: _storage_tensor(b), names.a_scale: a_s, names.b_scale: b_s, "bias": bias, "acc": acc},
        device, names.a,
    )
    # Python-float scales are made on the CPU; move them (tiny) to the operands' device.
    if a_s is not None and a_s.device != device and a_s.dim() == 0:
        a_s = a_s.to(device)
    if b_s is not None and b_s.device != device and b_s.dim() == 0:
        b_s = b_s.to(device)
    return Problem(spec, a, b, a_s, b_s, bias, acc, out, device)


def _k_mismatch(m: int, k: int, b_shape: tuple, names: ArgNames) -> str:
    """The message for a B whose K is not A's, in the caller's terms, with the transpose that would
    fit when one would."""
    if names.weight:
        w_shape = b_shape[::-1]
        msg = expect(names.b, f"an nn.Linear weight [N, K] with K={k} ({names.a}'s last dimension)",
                     f"shape {w_shape}")
        if w_shape[0] == k:
            msg += (f"; did you mean {names.b}.t()? tileq.linear takes the nn.Linear weight [N, K] "
                    f"(tileq.gemm takes the logical B [K, N])")
        return msg
    logical = "logical " if names.logical else ""
    msg = expect(names.b, f"K={k} rows ({names.a} is [{logical}{m}, {k}])", f"shape {b_shape}")
    if b_shape[1] == k and not names.logical:
        msg += (f"; did you mean {names.b}.t()? tileq.gemm takes the logical B [K, N]; "
                f"tileq.linear takes an nn.Linear weight [N, K]")
    return msg


def _check_out(out, m: int, n: int, out_dtype, device) -> None:
    if not isinstance(out, torch.Tensor):
        raise DTypeError(expect("out", "a torch.Tensor or None", type(out).__name__))
    if tuple(out.shape) != (m, n):
        raise ShapeError(expect("out", f"shape (M, N) = ({m}, {n})", tuple(out.shape)))
    if out.dtype != out_dtype:
        raise DTypeError(expect("out", f"dtype {out_dtype} (out_dtype)", out.dtype))
    if out.device.type != device.type:
        raise UnsupportedError(expect("out", f"a tensor on {device}", out.device))
    if n > 1 and out.stride(1) != 1 or m > 1 and out.stride(0) < n:
        raise LayoutError(
            expect("out", "a row-major [M, N] tensor (unit column stride, leading dim >= N)",
                   f"strides {tuple(out.stride())}")
        )


def _check_int32_overflow(spec: ProblemSpec, b_name: str = "b") -> None:
    """docs/schemes.md: an int32 accumulation that adversarial data could overflow is refused."""
    if not spec.integer_mainloop:
        return
    span = spec.group_k if spec.scheme.grouped else spec.k
    limit = int((2**31 - 1) // (spec.a_type.max_abs * spec.b_type.max_abs))
    if span > limit:
        what = f"group_k={spec.group_k}" if spec.scheme.grouped else f"K={spec.k}"
        raise UnsupportedError(
            expect(
                b_name,
                f"an int32 accumulation span of at most {limit} for {spec.a_type}x{spec.b_type} "
                "(a longer one can overflow int32 on adversarial data)",
                what,
            )
        )
