"""Programmatic dependent launch (PDL): the TILEQ_PDL switch, the launches that carry it, and the
sm_90 builds of every PDL-aware kernel (compiled on a CPU): the wait and the early trigger are in
the code exactly when the switch is on, and nothing is read or written before the wait (only L2
prefetches of the weight). The GPU test (a CUDA-graph chain, bit for bit with and without PDL)
is tests/test_pdl_gpu.py."""

import json
import os
import pathlib
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from tileq import settings
from tileq.device import for_arch
from tileq.errors import UnsupportedError
from tileq.dispatch import pdl as dispatch_pdl
from tileq.kernels import direct
from tileq.kernels import launch as gl

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda", 0)


@pytest.fixture
def arch(monkeypatch):
    """Pretend CUDA devices are of a given arch (pdl_enabled asks device facts only)."""
    def use(name):
        monkeypatch.setattr(dispatch_pdl, "_device_facts", lambda device: for_arch(name))
    return use


def test_switch_default_on_for_sm90_off_elsewhere(monkeypatch, arch):
    monkeypatch.delenv("TILEQ_PDL", raising=False)
    arch("sm_90")
    assert dispatch_pdl.pdl_enabled(CUDA, interpreted=False)
    assert not dispatch_pdl.pdl_enabled(CUDA, interpreted=True)  # the interpreter has no grid dependencies
    assert not dispatch_pdl.pdl_enabled(torch.device("cpu"), interpreted=False)
    monkeypatch.setenv("TILEQ_PDL", "0")
    assert not dispatch_pdl.pdl_enabled(CUDA, interpreted=False)
    arch("sm_80")
    monkeypatch.delenv("TILEQ_PDL")
    assert not dispatch_pdl.pdl_enabled(CUDA, interpreted=False)
    assert dispatch_pdl.pdl_enabled(CUDA, interpreted=False, arch=for_arch("sm_90").arch)  # a plan's arch
    monkeypatch.setenv("TILEQ_PDL", "1")
    with pytest.raises(UnsupportedError, match=r"TILEQ_PDL: expected unset or 0 on sm_80 .*sm_90 or newer\), got 1"):
        dispatch_pdl.pdl_enabled(CUDA, interpreted=False)


def test_switch_values_and_cache_key(monkeypatch):
    monkeypatch.setenv("TILEQ_PDL", "yes")
    with pytest.raises(UnsupportedError, match=r"TILEQ_PDL: expected 0 or 1, got 'yes'"):
        settings.current()
    monkeypatch.setenv("TILEQ_PDL", "0")
    off = settings.key()
    assert settings.current().pdl is False
    monkeypatch.setenv("TILEQ_PDL", "1")
    assert settings.current().pdl is True and settings.key() != off


def _split_launch(monkeypatch, pdl: bool, m: int = 4):
    from tileq.catalog.families import family_spec
    from tileq.catalog.names import parse_family
    from tileq.dispatch.plan import make_plan, with_config
    from tileq.problem import build_problem
    from tileq.testing import make_args

    fam = "rowcol_i8xi8_rcr_decode" if m <= 64 else "rowcol_i8xi8_rcr_prefill"
    spec = family_spec(parse_family(fam), m, 64, 512)
    problem = make_args(spec, seed=1).call(build_problem)
    base = make_plan(problem.spec, problem.device, backend="triton")
    assert base.pdl is False  # (the interpreter's plans: no PDL)
    return gl.GemmLaunch(problem, replace(with_config(base, replace(base.config, split_k=2)), pdl=pdl))


def test_gemm_launch_carries_pdl(monkeypatch):
    """With the plan's PDL the GEMM and its split-K reduction (a prefill split's) launch with
    Triton's launch_pdl option and wait for the kernel before them (their PDL constexpr); without
    it neither (the interpreter's plans never have it). A decode split sums in the kernel: one
    launch, PDL or not."""
    on = _split_launch(monkeypatch, True, m=100)
    assert on.main.kwargs["PDL"] is True and on.main.kwargs["launch_pdl"] is True
    assert on.reduce.name == "_split_reduce_kernel" and on.reduce.kwargs["PDL"] is True
    assert on.reduce.kwargs["launch_pdl"] is True
    off = _split_launch(monkeypatch, False, m=100)
    assert off.main.kwargs["PDL"] is False and "launch_pdl" not in off.main.kwargs
    assert off.reduce.name == "_split_reduce_kernel" and off.reduce.kwargs["PDL"] is False
    assert "launch_pdl" not in off.reduce.kwargs
    decode = _split_launch(monkeypatch, True)
    assert decode.reduce is None and decode.main.kwargs["FIXUP"] and decode.main.kwargs["launch_pdl"] is True
    # launch_pdl is an option, not a parameter: the direct launch still binds the constexprs
    from triton.runtime.jit import JITFunction

    fn = JITFunction(gl._gemm_kernel.fn)
    assert direct._constexpr_tail(fn, 9 + len(on.main.ints), on.main.kwargs) is not None


