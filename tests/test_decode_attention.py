"""tileq.attention.decode_attention (kernels/decode_attention.py) on Triton's interpreter: the split
kernel and its combine against a float64 reference over odd shapes, masks and forced split
counts, positions it must never read, the argument checks, the custom op, the dispatch's split
rule, and the sm_90 build (compiled on a CPU). The fused decoder's use of it is in
tests/test_hf_fuse.py, its traced launches in tests/test_inline.py, a GPU run at Qwen3-14B's
shapes against torch's sdpa in tests/test_model_gpu.py.

Tolerance: the kernel forms Q @ K exactly (16-bit products, fp32 sums), rounds the softmax weights
P to q's dtype for P @ V (relative error eps / 2 each, so at most eps / 2 x max|v| on an output)
and rounds the output (eps / 2 x |out|); ``assert_close`` allows twice that sum.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tileq.attention import decode_attention
from tileq.dispatch.attention import decode_attention_config, shared_bytes
from tileq.errors import DTypeError, LayoutError, ShapeError, UnsupportedError
from tileq.kernels import decode_attention as da

ROOT = pathlib.Path(__file__).resolve().parents[1]


def attention_float64(q, keys, values, mask, scaling):
    """softmax(q k^T * scaling) v in float64, key by key: only attended positions are touched; a
    query with no attended key gives zeros. [B, 1, Hq, D] float64."""
    b, hq, _, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    out = torch.zeros(b, 1, hq, d, dtype=torch.float64, device=q.device)
    every = torch.ones(length, dtype=torch.bool, device=q.device)
    for i in range(b):
        attend = every if mask is None else mask[min(i, mask.shape[0] - 1), 0, 0]
        idx = attend.nonzero().flatten()
        if idx.numel() == 0:
            continue
        k = keys[i][:, idx].double().repeat_interleave(hq // hkv, dim=0)  # [Hq, n, D]
        v = values[i][:, idx].double().repeat_interleave(hq // hkv, dim=0)
        s = (q[i].double() @ k.transpose(1, 2)) * scaling  # [Hq, 1, n]
        out[i, 0] = (torch.softmax(s, -1) @ v)[:, 0]
    return out


def assert_close(got, want, values):
    """Within twice the rounding bound of the module docstring, and the values far above it."""
    eps = torch.finfo(got.dtype).eps
    vmax = values.double().abs().max()
    bound = eps * (vmax + want.abs())
    diff = (got.double() - want).abs()
    assert (diff <= bound).all(), (diff.max(), bound.min())
    assert want.std() > 5 * eps * vmax


def _inputs(b, hq, hkv, d, length, dtype=torch.bfloat16, mask="none", seed=0):
    """q as transformers hands it over (a transposed view of [B, 1, Hq, D]), the cache's keys and
    values, and a mask: 'none'; 'random' (at least one True per row); 'padding' (leading False,
    as a left-padded batch has); 'empty' (random, the last sequence attending nothing);
    'broadcast' (random, one row [1, 1, 1, L] for the whole batch)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, 1, hq, d, generator=g) * 2).to(dtype).transpose(1, 2)  # x2: peakier softmax
    keys = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    values = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    rows = 1 if mask == "broadcast" else b
    if mask == "none":
        m = None
    elif mask == "padding":
        start = torch.randint(0, length, (b,), generator=g)
        m = torch.arange(length)[None, :] >= start[:, None]
    else:
        m = torch.rand(rows, length, generator=g) < 0.5
        m[torch.arange(rows), torch.randint(0, length, (rows,), generator=g)] = True
        if mask == "empty":
            m[-1] = False
    return q, keys, values, None if m is None else m[:, None, None, :]


