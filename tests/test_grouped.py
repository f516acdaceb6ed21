"""tileq.grouped_linear on the CPU: the per-expert reference against tileq.linear's, the grouped
Triton kernel (interpreter) against the reference for every scheme, both forms and both tile
orientations, the edge cases of routing (an expert without rows, one row in all, every row to one
expert, E = 1, rows past the experts left unwritten), row_scale, the call cache, explain, the
errors, and an sm_90 build (wgmma, pipelined loads) in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tileq
from tileq import api_grouped
from tileq.dispatch.plan import make_plan
from tileq.errors import (
    DTypeError,
    LayoutError,
    ScaleError,
    ShapeError,
    UnsupportedError,
)
from tileq.kernels.grouped.launch import GroupedLaunch
from tileq.kernels.grouped.spec import GroupedConfig
from tileq.reference_grouped import expert_weight, grouped_linear_ref
from tileq.testing import check_close

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs Triton kernels on CPU tensors (the interpreter)")
F8 = torch.float8_e4m3fn
SENTINEL = -768.0  # (exact in bf16) rows outside every expert must keep it

# (name, x dtype, w dtype ('i4': uint8 packed), scheme, x_scale kind, group_k)
CASES = [
    ("fp8_block", F8, F8, "abquant", "group", 128),  # DeepSeek-style 1x128 x 128x128
    ("fp8_rowcol", F8, F8, "rowcol", "row", 128),
    ("int8_rowcol", torch.int8, torch.int8, "rowcol", "row", 128),
    ("w4a16", torch.bfloat16, "i4", "bquant", None, 64),
    ("w4a8", F8, "i4", "bquant", "row", 128),
    ("w8a16", torch.bfloat16, torch.int8, "rowcol", None, 128),
    ("w8a16_group", torch.bfloat16, torch.int8, "bquant", None, 64),
    ("w4a16_channel", torch.bfloat16, "i4", "rowcol", None, 128),  # W4A16 with group_size=None
]


def _values(dtype, shape, gen):
    if dtype == "i4":
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if dtype == torch.int8:
        return torch.randint(-100, 101, shape, generator=gen, dtype=torch.int8)
    return (torch.randn(shape, generator=gen) * 2).to(dtype)


def make_case(case, *, e=3, n=40, k=200, rows=(4, 0, 5), masked=False, cap=None, row_scale=False,
              spare=2, seed=0):
    """Arguments of one grouped call: expert e gets rows[e] rows; contiguous x has ``spare`` rows
    past the last expert; masked x has capacity ``cap``."""
    _, x_dtype, w_dtype, scheme, xs_kind, group_k = case
    gen = torch.Generator().manual_seed(seed)
    gk = -(-k // group_k)
    w = _values(w_dtype, (e, n, k // 2 if w_dtype == "i4" else k), gen)
    if scheme == "abquant":
        w_scale = torch.rand(e, -(-n // 128), gk, generator=gen) + 0.5
    elif scheme == "bquant":
        w_scale = torch.rand(e, n, gk, generator=gen) + 0.5
    else:
        w_scale = torch.rand(e, n, generator=gen) + 0.5
    if masked:
        cap = cap or max(max(rows), 1) + 1
        lead = (e, cap)
        index = {"counts": torch.tensor(rows, dtype=torch.int32)}
    else:
        lead = (sum(rows) + spare,)
        offs = [0]
        for r in rows:
            offs.append(offs[-1] + r)
        index = {"offsets": torch.tensor(offs, dtype=torch.int32)}
    x = _values(x_dtype, (*lead, k), gen)
    x_scale = None
    if xs_kind == "group":
        x_scale = torch.rand(*lead, gk, generator=gen) + 0.5
    elif xs_kind == "row":
        x_scale = torch.rand(*lead, generator=gen) + 0.5
    kw = dict(scheme=scheme, group_k=group_k, **index)
    if row_scale:
        kw["row_scale"] = torch.rand(*lead, generator=gen)
    return (x, w, x_scale, w_scale), kw


def _spans(kw, x):
    if "counts" in kw:
        return [(e, 0, int(c)) for e, c in enumerate(kw["counts"])]
    o = kw["offsets"].tolist()
    return [(e, o[e], o[e + 1]) for e in range(len(o) - 1)]


def _rows(y, kw, e, lo, hi):
    return y[e, lo:hi] if "counts" in kw else y[lo:hi]


def _check(y, ref, kw, x):
    """Valid rows close to the reference; every other row still holds the sentinel."""
    written = torch.zeros(y.shape[:-1], dtype=torch.bool)
    for e, lo, hi in _spans(kw, x):
        if "counts" in kw:
            written[e, lo:hi] = True
        else:
            written[lo:hi] = True
    check_close(y[written], ref[written])
    assert (y[~written].float() == SENTINEL).all(), "rows outside every expert were written"


def _out(x, n):
    return torch.full((*x.shape[:-1], n), SENTINEL, dtype=torch.bfloat16)


# ---- the reference --------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_reference_equals_linear_per_expert(case, masked):
    (x, w, xs, ws), kw = make_case(case, masked=masked)
    y = tileq.grouped_linear(x, w, xs, ws, backend="reference", **kw)
    assert y.shape == (*x.shape[:-1], 40)
    k = x.shape[-1]
    for e, lo, hi in _spans(kw, x):
        if hi == lo:
            continue
        x_e = x[e, lo:hi] if masked else x[lo:hi]
        xs_e = None if xs is None else (xs[e, lo:hi] if masked else xs[lo:hi])
        ws_e = ws[e].t() if ws.dim() == 3 else ws[e]  # linear's w_scale is the logical B's [Gk, Gn]
        want = tileq.linear(x_e, expert_weight(w, e, k), xs_e, ws_e, scheme=kw["scheme"],
                            group_k=kw["group_k"], backend="reference")
        assert torch.equal(_rows(y, kw, e, lo, hi), want), (case[0], e)
        assert want.float().abs().max() > 1  # far above the tolerance


def test_reference_row_scale_and_unwritten_rows():
    (x, w, xs, ws), kw = make_case(CASES[1], row_scale=True)
    rs = kw.pop("row_scale")
    plain = grouped_linear_ref(x, w, xs, ws, **kw)
    out = _out(x, 40)
    scaled = grouped_linear_ref(x, w, xs, ws, row_scale=rs, out=out, **kw)
    assert scaled is out
    live = slice(0, 9)  # rows 9, 10 belong to no expert
    want = (plain[live].float() * rs[live, None]).to(torch.bfloat16)
    assert (scaled[live].float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7
    assert (out[9:].float() == SENTINEL).all()


def test_reference_checks_offset_values():
    (x, w, xs, ws), kw = make_case(CASES[1])
    kw["offsets"] = torch.tensor([0, 5, 3, 9], dtype=torch.int32)
    with pytest.raises(ShapeError, match="offsets: expected non-decreasing values from 0 to at most T=11"):
        tileq.grouped_linear(x, w, xs, ws, backend="reference", **kw)


# ---- the kernel (interpreter) against the reference ----------------------------------------

SWAP = GroupedConfig(16, 64, 64, 4, 2, swap_ab=True)
DIRECT = GroupedConfig(16, 32, 64, 4, 2)


def _kernel(args, kw, cfg, out):
    """The grouped kernel with a forced tile config (both orientations on small shapes)."""
    x, w, xs, ws = args
    spec, a = api_grouped.validate(x, w, xs, ws, out_dtype=torch.bfloat16, group_n=None,
                                   row_scale=kw.get("row_scale"), out=out, offsets=kw.get("offsets"),
                                   counts=kw.get("counts"), scheme=kw["scheme"], group_k=kw["group_k"])
    return GroupedLaunch(spec, cfg, a, interpreted=True)(a.x, a.w, a.x_scale, a.w_scale, a.row_scale,
                                                         a.index, a.out)


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("cfg", [SWAP, DIRECT], ids=["swapped", "direct"])
def test_kernel_matches_reference(case, masked, cfg):
    # odd N and K (a partial last K group and K tile), an expert without rows, row_scale
    args, kw = make_case(case, masked=masked, row_scale=True, rows=(4, 0, 18))
    ref = grouped_linear_ref(*args, **kw)
    y = _kernel(args, kw, cfg, _out(args[0], 40))
    _check(y, ref, kw, args[0])


def test_group_configs_are_checked():
    args, kw = make_case(CASES[2])
    spec = api_grouped.validate(*args, out_dtype=torch.bfloat16, group_n=None, row_scale=None, out=None,
                                counts=None, **kw)[0]
    from tileq.kernels.grouped.spec import config_problem

    assert config_problem(spec, GroupedConfig(16, 64, 64, 4, 2, group_m=1)) is None
    assert "group_m=0" in config_problem(spec, GroupedConfig(16, 64, 64, 4, 2, group_m=0))
    assert GroupedConfig(16, 64, 128, 4, 4, True, 1).tag == "m16n64k128_w4_s4_g1_swap"


ROUTINGS = {
    "one_row": (0, 1, 0),
    "all_to_one": (0, 0, 21),
    "single_expert": (7,),
    "no_rows": (0, 0, 0),
    "one_row_each": (1, 1, 1, 1, 1),  # the contiguous grid's bound, cdiv(T, BM) + min(E, T), is tight
    "tile_and_one": (17, 0, 17, 1),
}


@needs_interpreter
@pytest.mark.parametrize("routing", list(ROUTINGS), ids=list(ROUTINGS))
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_kernel_routing_edges(routing, masked):
    rows = ROUTINGS[routing]
    args, kw = make_case(CASES[0], e=len(rows), rows=rows, masked=masked, n=136, k=256)
    ref = grouped_linear_ref(*args, **kw)
    out = _out(args[0], 136)
    y = tileq.grouped_linear(*args, backend="triton", out=out, **kw)
    assert y is out
    if sum(rows):
        _check(y, ref, kw, args[0])
    else:
        assert (y.float() == SENTINEL).all()


@needs_interpreter
def test_kernel_planned_configs_and_fresh_output():
    """The planner's own tiles (decode swapped with 16 tokens at T/E <= 16, 32 up to 32, the
    64-row decode tile up to 64, above it the prefill tile: 64 rows for fp8 x fp8) and a fresh output."""
    for rows, swapped, bm in (((3, 5), True, 16), ((20, 30), True, 32), ((40, 50), False, 64),
                              ((140, 2), False, 64)):
        args, kw = make_case(CASES[1], e=2, rows=rows, n=40, k=96, spare=0)
        plan = make_plan(api_grouped.validate(*args, out_dtype=torch.bfloat16, group_n=None,
                                              row_scale=None, out=None, counts=None, **kw)[0],
                         torch.device("cpu"), backend="triton")
        assert (plan.config.swap_ab, plan.config.block_m) == (swapped, bm), plan.describe()
        y = tileq.grouped_linear(*args, backend="triton", **kw)
        check_close(y, grouped_linear_ref(*args, **kw))


@needs_interpreter
def test_fp32_output_and_fp16_x():
    args, kw = make_case(("w4a16_fp16", torch.float16, "i4", "bquant", None, 128), rows=(3, 2, 4))
    y = tileq.grouped_linear(*args, backend="triton", out_dtype=torch.float32, **kw)
    ref = grouped_linear_ref(*args, out_dtype=torch.float32, **kw)
    assert y.dtype == torch.float32
    check_close(y[:9], ref[:9])


def _spec(form, e, rows, n, k, scheme="abquant"):
    from tileq.dtypes import OperandType
    from tileq.kernels.grouped.spec import GroupedSpec
    from tileq.problem import ScaleKind, Scheme

    if scheme == "abquant":
        return GroupedSpec(form, e, rows, n, k, OperandType.FP8, OperandType.FP8, Scheme.ABQUANT, ScaleKind.GROUP,
                           ScaleKind.GROUP, group_n=128)
    return GroupedSpec(form, e, rows, n, k, OperandType.I8, OperandType.I8, Scheme.ROWCOL, ScaleKind.VECTOR,
                       ScaleKind.VECTOR)


def test_planned_configs_on_sm90():
    """The sm_90 plan at MoE shapes: one token's T/E of 1 and the masked form's C = 1 take the
    swapped 16-token tile, unsplit (the grid has one program per tile); prefill takes the 64-row
    fp8 tile with 4 warps, or the arch's 128-row prefill tile for int8, in groups of 8 row tiles."""
    from tileq.dispatch.grouped import choose_config

    one_token = _spec("contiguous", 128, 8, 1536, 2048)
    cfg, why = choose_config(one_token, "sm_90")
    assert (cfg.swap_ab, cfg.block_m, cfg.group_m) == (True, 16, 8), why
    assert "GROUPED_SWAP_MAX_M=32" in why and "split" not in why
    assert choose_config(_spec("masked", 128, 1, 1536, 2048), "sm_90")[0] == cfg
    prefill, why = choose_config(_spec("contiguous", 128, 32768, 1536, 2048), "sm_90")
    assert (prefill.group_m, prefill.block_m, prefill.num_warps) == (8, 64, 4), why  # fp8
    int8 = choose_config(_spec("contiguous", 128, 32768, 1536, 2048, "rowcol"), "sm_90")[0]
    assert int8.block_m == 128  # the arch's prefill tile


