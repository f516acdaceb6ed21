"""Per-GPU tuned tables (written by ``tileq tune``); a miss falls back to the heuristic.

A table is a JSON file recording the GPU, its compute capability, date, Triton and torch
versions and the command that produced it, and entries keyed by
``{family}|m{M bucket}|n{N}|k{K}`` -> config tag. Shipped tables live in
``tileq/dispatch/data/tuned/``; ``TILEQ_TUNED_TABLES`` (os.pathsep-separated files) adds more,
which win over shipped ones. A malformed table, or one for another arch or GPU, is refused
with one warning naming the file and the reason, and the heuristic is used.
"""

from __future__ import annotations

import json
import os
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path

from ..problem import ProblemSpec
from ..device import ArchInfo
from ..kernels.config import TileConfig, config_problem

REQUIRED = ("gpu", "capability", "arch", "date", "triton", "torch", "command", "entries")


def m_bucket(m: int) -> int:
    """Powers of two: 1, 2, 4, ..., so M = 5..8 share the tuned entry of 8."""
    b = 1
    while b < m:
        b *= 2
    return b


def entry_key(family_name: str, spec: ProblemSpec) -> str:
    return f"{family_name}|m{m_bucket(spec.m)}|n{spec.n}|k{spec.k}"


class TableError(ValueError):
    pass


def parse_table(doc: dict, source: str) -> dict:
    """Validate a table document; returns {key: TileConfig}. Raises TableError with the reason."""
    if not isinstance(doc, dict):
        raise TableError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise TableError(f"{source}: missing fields {', '.join(missing)}")
    entries = doc["entries"]
    if not isinstance(entries, dict):
        raise TableError(f"{source}: 'entries' must map keys to config tags")
    out = {}
    for key, val in entries.items():
        tag = val.get("config") if isinstance(val, dict) else val
        try:
            out[key] = TileConfig.parse_tag(str(tag))
        except ValueError as e:
            raise TableError(f"{source}: entry {key!r}: {e}") from None
        if key.count("|") != 3:
            raise TableError(f"{source}: entry key {key!r}: expected family|m<bucket>|n<N>|k<K>")
    return out


def _shipped_tables() -> list[Path]:
    shipped = resources.files("tileq.dispatch").joinpath("data/tuned")
    if not shipped.is_dir():
        return []
    return [Path(str(f)) for f in sorted(shipped.iterdir(), key=lambda x: x.name)
            if f.name.endswith(".json")]


def _table_paths() -> list[tuple[str, Path]]:
    """User tables ($TILEQ_TUNED_TABLES) first, so they win over the shipped ones."""
    extra = os.environ.get("TILEQ_TUNED_TABLES", "")
    paths = [("user", Path(p)) for p in filter(None, extra.split(os.pathsep))]
    return paths + [("shipped", p) for p in _shipped_tables()]


@lru_cache(maxsize=16)
def _tables_for(arch_name: str, capability: tuple[int, int], device_name: str | None) -> tuple:
    """The usable tables for this arch/GPU, in priority order: ((source, {key: cfg}), ...)."""
    usable = []
    for kind, path in _table_paths():
        try:
            doc = json.loads(path.read_text())
            entries = parse_table(doc, str(path))
            if tuple(doc["capability"]) != tuple(capability) or doc["arch"] != arch_name:
                raise TableError(
                    f"{path}: made for {doc['arch']} (capability {tuple(doc['capability'])}), "
                    f"this is {arch_name}"
                )
            if device_name is not None and doc["gpu"] != device_name:
                continue  # another GPU of the same arch: its timings do not carry over
            usable.append((f"table: {path.name}", entries))
        except (OSError, json.JSONDecodeError, TableError, TypeError, KeyError) as e:
            warnings.warn(f"tileq: ignoring tuned table {path}: {e}; using the heuristic", stacklevel=2)
    return tuple(usable)


def _bucket_order(m: int) -> list[int]:
    """The M buckets to try: M's own, then smaller ones, then larger ones up to 64 (decode-sized
    problems behave alike across neighbouring buckets; a prefill bucket only matches itself)."""
    b = m_bucket(m)
    if b > 64:
        return [b]
    below = [x for x in (64, 32, 16, 8, 4, 2, 1) if x < b]
    above = [x for x in (1, 2, 4, 8, 16, 32, 64) if x > b]
    return [b] + below + above


def lookup(spec: ProblemSpec, arch: ArchInfo, pipeline: str,
           device_name: str | None = None) -> tuple[TileConfig, str] | None:
    """(config, source) from a table covering this problem on this GPU, or None."""
    from dataclasses import replace

    from ..catalog.names import KernelFamily

    fam = KernelFamily(spec.scheme, spec.a_type, spec.b_type, spec.layout, pipeline)
    tables = _tables_for(arch.name, arch.capability, device_name)
    for bucket in _bucket_order(spec.m):
        key = f"{fam.name}|m{bucket}|n{spec.n}|k{spec.k}"
        for source, entries in tables:
            cfg = entries.get(key)
            if cfg is None:
                continue
            if bucket != m_bucket(spec.m):
                # Borrowed from a neighbouring bucket: keep its N/K tiling, fit the M tile.
                if spec.m > cfg.block_m:
                    cfg = replace(cfg, block_m=16 if spec.m <= 16 else (32 if spec.m <= 32 else 64))
                source = f"{source} (M bucket {bucket})"
            if config_problem(spec, cfg, arch) is None:
                return cfg, source
    return None


def clear_cache() -> None:
    _tables_for.cache_clear()
