"""The tuned tables: measured configs that win over the rules where they list the problem.

The portable kernel's per-GPU tables (written by ``tileq tune``; a miss falls back to the
heuristic) are JSON files recording the GPU, its compute capability, date, Triton and torch
versions and the command that produced it, and entries keyed by
``{family}|m{M bucket}|n{N}|k{K}`` -> config tag. Shipped tables live in
``tileq/dispatch/data/tuned/``; ``TILEQ_TUNED_TABLES`` (os.pathsep-separated files, read through
``settings.current().tuned_tables`` by the planner) adds more, which win over shipped ones. A
malformed table, or one for another arch or GPU, is refused with one warning naming the file and
the reason, and the heuristic is used.

The prepacked int4 decode kernel's table (``data/tuned_int4_sm90.json``, written by ``tileq replay
--rule int4-decode --write-table``; its 'about' says how it was measured) maps (N, K, 1 or 16) to
a config: ``int4_decode_table``.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from functools import lru_cache
from importlib import resources
from pathlib import Path

from ..catalog.names import KernelFamily
from ..device import ArchInfo
from ..kernels.config import TileConfig, config_problem
from ..kernels.int4p.config import Int4pConfig
from ..problem import ProblemSpec
from .heuristic import decode_m_tile

REQUIRED = ("gpu", "capability", "arch", "date", "triton", "torch", "command", "entries")


def m_bucket(m: int) -> int:
    """Powers of two: 1, 2, 4, ..., so M = 5..8 share the tuned entry of 8."""
    b = 1
    while b < m:
        b *= 2
    return b


def entry_key(family_name: str, spec: ProblemSpec, bucket: int | None = None) -> str:
    """The table key of ``spec`` (in M bucket ``bucket``; default its own)."""
    return f"{family_name}|m{bucket or m_bucket(spec.m)}|n{spec.n}|k{spec.k}"


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


def _table_paths(user_tables: tuple[str, ...]) -> list[Path]:
    """The user's tables first, so they win over the shipped ones."""
    return [Path(p) for p in user_tables] + _shipped_tables()


@lru_cache(maxsize=16)
def _tables_for(arch_name: str, capability: tuple[int, int], device_name: str | None,
                user_tables: tuple[str, ...]) -> tuple:
    """The usable tables for this arch/GPU, in priority order: ((source, {key: cfg}), ...)."""
    usable = []
    for path in _table_paths(user_tables):
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


def lookup(spec: ProblemSpec, arch: ArchInfo, pipeline: str, device_name: str | None,
           user_tables: tuple[str, ...]) -> tuple[TileConfig, str] | None:
    """(config, source) from a table covering this problem on this GPU, or None. ``user_tables``:
    the files of ``TILEQ_TUNED_TABLES`` (``settings.current().tuned_tables``)."""
    fam = KernelFamily(spec.scheme, spec.a_type, spec.b_type, spec.layout, pipeline)
    tables = _tables_for(arch.name, arch.capability, device_name, user_tables)
    for bucket in _bucket_order(spec.m):
        key = entry_key(fam.name, spec, bucket)
        for source, entries in tables:
            cfg = entries.get(key)
            if cfg is None:
                continue
            if bucket != m_bucket(spec.m):
                # Borrowed from a neighbouring bucket: keep its N/K tiling, fit the M tile.
                if spec.m > cfg.block_m:
                    cfg = replace(cfg, block_m=decode_m_tile(spec.m))
                source = f"{source} (M bucket {bucket})"
            if config_problem(spec, cfg, arch) is None:
                return cfg, source
    return None


def clear_cache() -> None:
    _tables_for.cache_clear()


INT4_DECODE_TABLE = "data/tuned_int4_sm90.json"


@lru_cache(maxsize=1)
def int4_decode_table() -> dict[tuple[int, int, int], Int4pConfig]:
    """{(n, k, 1 or 16): config} of the prepacked int4 decode kernel, measured on an H200."""
    doc = json.loads(resources.files("tileq.dispatch").joinpath(INT4_DECODE_TABLE).read_text())
    return {(e["n"], e["k"], e["m"]): Int4pConfig.parse_tag(e["config"]) for e in doc["entries"]}