# ---- cache, explain ------------------------------------------------------------------------


@needs_interpreter
def test_repeated_call_skips_validation(monkeypatch):
    api_grouped.clear_call_cache()
    args, kw = make_case(CASES[0], rows=(2, 1, 3))
    first = tileq.grouped_linear(*args, backend="triton", **kw)

    def refuse(*a, **k):
        raise AssertionError("validated again")

    monkeypatch.setattr(api_grouped, "validate", refuse)
    x, w, xs, ws = args
    again = tileq.grouped_linear(x, w, xs.clone(), ws, backend="triton", **kw)
    assert torch.equal(first[:6], again[:6])
    kw["offsets"] = torch.tensor([0, 3, 3, 6], dtype=torch.int32)  # new routing, same signature
    moved = tileq.grouped_linear(*args, backend="triton", **kw)
    check_close(moved[:6], grouped_linear_ref(*args, **kw)[:6])


def test_explain_describes_the_plan():
    args, kw = make_case(CASES[0], masked=True, cap=8)
    text = tileq.explain_grouped(*args, backend="triton", **kw)
    assert "grouped masked abquant fp8xfp8  E=3 C=8 N=40 K=200  group_k=128 group_n=128" in text
    assert "swapped" in text and "C=8 rows per expert <= GROUPED_SWAP_MAX_M=32" in text
    assert "grid      : 3 x 1 programs (E x ceil(C/BM) row tiles" in text
    assert "promote(x_scale[rows,Gk] x w_scale[Gn,Gk])" in text
    assert "executor  : reference" in tileq.explain_grouped(*args, backend="reference", **kw)


