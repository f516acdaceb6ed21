"""Small helpers shared by the planner, the launchers and the model layer: bounded caches,
environment switches, the interpreter check. They import nothing from tileq, so every layer can
use them without import cycles.
"""

from __future__ import annotations

import os

# os.environ.get of an unset variable raises and catches a KeyError inside (0.7 us on the dev
# machine) and every call of tileq.gemm reads three variables to key its call cache (api.py):
# os.environ's own dict, looked up with the encoded name, holds the same value for ~50 ns.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_ENCODE = getattr(os.environ, "encodekey", None)
_ENV_KEYS: dict[str, object] = {}


def bounded_put(table: dict, key, value, cap: int) -> None:
    """``table[key] = value``, first dropping the oldest insertion when ``table`` holds ``cap``
    entries (the call cache and the launch tables: bounded, never locked)."""
    if len(table) >= cap:
        try:
            del table[next(iter(table))]
        except (KeyError, RuntimeError, StopIteration):  # another thread got there first
            pass
    table[key] = value


def tensor_signature(t):
    """A tensor's part of a call-signature key: (shape, strides, dtype, device); None for None. An
    argument without them raises AttributeError (the caller's validation then names it)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def cache_get(table: dict, key):
    """``table.get(key)``, None for a None key or an unhashable one (a call cache misses and the
    full path, which validates, reports the bad argument)."""
    if key is None:
        return None
    try:
        return table.get(key)
    except TypeError:
        return None


def env_raw(name: str):
    """The stored value of environment variable ``name`` (None when unset), as a cache key:
    compared for equality only, never parsed (it is bytes on POSIX)."""
    if type(_ENV_DATA) is not dict or _ENV_ENCODE is None:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = _ENV_ENCODE(name)
    return _ENV_DATA.get(key)


def env_reader(names: tuple[str, ...]):
    """A function returning ``tuple(env_raw(n) for n in names)`` in one C-level pass over
    os.environ's dict (every cached call keys on it: ~0.3 us instead of ~0.3 us per name)."""
    if type(_ENV_DATA) is not dict or _ENV_ENCODE is None:
        return lambda: tuple(os.environ.get(n) for n in names)
    keys, get = tuple(_ENV_ENCODE(n) for n in names), _ENV_DATA.get
    return lambda: tuple(map(get, keys))


def interpreter_active() -> bool:
    """Triton's interpreter is chosen when TRITON_INTERPRET=1 is set before Triton is imported."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
