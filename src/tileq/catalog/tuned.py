"""Per-GPU tuned tables (written by ``tileq tune``); a miss falls back to the heuristic."""

from __future__ import annotations

from ..problem import ProblemSpec
from .arch import ArchInfo
from .config import TileConfig


def lookup(spec: ProblemSpec, arch: ArchInfo, pipeline: str) -> tuple[TileConfig, str] | None:
    """(config, source) from a shipped or user table, or None (no table covers this problem)."""
    return None
