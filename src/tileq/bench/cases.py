"""Cases: what is measured per shape, and the seeded operands each case is built from.

A case is (scheme, A dtype, B dtype, layout, A-scale storage, accumulation), written
``scheme:AxB:layout`` with an optional ``:preshuffled`` (K-group-major A scales) or ``:fast``
(fp8 tensor/rowcol with fast accumulation, against cuBLASLt with use_fast_accum=True), e.g.
``rowcol:i8xi8:rcr``, ``aquant:i4xfp8:crr:preshuffled`` or ``rowcol:fp8xfp8:rcr:fast``. B type
``i4p``: the int4 weight prepacked (``tileq.PrepackedInt4``, the kernel names' ``xi4p``), timed
through ``tileq.linear`` on it, e.g. ``bquant:bf16xi4p:rcr`` (W4A16, group scales) or
``bquant:fp8xi4p:rcr`` (W4A8, per-token activation scales); layout rcr only, schemes bquant
(group scales), rowcol (per-channel) and tensor. Named sets: ``headline`` (the default),
``aquant28`` (CK's AQuant parity matrix, from ``catalog.aquant_matrix()``), ``gluon`` (the
schemes the sm_90 Gluon prefill kernel runs by default, and bquant's one-column groups it runs
swapped) and ``int4`` (prepacked W4A16 and W4A8 with tileq's int8 and fp8 rowcol beside them).

Operands: seeded bf16 activations X [M, K] and weights W [N, K] are drawn on the device and
quantized with ``tileq.quant`` at each scheme's canonical granularity (the one the catalog builds
and tests with). Drawing floats and quantizing them, rather than drawing quantized values, gives
every case the same underlying product, so the SQNR against the bf16 product X @ W.t() compares
schemes, and the torch baselines get the same quantized tensors tileq gets.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from ..dtypes import OperandType, PackedInt4, check_pair, parse_operand_type
from ..errors import LayoutError, ShapeError, UnsupportedError, expect
from ..problem import LAYOUTS, ScaleLayout, Scheme, parse_scheme

GROUP_K = 128  # the default group_k (docs/schemes.md section 1); the block-wise torch baseline assumes it too


@dataclass(frozen=True)
class Case:
    scheme: Scheme
    a: OperandType
    b: OperandType
    layout: str = "rcr"
    a_scale_layout: ScaleLayout = ScaleLayout.ROWMAJOR
    fast_accum: bool = False
    prepacked: bool = False  # B an int4 weight prepacked (tileq.PrepackedInt4), run by tileq.linear

    @property
    def name(self) -> str:
        base = f"{self.scheme.value}:{self.a.value}x{self.b_name}:{self.layout}"
        base += ":preshuffled" if self.a_scale_layout is ScaleLayout.PRESHUFFLED else ""
        return base + (":fast" if self.fast_accum else "")

    @property
    def b_name(self) -> str:
        """B's type in the case's name: 'i4p' for a prepacked int4 weight."""
        return PREPACKED_B if self.prepacked else self.b.value

    @property
    def dtypes(self) -> str:
        return f"{self.a.value}x{self.b_name}"

    @property
    def prepacked_kinds(self) -> tuple[str, str, str]:
        """A prepacked case's call as its ``PrepackedSpec`` holds it: (x_type, x_kind,
        w_kind), e.g. ('fp8', 'vector', 'group') for ``bquant:fp8xi4p:rcr``."""
        from ..kernels.int4p.config import W_SCALE_OF_SCHEME, X_TYPES

        x_type = X_TYPES[self.a.torch_dtype]
        if x_type in ("bf16", "fp16"):
            x_kind = "none"
        else:
            x_kind = "scalar" if self.scheme is Scheme.TENSOR else "vector"
        return x_type, x_kind, W_SCALE_OF_SCHEME[self.scheme.value]

    @property
    def group_n(self) -> int:
        # abquant is DeepSeek's 1x128 x 128x128; bquant scales every column (group_n = 1).
        return 128 if self.scheme is Scheme.ABQUANT else 1

    @property
    def slug(self) -> str:
        """File-name-safe form of the name (plots)."""
        return self.name.replace(":", "_")

    def spec(self, m: int, n: int, k: int):
        """The ProblemSpec tileq.gemm builds from this case's operands (for planning ahead; for a
        prepacked case: the same product on the unprepacked weight, what its reference computes)."""
        from ..problem import ProblemSpec, ScaleKind

        wide_a = self.a.is_wide_float
        a_kind = {
            Scheme.TENSOR: ScaleKind.SCALAR, Scheme.ROWCOL: ScaleKind.VECTOR,
            Scheme.AQUANT: ScaleKind.GROUP, Scheme.BQUANT: ScaleKind.VECTOR,
            Scheme.ABQUANT: ScaleKind.GROUP,
        }[self.scheme]
        b_kind = {
            Scheme.TENSOR: ScaleKind.SCALAR, Scheme.ROWCOL: ScaleKind.VECTOR,
            Scheme.AQUANT: ScaleKind.SCALAR, Scheme.BQUANT: ScaleKind.GROUP,
            Scheme.ABQUANT: ScaleKind.GROUP,
        }[self.scheme]
        return ProblemSpec(
            m=m, n=n, k=k, a_type=self.a, b_type=self.b, layout=self.layout, scheme=self.scheme,
            a_scale_kind=ScaleKind.NONE if wide_a else a_kind, b_scale_kind=b_kind,
            group_k=GROUP_K, group_n=self.group_n if self.scheme.b_grouped else 1,
            # A single row has no order: build_problem calls its scale row-major.
            a_scale_layout=self.a_scale_layout if m > 1 else ScaleLayout.ROWMAJOR,
        )

    def unsupported_reason(self, m: int, n: int, k: int) -> str | None:
        """Why this case cannot run an (m, n, k) shape, or None."""
        # int4 packs pairs along the operand's unit-stride dimension (docs/schemes.md section 3).
        if self.a is OperandType.I4:
            dim, extent = ("K", k) if self.layout[0] == "r" else ("M", m)
            if extent % 2:
                return f"int4 A in layout '{self.layout[0]}' packs pairs along {dim}: {dim}={extent} is odd"
        if self.b is OperandType.I4:
            dim, extent = ("N", n) if self.layout[1] == "r" else ("K", k)
            if extent % 2:
                return f"int4 B in layout '{self.layout[1]}' packs pairs along {dim}: {dim}={extent} is odd"
        if self.a.is_integer and self.b.is_integer and not self.scheme.grouped:
            limit = int((2**31 - 1) // (self.a.max_abs * self.b.max_abs))
            if k > limit:
                return f"K={k} exceeds the int32-safe accumulation span {limit}"
        return None


PREPACKED_B = "i4p"  # B's name for a prepacked int4 weight
PREPACKED_A = (OperandType.BF16, OperandType.FP16, OperandType.FP8, OperandType.BF8)
PREPACKED_SCHEMES = (Scheme.BQUANT, Scheme.ROWCOL, Scheme.TENSOR)


def parse_case(text: str) -> Case:
    """``scheme:AxB:layout[:preshuffled|:fast]`` -> Case (refused with the expected form named)."""
    form = "scheme:AxB:layout[:preshuffled|:fast], e.g. 'rowcol:i8xi8:rcr'"
    parts = str(text).strip().split(":")
    if len(parts) not in (3, 4) or "x" not in parts[1]:
        raise ShapeError(expect("case", form, repr(text)))
    scheme = parse_scheme(parts[0])
    a_name, _, b_name = parts[1].partition("x")
    prepacked = b_name.strip().lower() == PREPACKED_B
    a, b = parse_operand_type(a_name), parse_operand_type("i4" if prepacked else b_name)
    check_pair(a, b)
    layout = parts[2].lower()
    if layout not in LAYOUTS:
        raise LayoutError(expect("case layout", f"one of {', '.join(LAYOUTS)}", repr(parts[2])))
    if prepacked:
        return _prepacked_case(text, scheme, a, layout, parts)
    a_scale_layout = ScaleLayout.ROWMAJOR
    fast = False
    if len(parts) == 4:
        option = parts[3].lower()
        if option not in ("preshuffled", "fast"):
            raise ShapeError(expect("case", form, repr(text)))
        if option == "preshuffled" and not scheme.a_grouped:
            raise UnsupportedError(
                expect("case", "':preshuffled' only with aquant or abquant (group A scales)", repr(text))
            )
        if option == "fast" and (scheme.grouped or not (a.is_float8 and b.is_float8)):
            raise UnsupportedError(
                expect("case", "':fast' only with fp8/bf8 tensor or rowcol (grouped schemes promote "
                       "per K tile by construction)", repr(text))
            )
        a_scale_layout = ScaleLayout.PRESHUFFLED if option == "preshuffled" else a_scale_layout
        fast = option == "fast"
    return Case(scheme, a, b, layout, a_scale_layout, fast)


def _prepacked_case(text: str, scheme: Scheme, a: OperandType, layout: str, parts: list[str]) -> Case:
    """A case of B ``i4p``: an nn.Linear int4 weight prepacked, x [M, K] row-major (layout rcr)."""
    if layout != "rcr" or len(parts) != 3:
        raise LayoutError(expect("case", "a prepacked int4 weight in layout rcr with no option (x [M, K] "
                                 "row-major, W [N, K]: 'bquant:bf16xi4p:rcr')", repr(text)))
    if a not in PREPACKED_A:
        raise UnsupportedError(expect("case", "bf16, fp16, fp8 or bf8 activations on a prepacked int4 weight",
                                      repr(text)))
    if scheme not in PREPACKED_SCHEMES:
        raise UnsupportedError(expect("case", "bquant (group scales), rowcol (per-channel) or tensor on a "
                                      "prepacked int4 weight", repr(text)))
    return Case(scheme, a, OperandType.I4, layout, prepacked=True)


T = OperandType
# The headline set: the schemes users reach for today, in the nn.Linear layout.
HEADLINE: tuple[Case, ...] = (
    Case(Scheme.ROWCOL, T.I8, T.I8),
    Case(Scheme.TENSOR, T.FP8, T.FP8),
    Case(Scheme.ROWCOL, T.FP8, T.FP8),
    Case(Scheme.AQUANT, T.FP8, T.FP8),
    Case(Scheme.ABQUANT, T.FP8, T.FP8),
    Case(Scheme.BQUANT, T.FP8, T.I4),
    Case(Scheme.BQUANT, T.BF16, T.I4),
)


def aquant28() -> tuple[Case, ...]:
    """CK's AQuant matrix as cases: 16 decode families (row-major A scales) + 12 preshufflequant."""
    from ..catalog.families import aquant_matrix

    cases = []
    for fam in aquant_matrix():
        pre = fam.pipeline == "preshufflequant"
        cases.append(
            Case(fam.scheme, fam.a, fam.b, fam.layout,
                 ScaleLayout.PRESHUFFLED if pre else ScaleLayout.ROWMAJOR)
        )
    return tuple(dict.fromkeys(cases))