_COMPILE = r'''
import json, re, torch, triton
from dataclasses import replace
from triton.backends.compiler import GPUTarget
from tileq.build import instance_for, swapped_variant
from tileq.catalog.names import parse_family
from tileq.device import get_arch
from tileq.kernels import act_quant as aq
from tileq.kernels import launch as gl
from tileq.kernels.gemm_kernel import _gemm_kernel
from tileq.kernels.split_k import _split_reduce_kernel
from tileq.kernels.int4p.config import Int4pConfig
from tileq.kernels.qk_rope import _qk_norm_rope_kernel
from tileq.kernels.int4p.launch import compile_options, compile_source
from tileq.dispatch.act_quant import act_quant_config
from tileq.dtypes import OperandType as OT

T = GPUTarget("cuda", 90, 32)
MARKS = ("griddepcontrol.wait", "griddepcontrol.launch_dependents", "prefetch.global.L2", "wgmma", "mma.sync", "atom.",
         "0f4B400000", "cvt.rn.satfinite.e4m3x2.f32", "max.NaN.f32", "div.rn.f32", "fma.rn.bf16", "mul.rn.f32")
def counts(ptx):
    c = {p: len(re.findall(re.escape(p), ptx)) for p in MARKS}
    # Where the first memory access and the wait stand in the code (a kernel that waits must not
    # read or write before it; prefetches may come first).
    first = [m.start() for m in re.finditer(r"\b(ld\.global|cp\.async|st\.global|atom\.|red\.)", ptx)]
    c["first_access"] = min(first) if first else -1
    c["wait_at"] = ptx.find("griddepcontrol.wait")
    c["prefetch_at"] = ptx.find("prefetch.global.L2")
    return c

out = {}
def gemm(name, fam, swap=False, split=None, **kw):
    inst, spec = instance_for(parse_family(fam), get_arch("sm_90"), swap)
    cfg = inst.config if split is None else replace(inst.config, split_k=split)
    sig, consts, attrs = gl.signature(spec, cfg, **kw)
    c = triton.compile(triton.compiler.ASTSource(fn=_gemm_kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=T, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    out[name] = counts(c.asm["ptx"])
gemm("gemm_i8", "rowcol_i8xi8_rcr_decode")
gemm("gemm_i8_pdl", "rowcol_i8xi8_rcr_decode", pdl=True)
gemm("gemm_i8_swap_pdl", "rowcol_i8xi8_rcr_decode", swap=True, pdl=True)
gemm("gemm_i4_pdl", "bquant_fp8xi4_rcr_decode", pdl=True)
gemm("gemm_rrr_pdl", "rowcol_fp8xfp8_rrr_decode", pdl=True)
gemm("gemm_split", "rowcol_i8xi8_rcr_decode", split=2)
gemm("gemm_split_pdl", "rowcol_i8xi8_rcr_decode", split=2, pdl=True)
gemm("gemm_split_fixup", "rowcol_i8xi8_rcr_decode", swap=True, split=3, fixup=True)
gemm("gemm_split_fixup_pdl", "rowcol_i8xi8_rcr_decode", swap=True, split=3, fixup=True, pdl=True)
for name, pdl in (("reduce", False), ("reduce_pdl", True)):
    sig = {"ws_ptr": "*fp32", "c_ptr": "*bf16", "M": "i32", "N": "i32", "ldc": "i32", "total": "i32",
           "first_tile": "i32"}
    consts = dict(SPLIT_K=2, LAYOUT="flat", BLOCK=1024, BM=1, BN=1, GROUP_M=1, TRANS=True, PDL=pdl)
    sig.update({k: "constexpr" for k in consts})
    c = triton.compile(triton.compiler.ASTSource(fn=_split_reduce_kernel, signature=sig, constexprs=consts),
                       target=T, options={"num_warps": 4, "launch_pdl": pdl})
    out[name] = counts(c.asm["ptx"])
dev = torch.device("cpu")
for pdl in (False, True):
    sfx = "_pdl" if pdl else ""
    qa = aq.ActQuantLaunch(x_shape=(1, 5120), device=dev, m=1, k=5120, row_stride=5120, x_dtype=torch.bfloat16,
        otype=OT.I8, granularity="row", group_k=128, s_shape=(1,), s_strides=(1,), scale_dtype=None,
        scale_val=1.0, interpreted=False, cfg=act_quant_config(5120, "row", 128, m=1), pdl=pdl)
    fu = aq.AddRmsNormQuantLaunch(x_shape=(1, 5120), device=dev, m=1, k=5120, x_stride=5120, r_stride=5120,
        x_dtype=torch.bfloat16, otype=OT.FP8, granularity="row", group_k=128, s_shape=(1,), s_strides=(1,),
        eps=1e-6, interpreted=False, cfg=act_quant_config(5120, "row", 128, fused=True, m=1), pdl=pdl)
    out["act_quant" + sfx] = counts(aq.aot_compile(qa, 90)["ptx"])
    out["rmsnorm_quant" + sfx] = counts(aq.aot_compile(fu, 90)["ptx"])
for pdl in (False, True):
    for streamk in (False, True):
        cfg = Int4pConfig(bm=16, split_k=1 if streamk else 2, fixup=not streamk, streamk=streamk)
        c = triton.compile(compile_source("bf16", "group", cfg, pdl=pdl), target=T, options=compile_options(cfg))
        out[f"int4p{'_stk' if streamk else ''}{'_pdl' if pdl else ''}"] = counts(c.asm["ptx"])
for cache, pdl in ((False, False), (True, False), (True, True)):
    sig = {n: "*bf16" for n in ("x_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "q_ptr")}
    ptrs = dict(k_ptr=None, kc_ptr="*bf16", vc_ptr="*bf16", len_ptr="*i64") if cache else dict(
        k_ptr="*bf16", kc_ptr=None, vc_ptr=None, len_ptr=None)
    consts = dict(D=128, NORM=True, CACHE=cache, X_TYPE="bf16", INTERPRETED=False, PDL=pdl)
    for n, t in ptrs.items():
        sig[n] = "constexpr" if t is None else t
        if t is None:
            consts[n] = None
    sig.update(eps="fp32", T="i32", HQ="i32", HKV="i32", L="i32", stride_xb="i32", stride_xt="i32",
               stride_cb="i32", stride_ct="i32", D="constexpr", NORM="constexpr", CACHE="constexpr",
               X_TYPE="constexpr", INTERPRETED="constexpr", PDL="constexpr")
    c = triton.compile(triton.compiler.ASTSource(fn=_qk_norm_rope_kernel, signature=sig, constexprs=consts),
                       target=T, options={"num_warps": 1, "launch_pdl": pdl})
    out["qk_rope" + ("_cache" if cache else "") + ("_pdl" if pdl else "")] = counts(c.asm["ptx"])
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def builds():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sm90_builds_wait_exactly_when_pdl_is_on(builds):
    pdl = [name for name in builds if name.endswith("_pdl")]
    assert len(pdl) >= 10
    for name, c in builds.items():
        on = name.endswith("_pdl")
        assert c["griddepcontrol.wait"] == int(on), name
        assert c["griddepcontrol.launch_dependents"] == int(on), name
        if on:
            # No load, store or atomic before the wait; the GEMMs prefetch their weight before it.
            assert 0 < c["wait_at"] < c["first_access"], (name, c)
            if not name.startswith(("reduce", "act_quant", "rmsnorm_quant", "qk_rope")):
                assert 0 < c["prefetch_at"] < c["wait_at"], (name, c)
        else:
            assert c["prefetch.global.L2"] == 0, name


def test_sm90_builds_keep_their_instructions(builds):
    """PDL adds the wait and the prefetch and nothing else: the matrix instructions stay."""
    for name, c in builds.items():
        base = builds.get(name[:-4]) if name.endswith("_pdl") else None
        if base is not None:
            assert c["wgmma"] == base["wgmma"], name
    assert builds["gemm_i8_swap_pdl"]["wgmma"] > 0 and builds["int4p_stk_pdl"]["wgmma"] > 0


def test_sm90_split_sum_in_the_kernel(builds):
    """A decode split summed in the kernel counts its programs in with atomics (after the wait
    under PDL, checked above); the split that a reduction kernel sums has none."""
    assert builds["gemm_split_fixup"]["atom."] >= 2 and builds["gemm_split_fixup_pdl"]["atom."] >= 2
    assert builds["gemm_split"]["atom."] == 0 and builds["gemm_split_pdl"]["atom."] == 0
    assert builds["gemm_split_fixup"]["wgmma"] > 0


def test_sm90_qk_rope_build_rounds_where_torch_does(builds):
    """The q/k norm + rotary kernel's sm_90 build takes the norm's mean and 1 / sqrt with
    round-to-nearest divisions, and rotates with uncontracted fp32 products and sums (no bf16
    fma, which would round once where torch rounds three times)."""
    for name in ("qk_rope", "qk_rope_cache", "qk_rope_cache_pdl"):
        c = builds[name]
        assert c["div.rn.f32"] >= 2 and c["mul.rn.f32"] >= 4 and c["fma.rn.bf16"] == 0, (name, c)
