"""tileq.qk_norm_rope (kernels/qk_rope.py) on Triton's interpreter: the kernel against its torch
reference and against transformers' own operations, the argument checks, and the fused decoder's
use of it (one launch per layer, TILEQ_QK_ROPE=0 turning it off). The sm_90 build is in
tests/test_pdl.py; tests/test_model_gpu.py runs the kernel on a GPU."""

import pytest
import torch

from tileq.errors import DTypeError, LayoutError, ShapeError, UnsupportedError
from tileq.kernels.qk_rope import qk_norm_rope_ref
from tileq.qk_rope import qk_norm_rope

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3 import modeling_qwen3 as mq  # noqa: E402

pytestmark = pytest.mark.transformers


def _inputs(b, t, hq, hkv, d, dtype=torch.bfloat16, seed=0, cos_batch=None, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    qkv = (torch.randn(b, t, n + row_pad, generator=g) * 4).to(dtype)[..., :n]  # row_pad: a strided view
    cb = b if cos_batch is None else cos_batch
    angle = torch.rand(cb, t, d // 2, generator=g) * 40
    emb = torch.cat((angle, angle), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qw = (1 + torch.randn(d, generator=g) * 0.2).to(dtype)
    kw = (1 + torch.randn(d, generator=g) * 0.2).to(dtype)
    return qkv, cos, sin, qw, kw


CASES = [  # (B, T, q heads, kv heads, D, dtype, cos batch, row padding)
    (1, 1, 40, 8, 128, torch.bfloat16, None, 0),  # Qwen3-14B decode
    (2, 5, 4, 2, 64, torch.bfloat16, 1, 0),  # cos shared by the batch
    (3, 7, 6, 3, 128, torch.float16, None, 64),  # rows with a larger stride than their width
    (1, 3, 2, 2, 256, torch.bfloat16, None, 0),
    (2, 2, 8, 1, 32, torch.float16, None, 0),
]


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference(case, norm):
    b, t, hq, hkv, d, dtype, cb, pad = case
    qkv, cos, sin, qw, kw = _inputs(b, t, hq, hkv, d, dtype, cos_batch=cb, row_pad=pad)
    w = (qw, kw) if norm else (None, None)
    q, k = qk_norm_rope(qkv, cos, sin, q_heads=hq, kv_heads=hkv, q_weight=w[0], k_weight=w[1], eps=1e-6,
                        backend="triton")
    rq, rk = qk_norm_rope_ref(qkv, cos, sin, hq, hkv, *w, eps=1e-6)
    assert q.shape == (b, hq, t, d) and k.shape == (b, hkv, t, d)
    assert q.dtype == k.dtype == dtype
    assert q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous()  # transformers' layout
    if norm:
        # The mean square's summation order (a tree in the kernel) can move rstd by an ulp, and so
        # a normalized value: within 2 ulps of the head's largest value, nearly all equal.
        for got, want in ((q, rq), (k, rk)):
            assert _close_by_ulps(got, want, 2)
            assert (got == want).float().mean() > 0.99
    else:
        assert torch.equal(q, rq) and torch.equal(k, rk)
    assert q.float().std() > 0.1  # not zeros


def _close_by_ulps(got, want, ulps):
    """|got - want| <= ulps x the dtype's eps x the largest |want| of each head row."""
    scale = want.float().abs().amax(-1, keepdim=True)
    return bool(((got.float() - want.float()).abs() <= ulps * torch.finfo(want.dtype).eps * scale).all())


def test_kernel_equals_transformers_operations():
    """Against transformers' Qwen3RMSNorm and apply_rotary_pos_emb themselves: bit for bit without
    the norm; with it, within 2 ulps of each head's largest value (the norm's summation order and
    1 / sqrt against torch's rsqrt), nearly every value equal."""
    b, t, hq, hkv, d = 2, 3, 8, 4, 128
    qkv, cos, sin, qw, kw = _inputs(b, t, hq, hkv, d, seed=3)
    q = qkv[..., :hq * d].reshape(b, t, hq, d)
    k = qkv[..., hq * d:(hq + hkv) * d].reshape(b, t, hkv, d)
    tq, tk = mq.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    gq, gk = qk_norm_rope(qkv, cos, sin, q_heads=hq, kv_heads=hkv, backend="triton")
    assert torch.equal(gq, tq) and torch.equal(gk, tk)

    qn, kn = mq.Qwen3RMSNorm(d, eps=1e-6), mq.Qwen3RMSNorm(d, eps=1e-6)
    qn.weight.data, kn.weight.data = qw.clone(), kw.clone()
    tq, tk = mq.apply_rotary_pos_emb(qn(q).transpose(1, 2), kn(k).transpose(1, 2), cos, sin)
    gq, gk = qk_norm_rope(qkv, cos, sin, q_heads=hq, kv_heads=hkv, q_weight=qw, k_weight=kw, eps=1e-6,
                          backend="triton")
    for got, want in ((gq, tq), (gk, tk)):
        assert _close_by_ulps(got, want, 2)
        assert (got == want).float().mean() > 0.99


def test_argument_errors():
    qkv, cos, sin, qw, kw = _inputs(1, 2, 4, 2, 64)
    with pytest.raises(ShapeError, match="q_heads \\+ 2 \\* kv_heads"):
        qk_norm_rope(qkv, cos, sin, q_heads=4, kv_heads=1)
    with pytest.raises(ShapeError, match="k_weight"):
        qk_norm_rope(qkv, cos, sin, q_heads=4, kv_heads=2, q_weight=qw)
    with pytest.raises(DTypeError, match="qkv"):
        qk_norm_rope(qkv.float(), cos, sin, q_heads=4, kv_heads=2)
    with pytest.raises(DTypeError, match="cos"):
        qk_norm_rope(qkv, cos.float(), sin, q_heads=4, kv_heads=2)
    with pytest.raises(LayoutError, match="qkv"):
        qk_norm_rope(qkv.transpose(1, 2), cos, sin, q_heads=4, kv_heads=2)
    with pytest.raises(ShapeError, match="cos"):
        qk_norm_rope(qkv, cos[:, :1], sin[:, :1], q_heads=4, kv_heads=2)
    q48, c48, s48, _, _ = _inputs(1, 2, 4, 2, 48)
    with pytest.raises(UnsupportedError, match="head dimension"):
        qk_norm_rope(q48, c48, s48, q_heads=4, kv_heads=2)


def test_reference_backend_and_cpu_default_match_the_kernel():
    qkv, cos, sin, qw, kw = _inputs(1, 4, 4, 2, 64, seed=5)
    want = qk_norm_rope(qkv, cos, sin, q_heads=4, kv_heads=2, q_weight=qw, k_weight=kw, backend="triton")
    for backend in ("reference", None):  # None: 'auto', the reference on CPU tensors
        got = qk_norm_rope(qkv, cos, sin, q_heads=4, kv_heads=2, q_weight=qw, k_weight=kw, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _static_cache(b, hkv, length, d, dtype, start, seed=9):
    """(keys, values, length) as transformers' StaticLayer holds them, already holding data."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    values = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    return keys, values, torch.tensor(start, dtype=torch.int64)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("b,t,start", [(1, 1, 7), (2, 4, 0), (3, 2, 13)])
def test_cache_write_equals_reference(b, t, start, norm):
    """With a cache: q as without one, k and v written at length + t, length advanced, the rest of
    the cache untouched; the kernel against the reference, positions and values bit for bit."""
    hq, hkv, d, big = 4, 2, 64, 16
    qkv, cos, sin, qw, kw = _inputs(b, t, hq, hkv, d, seed=t)
    w = (qw, kw) if norm else (None, None)
    got_cache, want_cache = _static_cache(b, hkv, big, d, qkv.dtype, start), _static_cache(b, hkv, big, d, qkv.dtype, start)
    q, keys, values = qk_norm_rope(qkv, cos, sin, q_heads=hq, kv_heads=hkv, q_weight=w[0], k_weight=w[1],
                                   cache=got_cache, backend="triton")
    rq, rkeys, rvalues = qk_norm_rope_ref(qkv, cos, sin, hq, hkv, *w, cache=want_cache)
    assert keys is got_cache[0] and values is got_cache[1]
    assert int(got_cache[2]) == int(want_cache[2]) == start + t
    assert torch.equal(values, rvalues)  # v copied as it is
    if norm:
        assert _close_by_ulps(q, rq, 2) and _close_by_ulps(keys, rkeys, 2)
    else:
        assert torch.equal(q, rq) and torch.equal(keys, rkeys)
    plain_q, plain_k = qk_norm_rope(qkv, cos, sin, q_heads=hq, kv_heads=hkv, q_weight=w[0], k_weight=w[1],
                                    backend="triton")
    assert torch.equal(q, plain_q) and torch.equal(keys[:, :, start:start + t], plain_k)
    untouched = torch.ones(big, dtype=torch.bool)
    untouched[start:start + t] = False
    fresh = _static_cache(b, hkv, big, d, qkv.dtype, start)
    assert torch.equal(keys[:, :, untouched], fresh[0][:, :, untouched])


def test_cache_write_matches_transformers_static_layer():
    """k and v through the kernel's cache write against transformers' StaticLayer.update of the
    same k and v (rotated by transformers' own apply_rotary_pos_emb), over three calls."""
    from transformers.cache_utils import StaticLayer

    b, hq, hkv, d, big = 2, 4, 2, 64, 12
    layer = StaticLayer(max_cache_len=big)
    ours = None
    for step, t in enumerate((5, 1, 1)):
        qkv, cos, sin, _, _ = _inputs(b, t, hq, hkv, d, seed=20 + step)
        q = qkv[..., :hq * d].reshape(b, t, hq, d).transpose(1, 2)
        k = qkv[..., hq * d:(hq + hkv) * d].reshape(b, t, hkv, d).transpose(1, 2)
        v = qkv[..., (hq + hkv) * d:].reshape(b, t, hkv, d).transpose(1, 2)
        tq, tk = mq.apply_rotary_pos_emb(q, k, cos, sin)
        want_keys, want_values = layer.update(tk, v)
        if ours is None:  # the layer's tensors as lazily made: zeros, length 0 before the first call
            ours = (torch.zeros_like(want_keys), torch.zeros_like(want_values), torch.tensor(0))
        gq, keys, values = qk_norm_rope(qkv, cos, sin, q_heads=hq, kv_heads=hkv, cache=ours, backend="triton")
        assert torch.equal(gq, tq)
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
        assert int(ours[2]) == int(layer.cumulative_length)


def test_cache_overflow_poisons_q_and_writes_nothing_past_the_end():
    hq, hkv, d, big = 4, 2, 64, 8
    qkv, cos, sin, _, _ = _inputs(1, 3, hq, hkv, d, seed=4)
    cache = _static_cache(1, hkv, big, d, qkv.dtype, big - 1)
    before = cache[0].clone()
    q, keys, _ = qk_norm_rope(qkv, cos, sin, q_heads=hq, kv_heads=hkv, cache=cache, backend="triton")
    assert torch.isfinite(q[:, :, 0]).all() and torch.isnan(q[:, :, 1:]).all()
    assert torch.equal(keys[:, :, :big - 1], before[:, :, :big - 1]) and not torch.equal(keys[:, :, -1], before[:, :, -1])
    assert int(cache[2]) == big + 2


def test_cache_argument_errors():
    qkv, cos, sin, _, _ = _inputs(1, 2, 4, 2, 64)
    keys, values, length = _static_cache(1, 2, 8, 64, qkv.dtype, 0)
    with pytest.raises(ShapeError, match="cache keys"):
        qk_norm_rope(qkv, cos, sin, q_heads=4, kv_heads=2, cache=(keys[:, :1], values, length))
    with pytest.raises(DTypeError, match="cache values"):
        qk_norm_rope(qkv, cos, sin, q_heads=4, kv_heads=2, cache=(keys, values.float(), length))
    with pytest.raises(DTypeError, match="cache length"):
        qk_norm_rope(qkv, cos, sin, q_heads=4, kv_heads=2, cache=(keys, values, length.int()))
    with pytest.raises(ShapeError, match="cache keys"):
        qk_norm_rope(qkv, cos, sin, q_heads=4, kv_heads=2, cache=(keys.transpose(2, 3), values, length))


@pytest.mark.parametrize("norm", [False, True])
def test_custom_ops_pass_opcheck(norm):
    """The ops compiled fused layers call with TILEQ_QK_ROPE=1 (``tileq.ops``): schema, fake
    implementation (shapes and strides), the cache op's declared mutations."""
    from torch.library import opcheck

    from tileq import ops

    qkv, cos, sin, qw, kw = _inputs(2, 3, 4, 2, 64)
    w = (qw, kw) if norm else (None, None)
    opcheck(ops.qk_norm_rope_op.op, (qkv, cos, sin, *w, 4, 2, 1e-6))
    keys, values, length = _static_cache(2, 2, 16, 64, torch.bfloat16, 5)
    opcheck(ops.qk_norm_rope_cache_op.op, (qkv, cos, sin, *w, keys, values, length, 4, 2, 1e-6))