# ---- errors --------------------------------------------------------------------------------


def _call(args, kw, **change):
    x, w, xs, ws = args
    a = {"x": x, "w": w, "x_scale": xs, "w_scale": ws}
    a.update({k: v for k, v in change.items() if k in a})
    kw = dict(kw, **{k: v for k, v in change.items() if k not in a})
    kw = {k: v for k, v in kw.items() if v is not None}
    return tileq.grouped_linear(a["x"], a["w"], a["x_scale"], a["w_scale"], backend="reference", **kw)


def test_errors_name_the_argument():
    args, kw = make_case(CASES[0])
    x, w, xs, ws = args
    with pytest.raises(ShapeError, match=r"w_scale: expected shape \[E, Gn, Gk\] with E=3, Gn=N=40 or "
                                         r"ceil\(N/128\)=1, Gk=ceil\(K/128\)=2 .*did you mean w_scale.transpose"):
        _call(args, kw, w_scale=ws.transpose(1, 2).contiguous())
    with pytest.raises(ShapeError, match=r"offsets, counts: expected exactly one"):
        _call(args, kw, counts=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ShapeError, match=r"x: expected a 3-D tensor \[E, C, K\] with counts"):
        _call(args, kw, offsets=None, counts=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(DTypeError, match=r"offsets: expected dtype torch.int32"):
        _call(args, kw, offsets=kw["offsets"].long())
    with pytest.raises(ShapeError, match=r"offsets: expected shape \(4,\)"):
        _call(args, kw, offsets=kw["offsets"][:3])
    with pytest.raises(ShapeError, match=r"w: expected \[E, N, K\] with K=200 \(K is x's last dimension\), "
                                         r"got shape \(3, 40, 199\)"):
        _call(args, kw, w=w[:, :, :199])
    with pytest.raises(ShapeError, match=r"x_scale: expected shape \[T, Gk\] = \(11, 2\)"):
        _call(args, kw, x_scale=xs[:, :1])
    with pytest.raises(ScaleError, match=r"x_scale: expected shape .* got None"):
        _call(args, kw, x_scale=None)
    with pytest.raises(UnsupportedError, match=r"scheme: expected one of rowcol, bquant, abquant"):
        _call(args, kw, scheme="tensor")
    with pytest.raises(ShapeError, match=r"row_scale: expected shape \[T\] = \(11,\)"):
        _call(args, kw, row_scale=torch.ones(10))
    with pytest.raises(ShapeError, match=r"out: expected shape \(11, 40\)"):
        _call(args, kw, out=torch.empty(11, 41, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match=r"x: expected unit stride along K"):
        _call(args, kw, x=x.t().contiguous().t())
    with pytest.raises(DTypeError, match=r"x, w: expected a legal operand pair"):
        _call(args, kw, x=x.to(torch.int8))
    with pytest.raises(UnsupportedError, match=r"group_k: expected a multiple of 16"):
        w4 = make_case(CASES[3], k=24)[0]
        tileq.grouped_linear(*w4[:2], None, torch.ones(3, 40, 3), scheme="bquant", group_k=8,
                             offsets=kw["offsets"], backend="triton")


def test_rowcol_scale_shapes():
    args, kw = make_case(CASES[2], masked=True)
    _x, _w, xs, ws = args
    with pytest.raises(ShapeError, match=r"w_scale: expected shape \[E, N\] = \(3, 40\)"):
        _call(args, kw, w_scale=ws[:, None, :])
    with pytest.raises(ShapeError, match=r"x_scale: expected shape \[E, C\] = \(3, 6\) or \(3, 6, 1\)"):
        _call(args, kw, x_scale=xs[0])
    y = _call(args, kw, x_scale=xs[..., None])  # the trailing 1 is accepted
    assert torch.equal(y[0, :4], _call(args, kw)[0, :4])


# ---- sm_90 build -----------------------------------------------------------------------------

_BUILD = r"""
import json, torch
from tileq.kernels.grouped.spec import GroupedSpec, GroupedConfig
from tileq.kernels.grouped.launch import compile_sm90
from tileq.dtypes import OperandType as O
from tileq.problem import Scheme, ScaleKind as S
cases = [
 ("fp8_block_decode", GroupedSpec("masked", 8, 16, 2048, 7168, O.FP8, O.FP8, Scheme.ABQUANT, S.GROUP, S.GROUP,
                                  group_n=128, has_row_scale=True), GroupedConfig(16, 64, 128, 4, 4, True)),
 ("fp8_block_prefill", GroupedSpec("contiguous", 8, 4096, 2048, 7168, O.FP8, O.FP8, Scheme.ABQUANT, S.GROUP,
                                   S.GROUP, group_n=128), GroupedConfig(128, 128, 128, 8, 3)),
 ("w4a16_decode", GroupedSpec("contiguous", 8, 16, 1536, 2048, O.BF16, O.I4, Scheme.BQUANT, S.NONE, S.GROUP),
                  GroupedConfig(16, 64, 128, 4, 4, True)),
 ("int8_decode", GroupedSpec("contiguous", 128, 8, 1536, 2048, O.I8, O.I8, Scheme.ROWCOL, S.VECTOR, S.VECTOR),
                 GroupedConfig(16, 64, 256, 4, 4, True)),
]
res = {}
for name, spec, cfg in cases:
    k = compile_sm90(spec, cfg)
    ptx = k.asm["ptx"]
    res[name] = dict(mma=sorted({l.split()[0] for l in ptx.splitlines() if "wgmma.mma_async.sync" in l}),
                     cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                     atom=ptx.count("atom.global"))
print(json.dumps(res))
"""


def test_sm90_build_uses_wgmma_and_pipelines():
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    proc = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["fp8_block_decode"]["mma"] == ["wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"]
    assert res["fp8_block_prefill"]["mma"] == ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"]
    assert res["w4a16_decode"]["mma"] == ["wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"]
    assert res["int8_decode"]["mma"] == ["wgmma.mma_async.sync.aligned.m64n16k32.s32.s8.s8"]
    for name, r in res.items():
        assert r["cp_async"] > 0, f"{name}: the K loop's loads are not asynchronous copies (not pipelined)"
        assert r["atom"] == 0, f"{name}: a program stores its own tile (no atomics)"


def test_cli_explain_grouped(capsys):
    import tileq.cli

    rc = tileq.cli.main(["explain", "--scheme", "bquant", "--a", "bf16", "--b", "int4", "--m", "4", "--n", "768",
                         "--k", "2048", "--grouped", "128", "--form", "masked"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "grouped masked bquant bf16xi4  E=128 C=4 N=768 K=2048" in text
    assert "grid      : 128 x 12 programs" in text and "swapped" in text
    rc = tileq.cli.main(["explain", "--scheme", "rowcol", "--a", "int8", "--b", "int8", "--m", "8", "--n", "64",
                         "--k", "64", "--grouped", "4", "--bias"])
    assert rc == 2
    assert "--grouped: expected no --bias" in capsys.readouterr().err
