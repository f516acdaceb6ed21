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


def when_imported(module: str, callback: Callable[[], None]) -> None:
    """Run ``callback()`` once ``module`` is imported: now if it already is, else right after its
    own import runs (a one-shot finder on ``sys.meta_path``; tileq never imports the module
    itself). A callback that fails is logged, never raised into the importer."""
    import sys

    if module in sys.modules:
        _safely(module, callback)
    else:
        sys.meta_path.insert(0, _AfterImport(module, callback))


def _safely(module: str, callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception as e:  # noqa: BLE001 - the import that triggered it must still succeed
        log.warning("tileq: registering with %s failed (%s: %s); tileq's integration with it is off",
                    module, type(e).__name__, e)


class _AfterImport:
    """A meta-path finder that lets the normal finders find ``module`` and runs ``callback`` after
    the module's code has run (it removes itself first: it acts once)."""

    def __init__(self, module: str, callback: Callable[[], None]):
        self.module, self.callback = module, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        import importlib.util
        import sys

        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(mod):
            run_module(mod)
            _safely(fullname, self.callback)

        loader.exec_module = exec_module
        return spec
