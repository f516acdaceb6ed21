"""Every ``TILEQ_*`` environment switch, parsed in one place.

``key()`` is the raw values of every switch that changes what a call runs (compared for equality,
never parsed): each cache of plans, launches or runners includes it, so a changed switch never
meets a stale entry. ``current()`` parses them (once per distinct ``key()``) and raises
``UnsupportedError`` naming the variable for a value it does not know.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._runtime import env_reader, interpreter_active
from .errors import UnsupportedError, expect

BACKENDS = ("auto", "triton", "reference")

# name -> what it does (one line; docs/guide.md lists them the same way)
SWITCHES = {
    "TILEQ_BACKEND": "auto (default) | triton | reference: the executor when a call does not name one",
    "TILEQ_GLUON": "unset: the sm_90 Gluon kernels where they are on by default; 0: off; 1: on for every problem they serve",
    "TILEQ_DIRECT_LAUNCH": "0: every launch through Triton's JITFunction.run instead of the compiled kernel's launcher",
    "TILEQ_CHECK_FINITE": "1: activation quantization raises ScaleError on non-finite input (synchronizes)",
    "TILEQ_TUNED_TABLES": "os.pathsep-separated tuned-table files read besides the shipped ones",
    "TILEQ_PDL": "unset: programmatic dependent launch of the decode kernels on sm_90+ GPUs; 0: off; 1: on (sm_90+)",
    "TILEQ_INLINE_LAUNCH": "unset or 1: torch.compile traces the launches of tileq ops into its graph where it can (inductor launches them); 0: every tileq op stays one opaque call",
    "TILEQ_QK_ROPE": "unset: eager fused decoder layers prepare q and k (per-head RMSNorm, rotary embedding, static-cache write) in one tileq kernel; 1: compiled ones too (opt-in: faster graphed, slower compiled without a graph, docs/performance.md section 7); 0: transformers' operations",
    "TILEQ_DECODE_ATTN": "unset or 1: fused decoder layers run attention at one query token with tileq's split-KV kernel, eager and compiled; 0: transformers' attention function",
    "TRITON_INTERPRET": "1 (set before tileq and triton are imported): Triton's interpreter runs the kernels on CPU tensors",
}
_KEYED = tuple(SWITCHES)
_read_keyed = env_reader(_KEYED)


def key() -> tuple:
    """The raw value of every switch (None when unset): the part of every cache key that the
    environment contributes."""
    return _read_keyed()


@dataclass(frozen=True)
class Settings:
    backend: str  # one of BACKENDS
    gluon: bool | None  # None: the shipped default; True / False: forced on / off
    direct_launch: bool
    check_finite: bool
    tuned_tables: tuple[str, ...]
    interpreted: bool
    pdl: bool | None = None  # None: on where the GPU has it (sm_90+); True / False: forced
    inline_launch: bool = True  # torch.compile traces tileq's launches into its graph (ops.py)
    # Fused attention's q/k norm + rotary embedding in one kernel (qk_rope.py): None eager code only,
    # True compiled code too, False never.
    qk_rope: bool | None = None
    # Fused attention at one query token through tileq's split-KV kernel (attention.py): on unless 0.
    decode_attn: bool = True


def _text(raw) -> str:
    return (raw.decode() if isinstance(raw, bytes) else str(raw)).strip()


def _flag(raw) -> bool:
    return raw is not None and _text(raw) not in ("", "0")


def parse_switch(name: str, raw) -> bool | None:
    """A 0/1 switch's value: True ('1'), False ('0'), None (unset: its default)."""
    if raw is None:
        return None
    value = _text(raw)
    if value not in ("0", "1"):
        raise UnsupportedError(expect(name, "0 or 1", repr(value)))
    return value == "1"


def parse_gluon(raw) -> bool | None:
    """TILEQ_GLUON's value: True ('1'), False ('0'), None (unset: the shipped default)."""
    return parse_switch("TILEQ_GLUON", raw)


def parse_pdl(raw) -> bool | None:
    """TILEQ_PDL's value: True ('1'), False ('0'), None (unset: on where the GPU has it)."""
    return parse_switch("TILEQ_PDL", raw)


def parse_backend(raw, source: str = "TILEQ_BACKEND") -> str:
    value = "auto" if raw is None else _text(raw).lower()
    if value not in BACKENDS:
        raise UnsupportedError(expect(source, f"one of {', '.join(BACKENDS)}", repr(value)))
    return value


_PARSED: dict[tuple, Settings] = {}


def current() -> Settings:
    """The switches as they are now, parsed."""
    k = key()
    s = _PARSED.get(k)
    if s is None:
        raw = dict(zip(_KEYED, k))
        tables = _text(raw["TILEQ_TUNED_TABLES"]) if raw["TILEQ_TUNED_TABLES"] is not None else ""
        s = Settings(
            backend=parse_backend(raw["TILEQ_BACKEND"]),
            gluon=parse_gluon(raw["TILEQ_GLUON"]),
            direct_launch=raw["TILEQ_DIRECT_LAUNCH"] is None or _text(raw["TILEQ_DIRECT_LAUNCH"]) != "0",
            check_finite=_flag(raw["TILEQ_CHECK_FINITE"]),
            tuned_tables=tuple(p for p in tables.split(os.pathsep) if p),
            interpreted=interpreter_active(),
            pdl=parse_pdl(raw["TILEQ_PDL"]),
            inline_launch=parse_switch("TILEQ_INLINE_LAUNCH", raw["TILEQ_INLINE_LAUNCH"]) is not False,
            qk_rope=parse_switch("TILEQ_QK_ROPE", raw["TILEQ_QK_ROPE"]),
            decode_attn=parse_switch("TILEQ_DECODE_ATTN", raw["TILEQ_DECODE_ATTN"]) is not False,
        )
        if len(_PARSED) > 64:
            _PARSED.clear()
        _PARSED[k] = s
    return s