# The sm_90 Gluon prefill kernel's cases (dispatch/gluon.py): fp8 rowcol precise and with fast
# accumulation, DeepSeek's 1x128 x 128x128 blocks, int8 rowcol, and fp8 with one-column b_scale
# groups (bquant, run swapped; torch has no such product: no same-math baseline).
GLUON: tuple[Case, ...] = (
    Case(Scheme.ROWCOL, T.FP8, T.FP8),
    Case(Scheme.ROWCOL, T.FP8, T.FP8, fast_accum=True),
    Case(Scheme.ABQUANT, T.FP8, T.FP8),
    Case(Scheme.ROWCOL, T.I8, T.I8),
    Case(Scheme.BQUANT, T.FP8, T.FP8),
)


# Prepacked int4 weights (tileq.prepacked): W4A16 and W4A8 (per-token fp8 activations) with group
# scales, and tileq's int8 and fp8 rowcol on the same shapes in the same run (the report sets them
# side by side: the speeds an int4 weight is measured against).
INT4: tuple[Case, ...] = (
    Case(Scheme.BQUANT, T.BF16, T.I4, prepacked=True),
    Case(Scheme.BQUANT, T.FP8, T.I4, prepacked=True),
    Case(Scheme.ROWCOL, T.I8, T.I8),
    Case(Scheme.ROWCOL, T.FP8, T.FP8),
)


