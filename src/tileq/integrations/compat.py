"""The transformers releases tileq supports, and what differs between them, decided in one place.

Supported: transformers 5.17 (the pinned release the GPU runs use) through 5.25 (the newest
release); CI runs the model-layer tests on both ends. What tileq reads of transformers' internals
and changed inside that range:

* 5.24 renamed the KV cache argument ``past_key_values`` to ``cache`` in the models', decoder
  layers' and attention modules' ``forward`` (the old name shimmed by a deprecation decorator
  until 5.40) and passes the attention call's keyword arguments on to ``Cache.update``
  (``cache_argument``, ``cache_kwargs``, ``update_takes_kwargs``);
* 5.25 added keyword arguments (``config=``, ``mesh_manager=``) to the tensor-parallel styles'
  hooks (``install_forward``, ``transform_output_post_forward``, ``shard_param``): tileq's
  row-wise style accepts and ignores them (``distributed/tp.py``);
* 5.22 moved ``ParallelInterface`` to ``transformers.distributed.parallel_utils``;
  ``transformers.distributed.tensor_parallel`` still exports what tileq imports from it.

A release older than the range is refused where tileq reaches into transformers
(``require_supported``); a newer one runs with one warning naming the tested range.
"""

from __future__ import annotations

import re
import sys
import warnings

from ..errors import UnsupportedError, expect
from ..version import TESTED

TESTED_RANGE = " through ".join(TESTED["transformers"])

_warned: set = set()


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '5.25.0' or '5.26.0.dev0'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise UnsupportedError(expect("transformers.__version__", "a version such as 5.25.0", repr(version)))
    return int(m.group(1)), int(m.group(2))


def installed_version() -> str | None:
    """The version of the transformers module loaded in this process (None when it is not)."""
    tf = sys.modules.get("transformers")
    if tf is None:
        try:
            import transformers as tf
        except ImportError:
            return None
    return getattr(tf, "__version__", None)


def require_supported(what: str, version: str | None = None) -> None:
    """Refuse a transformers release older than the supported range (``what`` names the feature
    that needs it); warn once for one newer than the newest tested release."""
    version = version or installed_version()
    if version is None:
        return
    v = version_tuple(version)
    oldest, newest = (version_tuple(t) for t in TESTED["transformers"])
    if v < oldest:
        raise UnsupportedError(expect("transformers", f"a release from {TESTED_RANGE} for {what} "
                                                      "(pip install 'tileq[hf]')", version))
    if v > newest and version not in _warned:
        _warned.add(version)
        warnings.warn(f"tileq: transformers {version} is newer than the releases tileq is tested with "
                      f"({TESTED_RANGE}); check a quantized model's outputs against the unquantized one",
                      UserWarning, stacklevel=3)


def cache_argument() -> str:
    """The name transformers' models, decoder layers and attention modules take the KV cache by:
    'cache' from 5.24 on, 'past_key_values' before (the old name still works there but warns,
    and under torch.compile the warning's code is traced)."""
    version = installed_version()
    return "cache" if version is not None and version_tuple(version) >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """The keyword argument passing ``cache`` to a transformers model's forward."""
    return {cache_argument(): cache}


def update_takes_kwargs() -> bool:
    """Whether the installed release's attention modules pass their call's keyword arguments on
    to ``Cache.update`` (``update(k, v, layer_idx, kwargs=kwargs)``, 5.24 and later; earlier
    releases call ``update(k, v, layer_idx)``). The fused attention classes keep the answer as a
    class attribute, a constant to torch.compile."""
    version = installed_version()
    return version is not None and version_tuple(version) >= (5, 24)
