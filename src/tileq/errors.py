"""Typed errors of tileq.

Every refusal names the argument, what was expected and what was got, e.g.
``a_scale: expected shape (M,) or (M, 1) for scheme 'rowcol' with M=37, got (37, 2)``.
Each class is also a ValueError or TypeError so callers that catch the builtin kinds keep working.
"""

from __future__ import annotations


class TileqError(Exception):
    """Base class of every error tileq raises on purpose."""


class ShapeError(TileqError, ValueError):
    """An operand, scale, bias, accumulator or output has the wrong shape."""


class DTypeError(TileqError, TypeError):
    """An operand or scale has a dtype the scheme or the operand pair does not accept."""


class LayoutError(TileqError, ValueError):
    """Strides that no layout (rcr, rrr, crr, ccr) describes; tileq never copies silently."""


class ScaleError(TileqError, ValueError):
    """A scale that cannot be used: wrong kind for the scheme, non-finite data to quantize."""


class UnsupportedError(TileqError, ValueError):
    """A valid request that this build, backend or configuration cannot honour."""


class ArchError(TileqError, ValueError):
    """An architecture missing from the arch table, or one that cannot run a dtype."""


class CheckpointError(TileqError, ValueError):
    """A checkpoint that cannot be read: missing, truncated, corrupt or inconsistent files."""


def expect(arg: str, expected: str, got: object) -> str:
    """Format the standard message: ``arg: expected ..., got ...``."""
    return f"{arg}: expected {expected}, got {got}"


__all__ = [
    "TileqError",
    "ShapeError",
    "DTypeError",
    "LayoutError",
    "ScaleError",
    "UnsupportedError",
    "ArchError",
    "CheckpointError",
    "expect",
]
