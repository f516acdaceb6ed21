"""``decode_attention``: softmax attention of one query token per sequence over a KV cache, split
over the keys (``kernels/decode_attention.py``: a split kernel and a combine kernel; the number of
ranges from ``dispatch/attention.py``). The fused decoder layers of ``tileq.integrations.hf`` call
it at decode (one query token) in place of transformers' sdpa attention, eagerly and compiled
(through ``torch.ops.tileq.decode_attention``), unless TILEQ_DECODE_ATTN=0. On an H100 it took a
40-layer Qwen3-14B-shaped decode step's attention from 0.94 to 0.27 ms (bench/results/h100/decode-attention/).

Like the other public functions, a call's signature (shapes, strides, dtypes, devices, options)
keys a bounded cache of launch objects: a repeated call allocates its output and workspace and
launches.
"""

from __future__ import annotations

import math

import torch

from . import settings
from ._runtime import bounded_put, tensor_signature
from .dispatch.attention import decode_attention_config
from .dispatch.pdl import pdl_enabled
from .dispatch.plan import resolve_backend
from .errors import DTypeError, LayoutError, ShapeError, UnsupportedError, expect
from .kernels import decode_attention as _da

_CACHE: dict = {}
_CACHE_CAP = 256
_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = _da.HEAD_DIMS
MAX_GROUP = _da.MAX_GROUP


def decode_attention(q, keys, values, *, scaling: float, mask=None, backend=None, splits: int | None = None):
    """softmax(q k^T * scaling, masked) v for one query token per sequence, as transformers'
    ``sdpa_attention_forward`` computes it at decode:

    - ``q`` [B, Hq, 1, D], bf16 or fp16, unit stride along D (any other strides: transformers'
      transposed [B, 1, Hq, D] is the usual one);
    - ``keys`` / ``values`` [B, Hkv, L, D] in q's dtype, unit stride along D (a ``StaticCache``
      layer's tensors, or a ``DynamicCache``'s); Hq a multiple of Hkv (grouped-query attention:
      query head j reads kv head j // (Hq / Hkv)), at most 32 query heads per kv head;
      D 64, 128 or 256;
    - ``mask``: None (every key) or a bool tensor [B or 1, 1, 1, L], True where the query attends
      (what transformers' ``sdpa_mask`` makes; any strides, a broadcast batch included).
      Positions it excludes are never read;
    - ``scaling``: the factor of q k^T (transformers' ``module.scaling``).

    Returns [B, 1, Hq, D] in q's dtype, contiguous (what ``sdpa_attention_forward`` returns). A
    query head with no attended key at all (its mask row all False) gets zeros, as torch's
    ``scaled_dot_product_attention`` gives for a fully masked row.

    ``backend``: 'auto' (Triton on CUDA tensors, the torch reference on CPU), 'triton',
    'reference'. ``splits``: the number of key ranges per (batch, kv head) (None: the dispatch's
    choice; for tests and experiments).
    """
    try:
        key = (tuple(map(tensor_signature, (q, keys, values, mask))), scaling.__class__, scaling, splits, backend,
               settings.key())
        launch = _CACHE.get(key)
    except (TypeError, AttributeError):  # odd arguments: validation reports them
        key, launch = None, None
    if launch is None:
        launch = _build(q, keys, values, mask, scaling, backend, splits)
        if key is not None:
            bounded_put(_CACHE, key, launch, _CACHE_CAP)
    if isinstance(launch, _da.DecodeAttentionLaunch):
        return launch(q, keys, values, mask)
    return _da.decode_attention_ref(q, keys, values, mask, scaling)


def takes(q, keys, values, mask) -> bool:
    """Whether ``decode_attention`` takes these arguments (the conditions ``_build`` reports one by
    one as errors): q [B, Hq, 1, D] and keys / values [B, Hkv, L, D] of one 16-bit dtype and device,
    unit stride along D, D in HEAD_DIMS, Hq a multiple of Hkv with at most MAX_GROUP query heads
    per kv head, and the mask None or a bool [B or 1, 1, 1, L] on that device. For a caller that
    routes a call here or elsewhere (``integrations.hf``) rather than raising."""
    if not (isinstance(q, torch.Tensor) and isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
        return False
    if q.dim() != 4 or keys.dim() != 4 or q.shape[2] != 1 or values.shape != keys.shape:
        return False
    b, hq, _, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4
                             or mask.shape[0] not in (1, b) or tuple(mask.shape[1:]) != (1, 1, length)
                             or mask.device != q.device):
        return False
    return (q.dtype in _DTYPES and keys.dtype == q.dtype and values.dtype == q.dtype and keys.shape[0] == b
            and keys.shape[3] == d and d in HEAD_DIMS and hkv > 0 and hq % hkv == 0 and hq // hkv <= MAX_GROUP
            and q.stride(-1) == 1 and keys.stride(-1) == 1 and values.stride(-1) == 1
            and keys.device == q.device and values.device == q.device)