CASE_SETS = {"headline": lambda: HEADLINE, "aquant28": aquant28, "gluon": lambda: GLUON, "int4": lambda: INT4}


def parse_case_list(text: str, sep: str = ",") -> tuple[Case, ...]:
    """A list of case names and/or set names ('headline', 'aquant28'), in order, deduplicated."""
    out: list[Case] = []
    for item in (t.strip() for t in str(text).split(sep)):
        if not item:
            continue
        if item.lower() in CASE_SETS:
            out.extend(CASE_SETS[item.lower()]())
        else:
            out.append(parse_case(item))
    if not out:
        raise ShapeError(expect("cases", f"case names or sets ({', '.join(CASE_SETS)})", repr(text)))
    return tuple(dict.fromkeys(out))


# ----------------------------------------------------------------------------- operands


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def draw_activation(m: int, k: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(_seed(seed, "x", m, k))
    return torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)


def draw_weight(n: int, k: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(_seed(seed, "w", n, k))
    # 1/sqrt(K) keeps the outputs O(1), as in an initialized layer.
    return (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)


def _in_layout(t: torch.Tensor, char: str) -> torch.Tensor:
    """'r': row-major; 'c': column-major (a copy only when the strides differ)."""
    if char == "r":
        return t.contiguous()
    return t if t.t().is_contiguous() else t.t().contiguous().t()


def storage_bytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, PackedInt4):
        return x.data.numel()
    return x.numel() * x.element_size()


@dataclass
class WeightSide:
    """The logical B = W.t() [K, N] of one case, quantized once and reused across M."""

    w: torch.Tensor  # bf16 [N, K], the unquantized weight
    b: object  # tensor or PackedInt4, logical [K, N], in the case's B layout
    b_scale: torch.Tensor | None
    prepacked: object = None  # a prepacked case: b as tileq.PrepackedInt4 [N, K]


