"""``qk_norm_rope``: an attention layer's q and k from its merged q/k/v projection, normalized per
head (optional) and rotated, in one launch (``kernels/qk_rope.py``), optionally writing k and v into
a static KV cache. The fused decoder layers of
``tileq.integrations.hf`` call it in eager mode, where transformers spends about 25 small ATen
launches per layer on the same work; compiled code keeps transformers' operations, which inductor
fuses itself, unless TILEQ_QK_ROPE=1 (then through the custom ops of ``tileq.ops``).

Like the activation functions, a call's signature (shapes, strides, dtypes, devices, options)
keys a bounded cache of launch objects: a repeated call allocates q and k and launches.
"""

from __future__ import annotations

import torch

from . import settings
from ._runtime import bounded_put, tensor_signature
from .dispatch.pdl import pdl_enabled
from .dispatch.plan import resolve_backend
from .errors import DTypeError, LayoutError, ShapeError, UnsupportedError, expect
from .kernels import qk_rope as _qr

_CACHE: dict = {}
_CACHE_CAP = 256
_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (32, 64, 128, 256)  # a head is one register row of the kernel's program


def qk_norm_rope(qkv, cos, sin, *, q_heads: int, kv_heads: int, q_weight=None, k_weight=None,
                 eps: float = 1e-6, cache=None, backend=None):
    """(q, k) of an attention layer as transformers computes them before its KV cache:

    - ``qkv`` [B, T, (q_heads + 2 * kv_heads) * D]: the merged projection's output (q heads, then
      k heads, then v heads), bf16 or fp16, unit stride along the last dimension;
    - ``q_weight`` / ``k_weight`` [D]: the per-head RMSNorms' weights (Qwen3's ``q_norm`` /
      ``k_norm``, epsilon ``eps``), both or neither;
    - ``cos`` / ``sin`` [B or 1, T, D] in qkv's dtype (the rotary embedding's output), rotated as
      ``apply_rotary_pos_emb`` with ``rotate_half`` does.

    Returns q [B, q_heads, T, D] and k [B, kv_heads, T, D], transposed views of new [B, T, H, D]
    tensors (transformers' ``.transpose(1, 2)`` layout). D must be 32, 64, 128 or 256.

    ``cache=(keys, values, length)``: a static KV cache as transformers' ``StaticLayer`` keeps it
    (keys / values [B, kv_heads, L, D] contiguous in qkv's dtype, ``length`` the int64 0-d count of
    positions written, on the device). k and qkv's v heads are written at positions length ..
    length + T - 1 (read on the device: no synchronization), length advances by T, and the call
    returns (q, keys, values), what ``StaticLayer.update`` returns. A position at or past L is
    written nowhere and makes its token's q NaN (transformers' ``index_copy_`` would fail there).

    ``backend``: 'auto' (Triton on CUDA tensors, the torch reference on CPU), 'triton', 'reference'.
    """
    try:
        tensors = tuple(map(tensor_signature, (qkv, cos, sin, q_weight, k_weight)))
        key = (tensors, q_heads, kv_heads, eps.__class__, eps,
               None if cache is None else tuple(map(tensor_signature, cache)), backend, settings.key())
        launch = _CACHE.get(key)
    except (TypeError, AttributeError):  # odd arguments: validation reports them
        key, launch = None, None
    if launch is None:
        launch = _build(qkv, cos, sin, q_heads, kv_heads, q_weight, k_weight, eps, cache, backend)
        if key is not None:
            bounded_put(_CACHE, key, launch, _CACHE_CAP)
    if isinstance(launch, _qr.QkNormRopeLaunch):
        return launch(qkv, q_weight, k_weight, cos, sin, cache)
    return _qr.qk_norm_rope_ref(qkv, cos, sin, q_heads, kv_heads, q_weight, k_weight, eps, cache)


