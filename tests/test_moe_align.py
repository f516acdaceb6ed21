"""The MoE layer's one-launch masked-form preparation and its combine (tileq.kernels.moe_align) on the
interpreter: against ``tileq.moe.align`` + the gathers / scatters it replaces, and against the
kernels' own torch references; ``fused_moe`` through the kernels against the torch ops bit for
bit; the kernels' sm_90 builds.

Exactness: the align kernel only moves bits (rows, scales) and converts routing weights to fp32 as
``Tensor.float()`` does, so every valid row, count and slot row is equal. The combine adds in fp32 in
j order, as a sequential torch loop does: bit for bit; within one output ulp of a float64 sum.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tileq.nn as tnn
from tileq.errors import UnsupportedError
from tileq.kernels import moe_align as ma
from tileq.moe import QuantExperts, align, fused_moe, layer, softmax_topk

ROOT = Path(__file__).resolve().parents[1]


def _ids(t, k, e, kind, dtype, g):
    if kind == "uniform":  # k distinct experts per token, as torch.topk picks them
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    elif kind == "skewed":  # every token on the same k experts: each of them at full capacity C = T
        ids = torch.arange(k).repeat(t, 1) + (e - k)
    else:  # "one": every slot on expert 1 (needs C = T * k)
        ids = torch.ones(t, k)
    return ids.to(dtype)


def _rows(t, width, dtype, g):
    if dtype == torch.int8:
        return torch.randint(-128, 128, (t, width), generator=g, dtype=torch.int8)
    return (torch.randn(t, width, generator=g) * 4).to(dtype)


def _launch(ids, w, x, xs, e, c):
    t, k = ids.shape
    return ma.MoeAlignLaunch(
        t=t, topk=k, e=e, c=c, k_dim=x.shape[1], device=x.device, ids_dtype=ids.dtype, ids_strides=ids.stride(),
        w_dtype=w.dtype, w_strides=w.stride(), x_dtype=x.dtype, x_stride=x.stride(0),
        xs_shape=None if xs is None else tuple(xs.shape), xs_strides=None if xs is None else xs.stride(),
        interpreted=True, pdl=False)


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype != torch.int8 else t


# (T, k, E, routing, ids dtype, x dtype, scales: None / 'row' / 'group', row width K, weights dtype)
CASES = [
    (1, 1, 8, "uniform", torch.int64, torch.bfloat16, None, 200, torch.float32),
    (1, 8, 128, "uniform", torch.int64, torch.float8_e4m3fn, "group", 256, torch.float32),
    (3, 2, 64, "uniform", torch.int32, torch.int8, "row", 200, torch.bfloat16),
    (3, 8, 8, "skewed", torch.int64, torch.bfloat16, None, 4200, torch.float32),  # rows over 3 chunks
    (16, 2, 8, "uniform", torch.int32, torch.float8_e4m3fn, "row", 128, torch.float64),
    (16, 8, 64, "skewed", torch.int64, torch.int8, "group", 300, torch.float16),
    (33, 1, 128, "one", torch.int32, torch.bfloat16, None, 64, torch.float32),
    (33, 2, 8, "uniform", torch.int64, torch.float8_e4m3fn, "group", 384, torch.float32),
    (33, 8, 64, "uniform", torch.int64, torch.int8, "row", 64, torch.float32),
    (16, 2, 8, "one", torch.int64, torch.float8_e4m3fn, "group", 128, torch.float32),  # C = T * k
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-{c[3]}-{str(c[5])[6:]}-{c[6]}")
def test_align_kernel_equals_align_and_scatter(case):
    t, k, e, kind, idt, xdt, scales, width, wdt = case
    g = torch.Generator().manual_seed(t * 1000 + k * 10 + e)
    ids = _ids(t, k, e, kind, idt, g)
    ids = torch.stack([ids, torch.full_like(ids, -5)], dim=2)[:, :, 0]  # strides (2k, 2): read in place
    w = torch.rand(t, k, generator=g).to(wdt)
    x = _rows(t, width, xdt, g)
    xs = {None: None, "row": torch.rand(t, generator=g), "group": torch.rand(t, 3, generator=g)}[scales]
    c = t * k if kind == "one" else t
    xg, sg, rs, counts, slot_rows = _launch(ids, w, x, xs, e, c)(ids, w, x, xs)

    al = align(ids, w, e, form="masked", capacity=c)
    assert counts.dtype == torch.int32 and torch.equal(counts, al.counts)
    assert slot_rows.dtype == torch.int32 and torch.equal(slot_rows.long(), al.slot_rows)
    assert counts.sum() == t * k
    if kind != "uniform":
        assert counts.max() == c  # experts at full capacity
    valid = torch.arange(c)[None, :] < counts[:, None]  # [E, C]: the rows the GEMMs read
    rows = (e, c)
    want_x = layer._scatter(layer._gather(x, al.tokens), al.dest, rows)
    assert xg.shape == (e, c, width) and xg.dtype == xdt
    assert torch.equal(_bits(xg)[valid], _bits(want_x)[valid])
    assert torch.equal(rs[valid], layer._scatter(al.weights, al.dest, rows)[valid])
    if xs is None:
        assert sg is None
    else:
        want_s = layer._scatter(xs[al.tokens], al.dest, rows)
        assert sg.shape == want_s.shape and torch.equal(sg[valid], want_s[valid])
    # and the kernels module's own reference (a one-hot prefix count instead of a sort)
    rx, rsg, rrs, rc, rsr = ma.moe_align_ref(ids, w, x, xs, e, c)
    assert torch.equal(rc, counts) and torch.equal(rsr, slot_rows)
    assert torch.equal(_bits(rx)[valid], _bits(xg)[valid]) and torch.equal(rrs[valid], rs[valid])
    assert xs is None or torch.equal(rsg[valid], sg[valid])


def test_align_kernel_refusals():
    ids = torch.zeros(4097, 1, dtype=torch.int64)
    with pytest.raises(UnsupportedError, match="at most 4096 slots"):
        _launch(ids, ids.float(), torch.zeros(4097, 8), None, 8, 4097)
    with pytest.raises(UnsupportedError, match="x: expected a dtype"):
        _launch(ids[:2], ids[:2].float(), torch.zeros(2, 8, dtype=torch.int32), None, 8, 2)


def _ulp(v, dtype):
    mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    exp = torch.frexp(v.abs().double().clamp_min(2.0 ** -14)).exponent
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), exp - 1 - mant)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_equals_sequential_fp32_loop(dtype):
    g = torch.Generator().manual_seed(7)
    t, k, e, h = 5, 3, 8, 1100  # two column blocks, the second partial
    ids = _ids(t, k, e, "uniform", torch.int64, g)
    slot_rows = ma.moe_align_ref(ids, torch.ones(t, k), torch.zeros(t, 1), None, e, t)[4]
    y = (torch.randn(e, t, h, generator=g) * 3).to(dtype)
    launch = ma.MoeCombineLaunch(t=t, topk=k, rows=e * t, h=h, y_stride=h, y_dtype=dtype, out_dtype=dtype,
                                 device=y.device, interpreted=True, pdl=False)
    out = launch(y, slot_rows)
    rows = y.view(-1, h)[slot_rows.long()].view(t, k, h)
    acc = torch.zeros(t, h)
    for j in range(k):  # fp32 adds in j order
        acc = acc + rows[:, j].float()
    assert out.dtype == dtype and torch.equal(out, acc.to(dtype))
    assert torch.equal(out, ma.moe_combine_ref(y, slot_rows, t, k, dtype))
    exact = rows.double().sum(dim=1)
    assert ((out.double() - exact).abs() <= _ulp(exact, dtype)).all()
    assert (out != 0).float().mean() > 0.99


# ----------------------------------------------------------------------------- fused_moe


def _experts(name, e=8, h=128, i=128):
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(e, 2 * i, h, generator=g) * 0.05).bfloat16()
    dn = (torch.randn(e, h, i, generator=g) * 0.05).bfloat16()
    return QuantExperts.from_weights(gu, dn, tnn.config_from_name(name))


@pytest.mark.parametrize("name", ["A8W8", "FP8Block", "W4A16"])
def test_fused_moe_kernels_equal_torch_ops(name, monkeypatch):
    ex = _experts(name)
    g = torch.Generator().manual_seed(2)
    t, k = 3, 2
    # W4A16 moves the model's rows as they are: a strided hidden state (rows of a wider tensor)
    x = torch.randn(t, 160 if name == "W4A16" else 128, generator=g).bfloat16()[:, :128]
    ids, w = softmax_topk(torch.randn(t, 8, generator=g), k, normalize=True)
    monkeypatch.setattr(layer, "_KERNELS", {})
    got = fused_moe(x, (ids.int(), w), ex, form="masked", backend="triton")
    kernels = [v for v in layer._KERNELS.values()]
    assert len(kernels) == 1 and kernels[0], "the masked form took the kernels"
    # the torch ops (what a forced masked form beyond MAX_SLOTS runs)
    monkeypatch.setattr(layer, "_KERNELS", {})
    monkeypatch.setattr(ma, "MAX_SLOTS", t * k - 1)
    want = fused_moe(x, (ids.int(), w), ex, form="masked", backend="triton")
    assert list(layer._KERNELS.values()) == [False]
    assert want.float().abs().max() > 1e-2
    assert torch.equal(got, want)


def test_reference_backend_keeps_torch_ops(monkeypatch):
    ex = _experts("A8W8", e=4)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, generator=g).bfloat16()
    ids, w = softmax_topk(torch.randn(2, 4, generator=g), 2, normalize=True)
    monkeypatch.setattr(layer, "_KERNELS", {})
    fused_moe(x, (ids, w), ex, form="masked", backend="reference")
    assert list(layer._KERNELS.values()) == [False]


# ----------------------------------------------------------------------------- sm_90 builds

_COMPILE_SCRIPT = r"""
import json, re, torch, triton
from triton.backends.compiler import GPUTarget
from tileq.errors import UnsupportedError
from tileq.kernels import moe_align as ma
cpu = torch.device("cpu")
out = {}
for name, (xdt, gs, pdl) in {"fp8_group": (torch.float8_e4m3fn, 56, False), "bf16": (torch.bfloat16, 0, True)}.items():
    launch = ma.MoeAlignLaunch(t=16, topk=8, e=128, c=16, k_dim=7168, device=cpu, ids_dtype=torch.int64,
        ids_strides=(8, 1), w_dtype=torch.float32, w_strides=(8, 1), x_dtype=xdt, x_stride=7168,
        xs_shape=(16, gs) if gs else None, xs_strides=(gs, 1) if gs else None, interpreted=False, pdl=pdl)
    launches = {"align_" + name: launch}
    if pdl:
        launches["combine_" + name] = ma.MoeCombineLaunch(t=16, topk=8, rows=128 * 16, h=7168, y_stride=7168,
            y_dtype=xdt, out_dtype=xdt, device=cpu, interpreted=False, pdl=pdl)
    for key, ln in launches.items():
        src, options = ma.aot_source(ln)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        out[key] = {p: len(re.findall(re.escape(p), ptx)) for p in (
            "ld.global.v4", "st.global.v4", "griddepcontrol.wait", "atom.", "red.global")}
print(json.dumps(out))
"""


def test_compiles_for_sm90():
    """Both kernels build for sm_90 on a CPU: 16-byte row copies and combine loads, no atomics, and
    with PDL a grid-dependency wait."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(res) == {"align_fp8_group", "align_bf16", "combine_bf16"}
    for name, c in res.items():
        assert c["ld.global.v4"] > 0 and c["atom."] == 0 and c["red.global"] == 0, (name, c)
        assert c["griddepcontrol.wait"] == (0 if "fp8" in name else 1), (name, c)
    for name in ("align_fp8_group", "align_bf16", "combine_bf16"):
        assert res[name]["st.global.v4"] > 0, (name, res[name])