CASES = [  # (B, Hq, Hkv, D, L, dtype, mask)
    (1, 4, 1, 64, 1, torch.bfloat16, "none"),
    (3, 6, 2, 128, 37, torch.bfloat16, "random"),
    (3, 3, 3, 64, 130, torch.float16, "padding"),
    (1, 6, 2, 64, 130, torch.float16, "none"),
    (3, 4, 1, 128, 130, torch.bfloat16, "empty"),
    (3, 6, 2, 64, 37, torch.bfloat16, "broadcast"),
    (1, 3, 3, 128, 37, torch.float16, "random"),
    (3, 4, 1, 64, 1, torch.bfloat16, "random"),
    (1, 4, 1, 128, 130, torch.bfloat16, "padding"),
    (3, 3, 3, 128, 1, torch.float16, "empty"),
    (1, 6, 2, 256, 37, torch.bfloat16, "random"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_kernel_matches_float64(case):
    b, hq, hkv, d, length, dtype, mask_kind = case
    q, keys, values, mask = _inputs(b, hq, hkv, d, length, dtype, mask_kind)
    got = decode_attention(q, keys, values, scaling=d ** -0.5, mask=mask, backend="triton")
    assert got.shape == (b, 1, hq, d) and got.dtype == dtype and got.is_contiguous()
    want = attention_float64(q, keys, values, mask, d ** -0.5)
    if mask_kind == "empty":  # the last sequence attends nothing: zeros, exactly
        assert not got[-1].any()
        got, want, values = got[:-1], want[:-1], values[:-1]
    assert_close(got, want, values)


@pytest.mark.parametrize("mask_kind", ["random", "empty"])
def test_forced_split_counts_agree(mask_kind):
    """1 range, 2 and 3 (the 3 blocks of 64 keys), and 7 (four ranges past the keys, empty: their
    partials are m = -inf, l = 0) give the same attention; the combine is what differs."""
    q, keys, values, mask = _inputs(3, 6, 2, 128, 130, mask=mask_kind, seed=3)
    want = attention_float64(q, keys, values, mask, 0.1)
    outs = [decode_attention(q, keys, values, scaling=0.1, mask=mask, backend="triton", splits=s) for s in (1, 2, 3, 7)]
    keep = slice(None, -1) if mask_kind == "empty" else slice(None)
    for got in outs:
        assert_close(got[keep], want[keep], values[keep])
        if mask_kind == "empty":
            assert not got[-1].any()
    assert decode_attention_config(3, 2, 3, 130, 128, torch.bfloat16, torch.device("cpu"), splits=7).splits == 7


def test_contiguous_q_and_a_strided_cache():
    """q contiguous [B, Hq, 1, D], and keys / values as slices of larger caches (rows of a longer
    L, an extra head): strides are arguments."""
    q, keys, values, mask = _inputs(3, 4, 2, 64, 37, mask="random", seed=5)
    big_k = torch.randn(3, 3, 50, 64).to(keys.dtype)
    big_v = torch.randn(3, 3, 50, 64).to(keys.dtype)
    big_k[:, 1:, :37], big_v[:, 1:, :37] = keys, values
    k, v = big_k[:, 1:, :37], big_v[:, 1:, :37]
    got = decode_attention(q.contiguous(), k, v, scaling=0.125, mask=mask, backend="triton")
    assert_close(got, attention_float64(q, keys, values, mask, 0.125), values)


def test_positions_not_attended_are_never_read():
    """NaN in every K and V position the mask excludes and past L (the caches are views of longer
    ones): the output is the attention of the rest, finite."""
    q, keys, values, mask = _inputs(3, 6, 2, 64, 130, mask="padding", seed=7)
    nan = float("nan")
    big_k = torch.full((3, 2, 140, 64), nan, dtype=keys.dtype)
    big_v = big_k.clone()
    big_k[:, :, :130] = keys.masked_fill(~mask[:, 0, 0, :, None].unsqueeze(1), nan)
    big_v[:, :, :130] = values.masked_fill(~mask[:, 0, 0, :, None].unsqueeze(1), nan)
    got = decode_attention(q, big_k[:, :, :130], big_v[:, :, :130], scaling=0.125, mask=mask, backend="triton",
                           splits=2)
    assert torch.isfinite(got).all()
    assert_close(got, attention_float64(q, keys, values, mask, 0.125), values)


def test_reference_backend_and_cpu_default():
    """The torch reference (float32; 'auto' on CPU tensors) against float64, fully masked rows as
    zeros there too."""
    q, keys, values, mask = _inputs(3, 6, 2, 64, 37, mask="empty", seed=2)
    want = attention_float64(q, keys, values, mask, 0.125)
    for backend in ("reference", None):
        got = decode_attention(q, keys, values, scaling=0.125, mask=mask, backend=backend)
        assert got.shape == (3, 1, 6, 64) and got.is_contiguous() and not got[-1].any()
        assert_close(got[:-1], want[:-1], values[:-1])


def test_launch_cache_builds_once(monkeypatch):
    import tileq.attention as attention

    q, keys, values, mask = _inputs(1, 4, 1, 64, 37, mask="random", seed=4)
    first = decode_attention(q, keys, values, scaling=0.125, mask=mask, backend="triton")
    built = []
    build = attention._build
    monkeypatch.setattr(attention, "_build", lambda *a: built.append(1) or build(*a))
    assert torch.equal(decode_attention(q, keys, values, scaling=0.125, mask=mask, backend="triton"), first)
    assert built == []
    decode_attention(q, keys, values, scaling=0.25, mask=mask, backend="triton")  # another scale: a new launch
    assert built == [1]


def test_argument_errors():
    q, keys, values, mask = _inputs(2, 4, 2, 64, 16, mask="random")
    ok = dict(scaling=0.125, mask=mask)
    with pytest.raises(DTypeError, match="q"):
        decode_attention(q.float(), keys, values, **ok)
    with pytest.raises(LayoutError, match="q"):
        decode_attention(q.expand(2, 4, 2, 64), keys, values, **ok)  # two query tokens
    with pytest.raises(LayoutError, match="q"):
        decode_attention(q.transpose(1, 3), keys, values, **ok)
    q48, k48, v48, _ = _inputs(2, 4, 2, 48, 16)
    with pytest.raises(UnsupportedError, match="head dimension"):
        decode_attention(q48, k48, v48, scaling=0.125)
    with pytest.raises(DTypeError, match="keys"):
        decode_attention(q, keys.half(), values, **ok)
    with pytest.raises(LayoutError, match="values"):
        decode_attention(q, keys, values.transpose(2, 3), **ok)
    with pytest.raises(ShapeError, match="values"):
        decode_attention(q, keys, values[:, :, :8], **ok)
    q3, k3, v3, _ = _inputs(2, 3, 2, 64, 16)
    with pytest.raises(ShapeError, match="kv heads"):
        decode_attention(q3, k3, v3, scaling=0.125)
    qg, kg, vg, _ = _inputs(1, 64, 1, 64, 16)
    with pytest.raises(UnsupportedError, match="query heads per kv head"):
        decode_attention(qg, kg, vg, scaling=0.125)
    with pytest.raises(DTypeError, match="mask"):
        decode_attention(q, keys, values, scaling=0.125, mask=mask.float())
    with pytest.raises(ShapeError, match="mask"):
        decode_attention(q, keys, values, scaling=0.125, mask=mask[..., :8])
    with pytest.raises(ShapeError, match="mask"):
        decode_attention(q, keys, values, scaling=0.125, mask=mask[:, 0])
    with pytest.raises(ShapeError, match="scaling"):
        decode_attention(q, keys, values, scaling=float("inf"), mask=mask)
    with pytest.raises(ShapeError, match="splits"):
        decode_attention(q, keys, values, splits=0, **ok)


def test_custom_op_passes_opcheck():
    """``torch.ops.tileq.decode_attention`` (what compiled fused layers call): schema, fake
    implementation (shape, dtype, strides), no aliasing."""
    from torch.library import opcheck

    from tileq import ops

    for kind in ("none", "padding", "broadcast"):
        q, keys, values, mask = _inputs(2, 4, 2, 64, 16, mask=kind)
        opcheck(ops.decode_attention_op.op, (q, keys, values, mask, 0.125))


def test_split_rule_fills_the_device_and_keeps_whole_blocks():
    """sm_90 facts (132 SMs; CPU tensors plan for sm_90): ranges until the grid has the SMs'
    program slots (3 programs per SM by shared memory for these tiles), never more ranges than key
    blocks, never fewer than one."""
    cpu = torch.device("cpu")

    def cfg(b, hkv, group, length, d=128):
        return decode_attention_config(b, hkv, group, length, d, torch.bfloat16, cpu)

    slots = 132 * 3
    assert cfg(1, 8, 5, 2112).programs_per_sm == 3 and cfg(1, 8, 5, 2112).block_n == 64
    assert cfg(1, 8, 5, 2112).splits == 33  # every block its own range: 264 programs
    assert cfg(16, 8, 5, 2112).splits == 4  # 512 programs >= 396 slots
    assert cfg(64, 8, 5, 2112).splits == 1 and cfg(1, 8, 5, 37).splits == 1 and cfg(1, 8, 5, 0).splits == 1
    for b, hkv, length in ((1, 1, 4096), (2, 8, 700), (4, 4, 130), (3, 2, 100000)):
        c = cfg(b, hkv, 4, length)
        blocks = -(-length // c.block_n)
        assert 1 <= c.splits <= blocks
        assert c.splits == blocks or b * hkv * c.splits >= slots
    assert decode_attention_config(1, 8, 1, 2112, 64, torch.float16, cpu).block_n == 128
    assert decode_attention_config(1, 8, 1, 2112, 256, torch.bfloat16, cpu).block_n == 32
    assert decode_attention_config(1, 1, 32, 2112, 256, torch.bfloat16, cpu).programs_per_sm == 2


# ----------------------------------------------------------------------------- the sm_90 build

_COMPILE = r'''
import json, re, torch, triton
from triton.backends.compiler import GPUTarget
from tileq.kernels import decode_attention as da
from tileq.dispatch.attention import decode_attention_config

T = GPUTarget("cuda", 90, 32)
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.bool: "*i1"}

def compile_call(call, ptr_dtypes):
    """The launch's kernel compiled for sm_90 with the arguments' types and the divisibility the
    JIT would see (16-byte aligned tensors, integers that are multiples of 16)."""
    fn = getattr(da, call.name)
    names = fn.arg_names
    sig, consts, aligned = {}, {}, []
    for i, (n, t) in enumerate(zip(names, ptr_dtypes)):
        sig[n] = "constexpr" if t is None else PTR[t]
        if t is None:
            consts[n] = None
        else:
            aligned.append(i)
    for i, (n, v) in enumerate(zip(names[len(ptr_dtypes):], call.ints), len(ptr_dtypes)):
        sig[n] = "fp32" if isinstance(v, float) else "i32"
        if isinstance(v, int) and v % 16 == 0:
            aligned.append(i)
    opts = {}
    for k, v in call.kwargs.items():
        if k in ("num_warps", "num_stages", "launch_pdl"):
            opts[k] = v
        else:
            sig[k], consts[k] = "constexpr", v
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    c = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=T,
                       options=opts)
    ptx = c.asm["ptx"]
    first = [m.start() for m in re.finditer(r"\b(ld\.global|cp\.async|st\.global)", ptx)]
    return dict(shared=c.metadata.shared, mma=len(re.findall(r"\bmma\.sync|\bwgmma", ptx)),
                cp_async16=len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10,", ptx)),
                wait=ptx.count("griddepcontrol.wait"), wait_at=ptx.find("griddepcontrol.wait"),
                first_access=min(first) if first else -1)

out = {}
for name, (b, hq, hkv, d, length, dtype, mask, pdl) in dict(
        d128_mask_pdl=(1, 40, 8, 128, 2112, torch.bfloat16, True, True),
        d128_mask_b64=(64, 40, 8, 128, 2112, torch.bfloat16, True, False),  # one range: the combine of one
        d64_fp16=(2, 8, 1, 64, 2112, torch.float16, False, False),
        d256_g32=(1, 32, 1, 256, 2112, torch.bfloat16, True, False)).items():
    cfg = decode_attention_config(b, hkv, hq // hkv, length, d, dtype, torch.device("cpu"))
    kv = (hkv * length * d if b > 1 else 0, length * d, d)  # contiguous [B, HKV, L, D]
    launch = da.DecodeAttentionLaunch(
        batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, length=length, q_strides=(hq * d if b > 1 else 0, d),
        k_strides=kv, v_strides=kv,
        mask_strides=(length if b > 1 else 0, 1) if mask else None, scaling=d ** -0.5, dtype=dtype,
        device=torch.device("cpu"), interpreted=False, block_n=cfg.block_n, splits=cfg.splits,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, pdl=pdl)
    out[name] = dict(
        split=compile_call(launch.split, (dtype, dtype, dtype, torch.bool if mask else None, torch.float32)),
        combine=compile_call(launch.combine, (torch.float32, dtype)),
        block_n=cfg.block_n, group=hq // hkv, d=d, elem=dtype.itemsize, pdl=pdl)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def builds():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sm90_build_streams_kv_through_the_tensor_cores(builds):
    """The split kernel's sm_90 build: Q @ K and P @ V as tensor-core mma, K and V loaded ahead by
    16-byte cp.async copies (Triton's software pipeline), its shared memory what the
    dispatch's residency rule assumes (``dispatch/attention.shared_bytes``)."""
    for name, b in builds.items():
        split = b["split"]
        assert split["mma"] > 0 and split["cp_async16"] > 0, (name, split)
        want = shared_bytes(b["block_n"], b["d"], b["elem"], da.group_tile(b["group"]))
        assert split["shared"] == want, (name, split)
        assert b["combine"]["mma"] == 0


def test_sm90_build_waits_exactly_when_pdl_is_on(builds):
    for name, b in builds.items():
        for kernel in ("split", "combine"):
            c = b[kernel]
            assert c["wait"] == int(b["pdl"]), (name, kernel)
            if b["pdl"]:  # nothing read or written before the wait
                assert 0 < c["wait_at"] < c["first_access"], (name, kernel, c)