def _build(qkv, cos, sin, q_heads, kv_heads, q_weight, k_weight, eps, cache, backend):
    """The launch of a new signature after checking every argument; None for the reference."""
    if not isinstance(qkv, torch.Tensor) or qkv.dtype not in _DTYPES:
        raise DTypeError(expect("qkv", "a bfloat16 or float16 tensor",
                                getattr(qkv, "dtype", type(qkv).__name__)))
    for name, v in (("q_heads", q_heads), ("kv_heads", kv_heads)):
        if type(v) is not int or v < 1:
            raise ShapeError(expect(name, "a positive int", repr(v)))
    if qkv.dim() != 3 or qkv.stride(-1) != 1:
        raise LayoutError(expect("qkv", "[B, T, (q_heads + 2 * kv_heads) * D] with unit stride along the last "
                                 "dimension", f"shape {tuple(qkv.shape)} with strides {qkv.stride()}"))
    b, t, n = qkv.shape
    for name, c in (("cos", cos), ("sin", sin)):
        if not isinstance(c, torch.Tensor) or c.dtype != qkv.dtype or c.device != qkv.device:
            raise DTypeError(expect(name, f"a {qkv.dtype} tensor on {qkv.device} (qkv's)",
                                    getattr(c, "dtype", type(c).__name__)))
        if c.dim() != 3 or c.shape[0] not in (1, b) or c.shape[1] != t or c.stride(-1) != 1:
            raise ShapeError(expect(name, f"[{b} or 1, {t}, D] with unit stride along D",
                                    f"shape {tuple(c.shape)} with strides {c.stride()}"))
    d = cos.shape[-1]
    if d not in HEAD_DIMS:
        raise UnsupportedError(expect("cos", f"a head dimension D in {HEAD_DIMS}", d))
    if sin.shape != cos.shape or sin.stride() != cos.stride():
        raise LayoutError(expect("sin", f"cos's shape and strides {tuple(cos.shape)}, {cos.stride()}",
                                 f"{tuple(sin.shape)}, {sin.stride()}"))
    if n != (q_heads + 2 * kv_heads) * d:
        raise ShapeError(expect("qkv", f"last dimension (q_heads + 2 * kv_heads) * D = {(q_heads + 2 * kv_heads) * d}",
                                n))
    if (q_weight is None) != (k_weight is None):
        raise ShapeError(expect("k_weight", "given exactly when q_weight is", type(k_weight).__name__))
    norm = q_weight is not None
    if norm:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            if not isinstance(w, torch.Tensor) or w.dtype != qkv.dtype or w.device != qkv.device:
                raise DTypeError(expect(name, f"a {qkv.dtype} tensor on {qkv.device}",
                                        getattr(w, "dtype", type(w).__name__)))
            if tuple(w.shape) != (d,) or (d > 1 and w.stride(0) != 1):
                raise ShapeError(expect(name, f"a contiguous [{d}] tensor", tuple(w.shape)))
    if type(eps) not in (float, int) or not eps >= 0:
        raise ShapeError(expect("eps", "a non-negative number", repr(eps)))
    cache_len = 0 if cache is None else _check_cache(cache, qkv, b, kv_heads, d)
    executor, interpreted = resolve_backend(backend, qkv.device)
    if executor == "reference" or qkv.numel() == 0:
        return None
    xs = qkv.stride()
    cs = cos.stride()
    return _qr.QkNormRopeLaunch(
        batch=b, tokens=t, q_heads=q_heads, kv_heads=kv_heads, head_dim=d,
        x_strides=(xs[0] if b > 1 else 0, xs[1]), cs_strides=(cs[0] if cos.shape[0] > 1 else 0, cs[1]),
        dtype=qkv.dtype, device=qkv.device, norm=norm, eps=float(eps), interpreted=interpreted,
        pdl=pdl_enabled(qkv.device, interpreted), cache_len=cache_len)


def _check_cache(cache, qkv, b: int, kv_heads: int, d: int) -> int:
    """The cache's length L after checking (keys, values, length)."""
    if type(cache) not in (tuple, list) or len(cache) != 3:
        raise ShapeError(expect("cache", "(keys, values, length)", type(cache).__name__))
    keys, values, length = cache
    for name, t in (("cache keys", keys), ("cache values", values)):
        if not isinstance(t, torch.Tensor) or t.dtype != qkv.dtype or t.device != qkv.device:
            raise DTypeError(expect(name, f"a {qkv.dtype} tensor on {qkv.device}",
                                    getattr(t, "dtype", type(t).__name__)))
        if t.dim() != 4 or tuple(t.shape[:2]) != (b, kv_heads) or t.shape[3] != d or not t.is_contiguous():
            raise ShapeError(expect(name, f"a contiguous [{b}, {kv_heads}, L, {d}] tensor",
                                    f"shape {tuple(t.shape)} with strides {t.stride()}"))
    if values.shape != keys.shape:
        raise ShapeError(expect("cache values", f"the keys' shape {tuple(keys.shape)}", tuple(values.shape)))
    if (not isinstance(length, torch.Tensor) or length.dtype != torch.int64 or length.numel() != 1
            or length.device != qkv.device):
        raise DTypeError(expect("cache length", f"a one-element int64 tensor on {qkv.device}",
                                getattr(length, "dtype", type(length).__name__)))
    return keys.shape[2]
