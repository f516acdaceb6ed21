"""Operand types, the packed-int4 wrapper and the legal operand pairs.

An operand type has a short name used in kernel names (``i8``, ``fp8``, ``bf8``, ``i4``,
``bf16``, ``fp16``). Packed int4 follows docs/schemes.md: two values per byte along the operand's
unit-stride dimension, element 2j in the high nibble, value = nibble - 8.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .errors import DTypeError, LayoutError, ShapeError, expect


class OperandType(str, enum.Enum):
    """A GEMM operand's element type; the value is the short name used in kernel names."""

    I8 = "i8"
    FP8 = "fp8"  # torch.float8_e4m3fn
    BF8 = "bf8"  # torch.float8_e5m2
    I4 = "i4"  # PackedInt4
    BF16 = "bf16"
    FP16 = "fp16"

    def __str__(self) -> str:  # names and messages show the short name
        return self.value

    @property
    def is_integer(self) -> bool:
        return self in (OperandType.I8, OperandType.I4)

    @property
    def is_float8(self) -> bool:
        return self in (OperandType.FP8, OperandType.BF8)

    @property
    def is_wide_float(self) -> bool:
        """bf16/fp16: the unquantized side of a weight-only scheme."""
        return self in (OperandType.BF16, OperandType.FP16)

    @property
    def max_abs(self) -> float:
        """Largest magnitude a value of this type can hold (int8: 128 for -128)."""
        return _MAX_ABS[self]

    @property
    def torch_dtype(self) -> torch.dtype:
        """Element dtype of the storage (uint8 for packed int4)."""
        return _TORCH_OF[self]


_MAX_ABS = {
    OperandType.I8: 128.0,
    OperandType.I4: 8.0,
    OperandType.FP8: 448.0,
    OperandType.BF8: 57344.0,
    OperandType.BF16: 3.3895313892515355e38,
    OperandType.FP16: 65504.0,
}

_TORCH_OF = {
    OperandType.I8: torch.int8,
    OperandType.FP8: torch.float8_e4m3fn,
    OperandType.BF8: torch.float8_e5m2,
    OperandType.I4: torch.uint8,
    OperandType.BF16: torch.bfloat16,
    OperandType.FP16: torch.float16,
}

_OF_TORCH = {v: k for k, v in _TORCH_OF.items() if k is not OperandType.I4}

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def parse_operand_type(name: str | OperandType) -> OperandType:
    """Accept a short name (``i8``), a long one (``int8``, ``fp8_e4m3``, ``pk_int4``) or the enum."""
    if isinstance(name, OperandType):
        return name
    if isinstance(name, torch.dtype) and name in _OF_TORCH:
        return _OF_TORCH[name]
    key = str(name).lower()
    if key in _ALIASES:
        return _ALIASES[key]
    known = ", ".join(sorted(_ALIASES))
    raise DTypeError(expect("dtype", f"one of {known}", repr(name)))


_ALIASES = {
    "i8": OperandType.I8,
    "int8": OperandType.I8,
    "fp8": OperandType.FP8,
    "e4m3": OperandType.FP8,
    "fp8_e4m3": OperandType.FP8,
    "float8_e4m3fn": OperandType.FP8,
    "bf8": OperandType.BF8,
    "e5m2": OperandType.BF8,
    "fp8_e5m2": OperandType.BF8,
    "float8_e5m2": OperandType.BF8,
    "i4": OperandType.I4,
    "int4": OperandType.I4,
    "pk_int4": OperandType.I4,
    "bf16": OperandType.BF16,
    "bfloat16": OperandType.BF16,
    "fp16": OperandType.FP16,
    "float16": OperandType.FP16,
    "half": OperandType.FP16,
}


# Legal (A, B) pairs, docs/schemes.md section 1 "Operand dtypes".
_F8 = (OperandType.FP8, OperandType.BF8)
LEGAL_PAIRS: frozenset[tuple[OperandType, OperandType]] = frozenset(
    [(OperandType.I8, OperandType.I8)]
    + [(a, b) for a in _F8 for b in _F8]
    + [(OperandType.I4, b) for b in _F8]
    + [
        (a, OperandType.I4)
        for a in (*_F8, OperandType.I8, OperandType.BF16, OperandType.FP16)
    ]
    + [
        (a, b)
        for a in (OperandType.BF16, OperandType.FP16)
        for b in (OperandType.I8, OperandType.FP8)
    ]
)


def compute_type(a: OperandType, b: OperandType) -> OperandType:
    """The type both operands are converted to in registers before the matrix instruction.

    int4 values -8..7 are exact in every other operand type, and int8/fp8 are exact in bf16/fp16,
    so these conversions lose nothing.
    """
    if a is OperandType.I4:
        return b
    if b is OperandType.I4:
        return a
    # i8xi8, bf16/fp16 x i8/fp8 (the narrow side widens), and fp8/bf8 pairs, where this is A's
    # type: a mixed e4m3 x e5m2 pair keeps both types (launch._compute_types), the mma takes both.
    return a


