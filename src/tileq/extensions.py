"""Parts of a lower floor's calls that a higher floor provides, imported on the first such call.

``quantize_`` (``nn/quantize.py``) and ``from_pretrained`` / ``save_pretrained``
(``formats/pretrained.py``) keep registries that modules above them fill when imported:
transformers' experts modules (``integrations/hf_moe.py``), the sharded-model paths
(``tileq.distributed``). Imports run only downward, so the package namespace (``tileq/__init__.py``,
above them all) adds here the functions that import those modules, and a call reads its registry
after ``load()``. The namespace cannot import them itself: they import torch, and ``import tileq``
must not (``tileq --help``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("tileq")

_pending: list[tuple[str, Callable[[], None]]] = []
_lock = threading.RLock()


def add(module: str, importer: Callable[[], None]) -> None:
    """Run ``importer`` (which imports ``module``) at the next ``load()``."""
    with _lock:
        _pending.append((module, importer))


def load() -> None:
    """Run every importer not run yet, once each. A module that cannot be imported is logged and
    skipped, so the calls that do not need it still run; those that do say so."""
    with _lock:
        while _pending:
            module, importer = _pending.pop(0)
            try:
                importer()
            except ImportError as e:
                log.warning("tileq: %s could not be imported (%s: %s); the calls that need it will refuse",
                            module, type(e).__name__, e)