@dataclass
class Operands:
    case: Case
    m: int
    n: int
    k: int
    x: torch.Tensor  # bf16 [M, K] unquantized activations
    w: torch.Tensor  # bf16 [N, K] unquantized weight
    a: object
    b: object
    a_scale: torch.Tensor | None
    b_scale: torch.Tensor | None
    w_prepacked: object = None  # a prepacked case: the weight as tileq.PrepackedInt4 [N, K]

    @property
    def kwargs(self) -> dict:
        kw = dict(scheme=self.case.scheme.value, out_dtype=torch.bfloat16, group_k=GROUP_K)
        if self.case.fast_accum:
            kw["fast_accum"] = True
        if self.case.scheme.b_grouped:
            kw["group_n"] = self.case.group_n
        return kw

    def gemm(self, **extra) -> torch.Tensor:
        from ..api import gemm

        return gemm(self.a, self.b, self.a_scale, self.b_scale, **{**self.kwargs, **extra})

    def tileq(self, **extra) -> torch.Tensor:
        """What the tileq row runs: ``gemm``, or for a prepacked case ``tileq.linear`` on the
        PrepackedInt4 (the same product; ``extra``: backend, out)."""
        if self.w_prepacked is None:
            return self.gemm(**extra)
        from ..api import linear

        return linear(self.a, self.w_prepacked, self.a_scale, self.b_scale, scheme=self.case.scheme.value,
                      out_dtype=torch.bfloat16, group_k=GROUP_K, **extra)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def bytes(self) -> int:
        """A + B + scales + C (bf16), each counted once: the least a kernel must move."""
        b = self.b if self.w_prepacked is None else self.w_prepacked.data
        return (
            storage_bytes(self.a) + storage_bytes(b) + storage_bytes(self.a_scale)
            + storage_bytes(self.b_scale) + 2 * self.m * self.n
        )


def quantize_weight_side(case: Case, w: torch.Tensor) -> WeightSide:
    from ..quant import quantize_b

    b_float = _in_layout(w.t(), case.layout[1])
    pack_dim = 1 if case.layout[1] == "r" else 0
    if case.b.is_wide_float:
        return WeightSide(w, b_float.to(case.b.torch_dtype), None)
    granularity = {
        Scheme.TENSOR: "tensor",
        Scheme.ROWCOL: "col",
        # CK's AQuant leaves B unscaled; a real fp8/bf8 weight still needs one multiplier, and
        # aquant accepts a scalar b_scale.
        Scheme.AQUANT: "tensor",
        Scheme.BQUANT: "group",
        Scheme.ABQUANT: "group",
    }[case.scheme]
    q, scale = quantize_b(
        b_float, case.b.value, granularity=granularity, group_k=GROUP_K, group_n=case.group_n,
        pack_dim=pack_dim,
    )
    if not isinstance(q, PackedInt4):
        q = _in_layout(q, case.layout[1])
    if case.prepacked:
        from ..prepacked import prepack_int4

        return WeightSide(w, q, scale, prepack_int4(q.t()))  # (q.t(): W [N, K] packed along K)
    return WeightSide(w, q, scale)


def quantize_activation_side(case: Case, x: torch.Tensor):
    """(a, a_scale) for the case: the logical A [M, K] in the case's A layout."""
    from ..quant import preshuffle_scale, quantize_a

    a_float = _in_layout(x, case.layout[0])
    if case.a.is_wide_float:
        return a_float.to(case.a.torch_dtype), None
    granularity = {
        Scheme.TENSOR: "tensor",
        Scheme.ROWCOL: "row",
        Scheme.AQUANT: "group",
        Scheme.BQUANT: "row",
        Scheme.ABQUANT: "group",
    }[case.scheme]
    pack_dim = 1 if case.layout[0] == "r" else 0
    q, scale = quantize_a(a_float, case.a.value, granularity=granularity, group_k=GROUP_K,
                          pack_dim=pack_dim)
    if not isinstance(q, PackedInt4):
        q = _in_layout(q, case.layout[0])
    if case.a_scale_layout is ScaleLayout.PRESHUFFLED:
        scale = preshuffle_scale(scale)
    return q, scale


def build_operands(case: Case, x: torch.Tensor, weight: WeightSide) -> Operands:
    m, k = x.shape
    n = weight.w.shape[0]
    if weight.w.shape[1] != k:
        raise ShapeError(expect("weight", f"K={k} columns", tuple(weight.w.shape)))
    a, a_scale = quantize_activation_side(case, x)
    return Operands(case, m, n, k, x, weight.w, a, weight.b, a_scale, weight.b_scale, weight.prepacked)