def mma_types(a: OperandType, b: OperandType) -> tuple[OperandType, OperandType]:
    """The (A, B) types the matrix instruction takes: a mixed e4m3 x e5m2 pair stays mixed, every
    other pair meets at ``compute_type``."""
    if a.is_float8 and b.is_float8:
        return a, b
    ct = compute_type(a, b)
    return ct, ct


def integer_mainloop(a: OperandType, b: OperandType) -> bool:
    """True when products accumulate exactly in int32 (int8 x int8, int8 x int4)."""
    return a.is_integer and b.is_integer


def check_pair(a: OperandType, b: OperandType, arg: str = "a, b") -> None:
    """A DTypeError naming ``arg`` (the caller's names of the two operands) unless a x b is legal."""
    if (a, b) not in LEGAL_PAIRS:
        legal = ", ".join(sorted(f"{x}x{y}" for x, y in LEGAL_PAIRS))
        raise DTypeError(expect(arg, f"a legal operand pair ({legal})", f"{a}x{b}"))


@dataclass(frozen=True, eq=False)
class PackedInt4:
    """A logical int4 matrix stored two values per byte.

    ``data`` is a 2-D uint8 tensor in the same orientation as the logical matrix, with the packed
    dimension (``packed_dim``) halved and of unit stride. ``shape`` is the logical shape; the
    packed extent is ``shape[packed_dim] // 2`` (the logical packed extent must be even).

    ``pack_int4(x, dim)`` makes one from int values in [-8, 7]; ``.t()`` transposes the logical
    matrix without moving bytes (an nn.Linear weight [N, K] packed along K becomes the logical
    B [K, N] packed along K, layout 'c').
    """

    data: torch.Tensor
    shape: tuple[int, int]
    packed_dim: int

    def __post_init__(self) -> None:
        data = self.data
        if not isinstance(data, torch.Tensor):
            raise DTypeError(expect("PackedInt4.data", "a torch.Tensor", type(data).__name__))
        if data.dtype != torch.uint8:
            raise DTypeError(expect("PackedInt4.data", "dtype torch.uint8", data.dtype))
        if data.dim() != 2:
            raise ShapeError(expect("PackedInt4.data", "a 2-D tensor", f"{data.dim()}-D"))
        if self.packed_dim not in (0, 1):
            raise ShapeError(expect("PackedInt4.packed_dim", "0 or 1", self.packed_dim))
        shape = tuple(int(s) for s in self.shape)
        if len(shape) != 2 or min(shape) < 0:
            raise ShapeError(expect("PackedInt4.shape", "two non-negative extents", self.shape))
        object.__setattr__(self, "shape", shape)
        p = self.packed_dim
        if shape[p] % 2:
            raise ShapeError(
                expect(
                    "PackedInt4.shape",
                    f"an even extent along the packed dimension {p}",
                    f"{shape} (odd packed extent {shape[p]})",
                )
            )
        expected_data = list(shape)
        expected_data[p] //= 2
        if tuple(data.shape) != tuple(expected_data):
            raise ShapeError(
                expect(
                    "PackedInt4.data",
                    f"shape {tuple(expected_data)} (half of logical {shape} along dim {p})",
                    tuple(data.shape),
                )
            )
        if data.shape[p] > 1 and data.stride(p) != 1:
            raise LayoutError(
                expect(
                    "PackedInt4.data",
                    f"unit stride along the packed dimension {p}",
                    f"strides {tuple(data.stride())}",
                )
            )

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> str:
        return "pk_int4"

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def t(self) -> "PackedInt4":
        return PackedInt4(self.data.t(), (self.shape[1], self.shape[0]), 1 - self.packed_dim)

    def to(self, device) -> "PackedInt4":
        return PackedInt4(self.data.to(device), self.shape, self.packed_dim)

    def __repr__(self) -> str:
        return (
            f"PackedInt4(shape={self.shape}, packed_dim={self.packed_dim}, "
            f"bytes={self.data.numel()}, device={self.data.device})"
        )


def operand_type(x, arg: str) -> OperandType:
    """The OperandType of a tensor or PackedInt4 argument, or a DTypeError naming ``arg``."""
    if isinstance(x, PackedInt4):
        return OperandType.I4
    if not isinstance(x, torch.Tensor):
        raise DTypeError(expect(arg, "a torch.Tensor or tileq.PackedInt4", type(x).__name__))
    if x.dtype == torch.uint8:
        raise DTypeError(
            expect(
                arg,
                "int8, float8_e4m3fn, float8_e5m2, bfloat16, float16 or tileq.PackedInt4",
                "torch.uint8 (wrap packed int4 data in tileq.PackedInt4 to give its logical shape)",
            )
        )
    if x.dtype not in _OF_TORCH:
        raise DTypeError(
            expect(
                arg,
                "int8, float8_e4m3fn, float8_e5m2, bfloat16, float16 or tileq.PackedInt4",
                x.dtype,
            )
        )
    return _OF_TORCH[x.dtype]