def _build(q, keys, values, mask, scaling, backend, splits):
    """The launch of a new signature after checking every argument; None for the reference."""
    if not isinstance(q, torch.Tensor) or q.dtype not in _DTYPES:
        raise DTypeError(expect("q", "a bfloat16 or float16 tensor", getattr(q, "dtype", type(q).__name__)))
    if q.dim() != 4 or q.shape[2] != 1 or q.stride(-1) != 1:
        raise LayoutError(expect("q", "[B, Hq, 1, D] with unit stride along D",
                                 f"shape {tuple(q.shape)} with strides {q.stride()}"))
    b, hq, _, d = q.shape
    if d not in HEAD_DIMS:
        raise UnsupportedError(expect("q", f"a head dimension D in {HEAD_DIMS}", d))
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dtype != q.dtype or t.device != q.device:
            raise DTypeError(expect(name, f"a {q.dtype} tensor on {q.device} (q's)",
                                    getattr(t, "dtype", type(t).__name__)))
        if t.dim() != 4 or t.shape[0] != b or t.shape[3] != d or t.stride(-1) != 1:
            raise LayoutError(expect(name, f"[{b}, Hkv, L, {d}] with unit stride along D",
                                     f"shape {tuple(t.shape)} with strides {t.stride()}"))
    if values.shape != keys.shape:
        raise ShapeError(expect("values", f"the keys' shape {tuple(keys.shape)}", tuple(values.shape)))
    hkv, length = keys.shape[1], keys.shape[2]
    if hkv < 1 or hq % hkv:
        raise ShapeError(expect("keys", f"a number of kv heads dividing q's {hq} heads", hkv))
    if hq // hkv > MAX_GROUP:
        raise UnsupportedError(expect("q", f"at most {MAX_GROUP} query heads per kv head", hq // hkv))
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.device != q.device:
            raise DTypeError(expect("mask", f"None or a bool tensor on {q.device} (True: attend)",
                                    getattr(mask, "dtype", type(mask).__name__)))
        if mask.dim() != 4 or mask.shape[0] not in (1, b) or tuple(mask.shape[1:]) != (1, 1, length):
            raise ShapeError(expect("mask", f"[{b} or 1, 1, 1, {length}]", tuple(mask.shape)))
    if type(scaling) not in (float, int) or not math.isfinite(scaling):
        raise ShapeError(expect("scaling", "a finite number", repr(scaling)))
    if splits is not None and (type(splits) is not int or splits < 1):
        raise ShapeError(expect("splits", "None or a positive int", repr(splits)))
    executor, interpreted = resolve_backend(backend, q.device)
    if executor == "reference" or q.numel() == 0:
        return None
    cfg = decode_attention_config(b, hkv, hq // hkv, length, d, q.dtype, q.device, interpreted=interpreted,
                                  splits=splits)

    def batch_strides(t, n):  # a batch of one: its stride is never used (fewer specializations)
        return (t.stride(0) if t.shape[0] > 1 else 0,) + tuple(t.stride()[1:n])

    return _da.DecodeAttentionLaunch(
        batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, length=length, q_strides=batch_strides(q, 2),
        k_strides=batch_strides(keys, 3), v_strides=batch_strides(values, 3),
        mask_strides=None if mask is None else (batch_strides(mask, 1)[0], mask.stride(3)),
        scaling=float(scaling), dtype=q.dtype, device=q.device, interpreted=interpreted, block_n=cfg.block_n,
        splits=cfg.splits, num_warps=cfg.num_warps, num_stages=cfg.num_stages, pdl=pdl_enabled(q.device, interpreted))
