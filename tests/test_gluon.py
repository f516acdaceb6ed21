"""The sm_90 Gluon prefill kernel (kernels/gluon/): selection, explain, an sm_90 build on the CPU,
the launcher's TMA conditions, and (on a GPU) correctness against the reference.

CPU: which implementation a plan chooses and why (every reason), the `impl` line of explain,
the kernel compiled for sm_90 with Triton's own toolchain (wgmma, TMA, mbarriers, setmaxnreg in
its PTX and SASS), and the launcher's descriptors and fallbacks against a stand-in kernel.
GPU (`-m gpu`, sm_90 only): odd shapes (TMA bounds do the masking), bias, out=, output dtypes,
the per-call fallback to the Triton kernel, determinism and CUDA-graph capture.
"""

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import tileq
from tileq import api
from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.errors import UnsupportedError
from tileq import settings
from tileq.dispatch import gluon as select
from tileq.dispatch.gluon import gluon_config
from tileq.kernels.gluon.config import GluonConfig, smem_bytes
from tileq.problem import ScaleKind, ScaleLayout
from tileq.testing import KernelRecorder, check_close, make_args

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs Triton kernels on CPU tensors (the interpreter)")


def _spec(family="rowcol_fp8xfp8_rcr_prefill", m=4096, n=5120, k=5120, **kw):
    return replace(family_spec(parse_family(family), m, n, k), **kw)


def _impl(spec, pipeline="prefill", arch="sm_90", interpreted=False, env="1"):
    return select.implementation(spec, pipeline, arch, interpreted, settings.parse_gluon(env))


# The rules below the Triton-version gate, as on a Triton the Gluon kernels were tested with
# (conftest.tested_triton); test_gate_on_the_installed_triton checks the gate itself.
pytestmark = pytest.mark.usefixtures("tested_triton")


# ---- selection: every reason ---------------------------------------------------------------


SERVED = ["rowcol_fp8xfp8_rcr_prefill", "tensor_fp8xfp8_rcr_prefill", "rowcol_i8xi8_rcr_prefill",
          "tensor_i8xi8_rcr_prefill", "abquant_fp8xfp8_rcr_prefill", "aquant_fp8xfp8_rcr_prefill",
          "aquant_fp8xfp8_rcr_preshufflequant", "rowcol_bf8xbf8_rcr_prefill", "rowcol_fp8xbf8_rcr_prefill",
          "abquant_bf8xbf8_rcr_prefill"]


def test_gluon_chosen_when_switched_on():
    for fam in SERVED:
        impl = _impl(_spec(fam), parse_family(fam).pipeline)
        assert impl.name == "gluon"
        assert "switched on by TILEQ_GLUON=1" in impl.reason
        assert "not 16-byte aligned runs the Triton kernel" in impl.reason
    assert _impl(_spec(m=65)).name == "gluon"
    assert _impl(_spec(has_bias=True, out_dtype=torch.float32)).name == "gluon"
    assert _impl(_spec("bquant_fp8xfp8_rcr_prefill", group_n=128)).name == "gluon"  # 128-wide blocks
    # fast accumulation and acc_in, alone and together, on every scheme and pair served
    for fam in SERVED:
        for kw in (dict(fast_accum=True), dict(has_acc=True), dict(fast_accum=True, has_acc=True)):
            assert select.gluon_serves(_spec(fam, **kw), parse_family(fam).pipeline, 64) is None
            assert _impl(_spec(fam, **kw), parse_family(fam).pipeline).name == "gluon"


@pytest.mark.parametrize("family,fast,want", [
    ("rowcol_fp8xfp8_rcr_prefill", True, "fast"), ("tensor_fp8xfp8_rcr_prefill", True, "fast"),
    ("rowcol_fp8xbf8_rcr_prefill", True, "fast"), ("rowcol_fp8xfp8_rcr_prefill", False, "promoted"),
    # group scales are applied per K group whatever fast_accum says (the Triton kernel and the
    # reference do the same): the precise kernel
    ("abquant_fp8xfp8_rcr_prefill", True, "promoted"), ("aquant_fp8xfp8_rcr_prefill", True, "promoted"),
    ("rowcol_i8xi8_rcr_prefill", False, "int32"),
])
def test_accumulation_mode(family, fast, want):
    from tileq.kernels.gluon.config import accumulation, mma_accumulates

    spec = _spec(family, fast_accum=fast)
    assert accumulation(spec) == want
    assert mma_accumulates(spec) == (want != "promoted")


@pytest.mark.parametrize("spec_kw,pipeline,arch,interpreted,env,reason", [
    ({}, "prefill", "sm_90", True, "1", "the Triton interpreter runs the portable kernel"),
    ({}, "prefill", "sm_89", False, "1", "Gluon kernels are sm_90 only, this is sm_89"),
    ({}, "prefill", "sm_100", False, "1", "Gluon kernels are sm_90 only, this is sm_100"),
    (dict(m=64), "decode", "sm_90", False, "1", "prefill only (M > 64): the decode pipeline"),
    (dict(m=64), "prefill", "sm_90", False, "1", "prefill only (M > 64): the prefill pipeline"),
    (dict(m=4096), "decode", "sm_90", False, "1", "prefill only (M > 64): the decode pipeline"),
    (dict(family="rowcol_bf8xbf8_rcr_prefill"), "prefill", "sm_90", False, None,
     "the Gluon sm_90 kernel serves this problem but is off by default for bf8xbf8: TILEQ_GLUON=1 opts in"),
    (dict(family="rowcol_fp8xbf8_rcr_prefill"), "prefill", "sm_90", False, None, "off by default for fp8xbf8"),
    (dict(family="rowcol_bf16xi8_rcr_prefill"), "prefill", "sm_90", False, "1",
     "8-bit rcr prefill only (fp8 e4m3/e5m2 pairs or int8 x int8; A row-major, B K-major as the 8-bit "
     "wgmma reads them), this is bf16xi8 rcr"),
    (dict(family="rowcol_bf16xi8_rcr_prefill"), "prefill", "sm_90", False, "1", "this is bf16xi8 rcr"),
    (dict(family="bquant_fp8xi4_rcr_prefill"), "prefill", "sm_90", False, "1", "this is fp8xi4 rcr"),
    (dict(family="rowcol_fp8xfp8_rrr_prefill"), "prefill", "sm_90", False, "1", "this is fp8xfp8 rrr"),
    (dict(family="rowcol_i8xi8_ccr_prefill"), "prefill", "sm_90", False, "1", "this is i8xi8 ccr"),
    (dict(family="abquant_i8xi8_rcr_prefill"), "prefill", "sm_90", False, "1",
     "int8 x int8: tensor and rowcol schemes only, this is abquant"),
    (dict(family="abquant_fp8xfp8_rcr_prefill", group_k=64), "prefill", "sm_90", False, "1",
     "group_k = 128 only (one K tile per group), this is group_k=64"),
    (dict(family="bquant_fp8xfp8_rcr_prefill", group_n=64), "prefill", "sm_90", False, "1",
     "b_scale groups of one column or of 128 (128 x 128 weight blocks) only, this is group_n=64"),
    # served, but off by default: not faster than the portable kernel on an H200 (unswapped: A
    # groups too)
    (dict(family="abquant_fp8xfp8_rcr_prefill", group_n=1), "prefill", "sm_90", False, None,
     "the Gluon sm_90 kernel serves this problem but is off by default for b_scale groups of one column "
     "with a_scale groups (correct on an H200, no faster than the portable kernel there: 0.93-1.01x): "
     "TILEQ_GLUON=1 opts in"),
    (dict(k=0), "prefill", "sm_90", False, "1", "K = 0"),
    (dict(family="rowcol_i8xi8_rcr_prefill", m=127), "prefill", "sm_90", False, None,
     "the Gluon sm_90 kernel serves this problem but runs int8 by default from M = 128 only"),
    ({}, "prefill", "sm_90", False, "0", "TILEQ_GLUON=0 switches the Gluon kernel off"),
])
def test_triton_chosen_and_why(spec_kw, pipeline, arch, interpreted, env, reason):
    impl = _impl(_spec(**spec_kw), pipeline, arch, interpreted, env)
    assert impl.name == "triton"
    assert reason in impl.reason


def test_one_column_b_groups_run_swapped_by_default():
    """bquant with one-column b_scale groups (W4A8's int4 values with group scales): the Gluon
    kernel by default, swapped."""
    from tileq.device import for_arch
    from tileq.dispatch.plan import _gemm_cached

    spec = _spec("bquant_fp8xfp8_rcr_prefill", m=1024, group_n=1)
    assert _impl(spec, env=None).name == "gluon"
    plan = _gemm_cached(spec, "triton", False, for_arch("sm_90"), None, None, (), False)
    assert plan.route.impl == "gluon" and plan.route.gluon.swap_ab and "swapped" in plan.route.gluon_reason


def test_untested_triton_version(monkeypatch):
    monkeypatch.setattr(select, "triton_version", lambda: "3.7.0")
    impl = _impl(_spec())
    assert impl == select.Implementation(
        "triton", "Gluon kernels are tested with Triton 3.6.0 only, this is 3.7.0")


def test_gate_on_the_installed_triton(monkeypatch):
    """The installed Triton, unpinned: a tested version lets the rules choose Gluon; any other
    plans the portable kernel for every call, the plan naming the version it refused."""
    from tileq.device import triton_version

    monkeypatch.setattr(select, "triton_version", triton_version)
    installed = triton_version()
    impl, plan = _impl(_spec(), env=None), _plan(monkeypatch, "1")
    if installed in select.GLUON_TRITON_VERSIONS:
        assert impl.name == "gluon" and plan.route.impl == "gluon"
        return
    why = f"Gluon kernels are tested with Triton {', '.join(select.GLUON_TRITON_VERSIONS)} only, this is {installed}"
    assert impl == select.Implementation("triton", why)
    assert plan.route.impl == "triton" and plan.route.gluon is None and f"impl      : triton ({why})" in plan.describe()


def test_switch_values():
    assert settings.parse_gluon(None) is None
    assert settings.parse_gluon(b"1") is True and settings.parse_gluon(" 0 ") is False
    with pytest.raises(UnsupportedError, match=r"TILEQ_GLUON: expected 0 or 1, got 'yes'"):
        settings.parse_gluon("yes")
    # On by default for the pairs whose GPU tests passed and that were benchmarked on an H200.
    assert _impl(_spec(), env=None).name == "gluon"
    assert _impl(_spec("rowcol_i8xi8_rcr_prefill"), env=None).name == "gluon"  # M = 4096
    assert _impl(_spec("rowcol_i8xi8_rcr_prefill", m=127), env=None).name == "triton"
    assert _impl(_spec("rowcol_i8xi8_rcr_prefill", m=127), env="1").name == "gluon"
    assert _impl(_spec(), env="0").name == "triton"
    # fast_accum and acc_in: on by default since their H200 tests passed (select.py); group
    # scales run the precise kernel whatever fast_accum says.
    assert _impl(_spec(fast_accum=True), env=None).name == "gluon"
    assert _impl(_spec(has_acc=True), env=None).name == "gluon"
    assert _impl(_spec("rowcol_i8xi8_rcr_prefill", has_acc=True), env=None).name == "gluon"
    assert _impl(_spec("abquant_fp8xfp8_rcr_prefill", fast_accum=True), env=None).name == "gluon"
    assert _impl(_spec(fast_accum=True, has_acc=True), env="0").name == "triton"


def test_gluon_config():
    # (no group scales: the epilogue's vectors loaded at the start of each tile, preload_epilogue)
    assert gluon_config(_spec(), 132) == GluonConfig(block_n=128, stages=6, epi_preload=True)
    assert gluon_config(_spec(out_dtype=torch.float32), 132).stages == 5
    # 1 x 40 tiles of 128 x 128 fill under half of 132 SMs: 128 x 64 tiles instead.
    assert gluon_config(_spec(m=128), 132) == GluonConfig(block_n=64, stages=8, epi_preload=True)
    for m in (65, 128, 256, 512, 1024, 4096):  # a split config is always a legal one
        cfg = gluon_config(_spec(m=m, n=4096, k=4096), 132)
        assert cfg.split_k == 1 or (cfg.block_n <= 128 and not cfg.overlap)
    for family in ("rowcol_fp8xfp8_rcr_prefill", "abquant_fp8xfp8_rcr_prefill"):
        for out in (torch.bfloat16, torch.float16, torch.float32):
            for m in (65, 128, 1024, 4096):
                cfg = gluon_config(_spec(family, m=m, out_dtype=out), 132)
                assert smem_bytes(cfg, out) <= 232448 - 2048


def test_choose_tiles_says_why():
    from tileq.dispatch.gluon import choose_tiles

    cfg, why = choose_tiles(_spec("abquant_fp8xfp8_rcr_prefill", m=4096, n=5120), 132)
    assert cfg.block_n == 256 and why == ("128 x 256 overlapped tiles: 640 tiles, 5 waves on 132 SMs: 333 K "
                                          "steps of a 128 x 128 tile, against 128 400, 64 480")
    assert choose_tiles(_spec(m=128, n=5120), 132)[1].startswith("128 x 64 tiles: 80 tiles, 1 wave on")
    assert "wgmma during the epilogue" in cfg.describe() and "2 sub-tiles of 128 columns" in cfg.describe()
    cfg, why = choose_tiles(_spec(m=256, n=17408), 132)
    assert cfg.split_k == 10 and why.startswith(
        "128 x 128 tiles: 272 tiles, 2 full waves, the last 8 tiles split 10 ways over K on 132 SMs: 96 K steps")
    assert "split 10 ways over K" in cfg.describe()
    assert "every tile split 4 ways" in choose_tiles(_spec(m=128, n=4096), 132)[1]
    # fast_accum keeps 128 x 128 (int8's main loop, where wide tiles measured slower); acc_in
    # never takes 128 x 256 tiles (they spill), the group-scaled case included.
    cfg, why = choose_tiles(_spec(m=4096, fast_accum=True), 132)
    assert cfg == GluonConfig(stages=6, epi_preload=True) and "256" not in why
    assert "fp8's reduced precision" in cfg.describe("fast") and "promotion" not in cfg.describe("fast")
    assert "int32 in the wgmma accumulator" in cfg.describe("int32")
    cfg, why = choose_tiles(_spec("abquant_fp8xfp8_rcr_prefill", m=4096, n=5120, has_acc=True), 132)
    assert cfg == GluonConfig(stages=6) and why.endswith("with acc_in, 128 x 256 tiles spill registers (acc_in_config)")
    assert choose_tiles(_spec(m=128, n=4096, has_acc=True), 132)[0].block_n <= 128


def test_launch_config_narrows_masked_stores_and_acc_in():
    from tileq.dispatch.gluon import choose_tiles
    from tileq.kernels.gluon.config import kernel_spec, launch_config

    wide = GluonConfig(block_n=256, stages=4, overlap=True)
    spec = _spec("abquant_fp8xfp8_rcr_prefill")
    assert launch_config(wide, spec, True) == wide
    assert launch_config(wide, spec, False) == GluonConfig(stages=6)  # masked stores: 128 x 128
    acc = replace(spec, has_acc=True)
    assert launch_config(wide, acc, True) == GluonConfig(stages=6)
    assert launch_config(GluonConfig(overlap=True, stages=3), acc, True) == GluonConfig(stages=3)  # forced stages kept
    assert launch_config(GluonConfig(block_n=64, stages=8), acc, False) == GluonConfig(block_n=64, stages=8)
    assert launch_config(GluonConfig(split_k=2), spec, True) == GluonConfig(split_k=2)  # TMA stores kept
    # Preloaded epilogue vectors with TMA stores only (beside masked stores' addresses they spill).
    assert launch_config(GluonConfig(epi_preload=True), spec, True).epi_preload
    assert not launch_config(GluonConfig(epi_preload=True), spec, False).epi_preload
    assert GluonConfig(epi_preload=True).tag == "m128n128k128_s6_ep_ws2x64"
    # b_scale groups of one column, unswapped: 128 x 64 tiles whatever was forced (128 x 128
    # spilled). The planner swaps bquant's (the groups on the tile's rows): the tiles of the
    # problem swapped, not narrowed; abquant's (A groups too) stay unswapped.
    cols = _spec("bquant_fp8xfp8_rcr_prefill", group_n=1)
    assert launch_config(wide, cols, True) == GluonConfig(block_n=64, stages=8)
    assert launch_config(GluonConfig(split_k=3), cols, False) == GluonConfig(block_n=64, stages=8, split_k=3)
    swapped_wide = GluonConfig(block_n=256, stages=4, overlap=True, swap_ab=True)
    assert launch_config(swapped_wide, cols, True) == swapped_wide
    assert swapped_wide.tag == "m128n256k128_s4_ov_swap_ws2x64" and "written transposed" in swapped_wide.describe()
    for m in (128, 1024, 8192):
        cfg, why = choose_tiles(replace(cols, m=m), 132)
        want, want_why = choose_tiles(kernel_spec(replace(cols, m=m), GluonConfig(swap_ab=True)), 132)
        assert cfg == replace(want, swap_ab=True) and why == f"swapped (b_scale groups of one column on the tile's rows): {want_why}"
    wide_swapped, _ = choose_tiles(replace(cols, m=8192, n=5120, k=5120), 132)
    assert wide_swapped.block_n == 256 and wide_swapped.swap_ab  # group scales per row: the wide tile
    both = _spec("abquant_fp8xfp8_rcr_prefill", group_n=1)
    cfg, why = choose_tiles(replace(both, m=1024), 132)
    assert not cfg.swap_ab and cfg.block_n == 64 and "b_scale groups of one column" in why
    # Ring slots capped by what shared memory holds beside this output's staging buffers.
    fp32 = replace(_spec(), out_dtype=torch.float32)
    assert launch_config(GluonConfig(stages=6), fp32, True) == GluonConfig(stages=5)
    assert launch_config(GluonConfig(block_n=256, stages=4), fp32, True).stages == 3


@pytest.mark.parametrize("m,n,want", [
    # (M, N, {family: (block_n, split_k)}); 132 SMs, K = 5120 (40 K steps)
    (4096, 5120, {"abquant": (256, 1), "rowcol": (128, 1)}),  # 10 narrow waves, 5 wide (= 8.3 narrow)
    (2048, 5120, {"abquant": (128, 1), "rowcol": (128, 1)}),  # 5 narrow waves, 3 wide (= 5 narrow): a tie
    (1024, 17408, {"abquant": (256, 1), "rowcol": (128, 4)}),  # 8 waves + 32 tiles; 5 wide waves
    (1024, 5120, {"abquant": (128, 2), "rowcol": (128, 2)}),  # 2 waves + 56 tiles split 2 ways
    (256, 17408, {"abquant": (128, 10), "rowcol": (128, 10)}),  # 2 waves + 8 tiles split 10 ways
    (256, 14336, {"abquant": (256, 1), "rowcol": (128, 1)}),  # 224 tiles: 2 waves; 112 wide: 1
    (128, 5120, {"abquant": (64, 1), "rowcol": (64, 1)}),  # 40 tiles: 80 of 128 x 64 in one wave
])
def test_wave_model_choices(m, n, want):
    """The wave model's choices between 128 x 128 tiles (with the last wave split over K or
    not), 128 x 64 and (group-scaled fp8) 128 x 256 overlapped tiles."""
    for short, (block_n, split) in want.items():
        cfg = gluon_config(_spec(f"{short}_fp8xfp8_rcr_prefill", m=m, n=n), 132)
        assert (cfg.block_n, cfg.split_k, cfg.overlap) == (block_n, split, block_n == 256)
    int8 = gluon_config(_spec("rowcol_i8xi8_rcr_prefill", m=m, n=n), 132)
    assert (int8.block_n, int8.split_k) == want["rowcol"]  # int8: no wide tiles, as rowcol


# ---- the plan and explain ------------------------------------------------------------------


def _plan(monkeypatch, env, spec=None, arch="sm_90"):
    from tileq.dispatch import plan

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a GPU (planning reads the switch)
    if env is None:
        monkeypatch.delenv("TILEQ_GLUON", raising=False)
    else:
        monkeypatch.setenv("TILEQ_GLUON", env)
    return plan.make_plan(spec or _spec(has_bias=True), torch.device("cuda"), backend="triton", arch=arch)


@pytest.mark.filterwarnings("ignore:tileq. ignoring tuned table")  # the sm_90 table, planning sm_89
def test_plan_records_the_implementation(monkeypatch):
    p = _plan(monkeypatch, "1")
    assert p.route.impl == "gluon" and p.route.gluon == GluonConfig(block_n=128, stages=6, epi_preload=True)
    text = p.describe()
    assert re.search(r"^impl      : gluon \(sm_90 warp-specialized kernel", text, re.M)
    assert "gluon     : rowcol_fp8xfp8_rcr_prefill__gluon_m128n128k128_s6_ep_ws2x64_sm90" in text
    assert "(the Triton fallback)" in text
    p = _plan(monkeypatch, None)
    assert p.route.impl == "gluon" and "on by default" in p.describe()
    p = _plan(monkeypatch, "0")
    assert p.route.impl == "triton" and p.route.gluon is None
    assert "impl      : triton (TILEQ_GLUON=0 switches the Gluon kernel off)" in p.describe()
    p = _plan(monkeypatch, "1", _spec(family="rowcol_bf16xi8_rcr_prefill"))
    assert "impl      : triton (8-bit rcr prefill only" in p.describe()
    p = _plan(monkeypatch, None, _spec(family="rowcol_bf8xbf8_rcr_prefill"))  # served, opt-in
    assert p.route.impl == "triton" and "off by default for bf8xbf8" in p.describe()
    assert _plan(monkeypatch, "1", _spec(family="rowcol_bf8xbf8_rcr_prefill")).route.impl == "gluon"
    p = _plan(monkeypatch, "1", _spec(family="aquant_fp8xfp8_rcr_preshufflequant"))
    assert p.route.pipeline == "preshufflequant" and p.route.impl == "gluon"
    p = _plan(monkeypatch, "1", arch="sm_89")
    assert "impl      : triton (Gluon kernels are sm_90 only, this is sm_89)" in p.describe()


@pytest.mark.filterwarnings("ignore:tileq. ignoring tuned table")
def test_plan_for_fast_accum_and_acc_in(monkeypatch):
    """fast_accum and acc_in plans name the Gluon kernel (switched on): the fast-accumulation
    instance has its own name ('_fa'), acc_in calls take 128 x 128 tiles; both on by default."""
    p = _plan(monkeypatch, "1", _spec(fast_accum=True, has_bias=True))
    text = p.describe()
    assert re.search(r"^impl      : gluon \(sm_90 warp-specialized kernel", text, re.M)
    assert "gluon     : rowcol_fp8xfp8_rcr_prefill__gluon_m128n128k128_s6_ep_ws2x64_fa_sm90" in text
    assert "fast_accum: fp32 in the wgmma accumulator over all of K" in text
    assert "mma(fp8xfp8->f32) fast-accum" in text
    p = _plan(monkeypatch, "1", _spec("abquant_fp8xfp8_rcr_prefill", has_acc=True, fast_accum=True))
    text = p.describe()
    assert p.route.impl == "gluon" and p.route.gluon == GluonConfig(stages=6)
    assert "gluon     : abquant_fp8xfp8_rcr_prefill__gluon_m128n128k128_s6_ws2x64_sm90" in text  # promoted
    assert "+ acc_in(f32)" in text and "with acc_in, 128 x 256 tiles spill" in text
    p = _plan(monkeypatch, "1", _spec("rowcol_i8xi8_rcr_prefill", has_acc=True))
    assert p.route.impl == "gluon" and "+ acc_in(i32) -> cast f32" in p.describe()
    p = _plan(monkeypatch, None, _spec(fast_accum=True))
    assert p.route.impl == "gluon" and "on by default" in p.describe()
    p = _plan(monkeypatch, None, _spec(has_acc=True))
    assert p.route.impl == "gluon" and "on by default" in p.describe()


def test_forced_config_runs_the_triton_kernel(monkeypatch):
    from tileq.kernels.config import TileConfig
    from tileq.dispatch.plan import with_config

    p = with_config(_plan(monkeypatch, "1"), TileConfig(128, 128, 128, 8, 3))
    assert p.route.impl == "triton" and p.route.gluon is None
    assert "impl      : triton (a forced config of the portable kernel)" in p.describe()


@needs_interpreter
def test_interpreter_plans_never_choose_gluon(monkeypatch):
    from tileq.dispatch.plan import make_plan

    monkeypatch.setenv("TILEQ_GLUON", "1")
    p = make_plan(_spec(), torch.device("cpu"), backend="triton")
    assert p.interpreted and p.route.impl == "triton"
    assert "impl      : triton (the Triton interpreter runs the portable kernel" in p.describe()


def test_explain_cli_prints_the_impl_line(monkeypatch):
    import contextlib
    import io

    from tileq.cli import main

    # (the command's entry point in this process; planning reads the switches on every call)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cmd = ["explain", "--scheme", "rowcol", "--a", "fp8", "--b", "fp8",
           "--m", "4096", "--n", "5120", "--k", "5120", "--arch", "sm_90"]
    for value, extra, want in (
            ("1", [], "impl      : gluon (sm_90 warp-specialized kernel"),
            ("0", [], "impl      : triton (TILEQ_GLUON=0 switches the Gluon kernel off)"),
            ("1", ["--fast-accum", "--acc"], "__gluon_m128n128k128_s6_ep_ws2x64_fa_sm90"),
            (None, ["--fast-accum"], "impl      : gluon (sm_90 warp-specialized kernel (TMA producer warp + 2 "
                                     "consumer warpgroups); on by default")):
        if value:
            monkeypatch.setenv("TILEQ_GLUON", value)
        else:
            monkeypatch.delenv("TILEQ_GLUON", raising=False)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(cmd + extra)
        assert not rc, err.getvalue()[-2000:]
        assert want in out.getvalue(), out.getvalue()


# ---- sm_90 machine code, compiled on the CPU -----------------------------------------------


# Compiled in a fresh process without TRITON_INTERPRET: interpreted kernels run earlier in a test
# worker can leave Triton's language module patched, which broke in-process Gluon compiles.
_BUILD = r"""
import json, sys
from dataclasses import replace
import torch
from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.dispatch.gluon import gluon_config
from tileq.kernels.gluon.config import instance_tag, launch_config, max_stages
from tileq.kernels.gluon.launch import compile_sm90, constexprs
out_dir, variants = sys.argv[1], json.loads(sys.argv[2])
res = []
for i, (family, out, bias, tma, m, split, kw) in enumerate(variants):
    spec_kw = {k: v for k, v in kw.items() if k in ("fast_accum", "has_acc", "group_n")}
    cfg_kw = {k: v for k, v in kw.items() if k not in spec_kw}  # a forced tile (bench --variants)
    spec = replace(family_spec(parse_family(family), m, 5120, 5120, out_dtype=getattr(torch, out)),
                   has_bias=bias, **spec_kw)
    cfg = gluon_config(spec, 132)
    if split > 1:  # (split tiles: 128 columns at most, no overlap)
        cfg = replace(cfg, block_n=min(cfg.block_n, 128), overlap=False, split_k=split)
    cfg = replace(cfg, **cfg_kw)
    if "block_n" in cfg_kw:
        cfg = replace(cfg, stages=max_stages(cfg, spec.out_dtype))
    cfg = launch_config(cfg, spec, tma)  # what GluonLaunch runs
    k = compile_sm90(spec, cfg, tma)
    base = f"{out_dir}/k{i}"
    open(base + ".ptx", "w").write(k.asm["ptx"])
    open(base + ".cubin", "wb").write(k.asm["cubin"])
    consts = constexprs(spec, cfg, tma)
    res.append(dict(base=base, num_warps=k.metadata.num_warps, shared=k.metadata.shared,
                    block_n=cfg.block_n, sub_n=cfg.sub_n, sub_tiles=cfg.sub_tiles,
                    overlap=consts["OVERLAP"], mma_acc=consts["MMA_ACC"], has_acc=consts["HAS_ACC"],
                    scale_unroll=consts["SCALE_UNROLL"],
                    tag=instance_tag(spec, cfg)))
print(json.dumps(res))
"""

FAST = dict(fast_accum=True)
ACC = dict(has_acc=True)
BUILDS = [  # family, output dtype, bias, TMA store, M, split-K, spec / forced config fields
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, True, 4096, 1, {}),
    ("tensor_fp8xfp8_rcr_prefill", "float32", False, False, 4096, 1, {}),
    ("tensor_fp8xfp8_rcr_prefill", "float16", False, True, 128, 1, {}),  # BN = 64, 8 stages
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", False, True, 4096, 1, {}),  # 128 x 256, overlapped
    ("abquant_fp8xfp8_rcr_prefill", "float32", True, True, 4096, 1, {}),  # fp32 out: 128 x 128
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", True, False, 4096, 1, {}),  # masked stores: 128 x 128
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", False, True, 512, 1, {}),  # 128 x 128 (waves)
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", True, False, 256, 3, {}),  # split-K: fp32 partials
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, True, 256, 4, {}),  # whole tiles by TMA, split ones
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", False, True, 512, 1, dict(scale_unroll=False)),
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, True, 4096, 1, dict(epi_preload=True)),
    ("rowcol_fp8xfp8_rcr_prefill", "float32", True, True, 4096, 1, dict(epi_preload=True)),
    ("rowcol_i8xi8_rcr_prefill", "bfloat16", True, False, 4096, 1, dict(epi_preload=True)),  # masked: not preloaded
    # b_scale groups of one column: bquant swapped (the groups on the tile's rows, each tile
    # stored transposed; with a bias 128 x 128), abquant 128 x 64 tiles (a [64] column-scale
    # vector per parity), and bquant unswapped when forced
    ("bquant_fp8xfp8_rcr_prefill", "bfloat16", True, True, 4096, 1, dict(group_n=1)),
    ("bquant_fp8xfp8_rcr_prefill", "bfloat16", False, True, 4096, 1, dict(group_n=1)),  # 128 x 256 ov
    ("bquant_fp8xfp8_rcr_prefill", "bfloat16", True, False, 4096, 1, dict(group_n=1)),
    ("bquant_fp8xfp8_rcr_prefill", "float32", True, False, 512, 3, dict(group_n=1, has_acc=True)),
    ("bquant_fp8xfp8_rcr_prefill", "bfloat16", False, True, 4096, 1, dict(group_n=1, swap_ab=False)),
    ("abquant_fp8xfp8_rcr_prefill", "float32", True, False, 4096, 1, dict(group_n=1)),
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", True, True, 256, 3, dict(group_n=1)),
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", False, True, 4096, 1, dict(group_n=1, scale_unroll=False)),
    ("aquant_fp8xfp8_rcr_preshufflequant", "bfloat16", True, True, 4096, 1, {}),
    ("rowcol_i8xi8_rcr_prefill", "bfloat16", True, True, 4096, 1, {}),
    ("rowcol_i8xi8_rcr_prefill", "bfloat16", True, False, 256, 2, {}),
    ("rowcol_fp8xbf8_rcr_prefill", "bfloat16", True, True, 4096, 1, {}),  # e4m3 x e5m2 (opt-in)
    ("abquant_bf8xbf8_rcr_prefill", "bfloat16", False, True, 4096, 1, {}),
    # fast_accum: the wgmma accumulates over all of K (int8's pipelined main loop), every tile
    # the plan can give it, the masked and split-K epilogues, and 128 x 256 (bench --variants)
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, True, 4096, 1, FAST),
    ("rowcol_fp8xfp8_rcr_prefill", "float32", True, True, 4096, 1, FAST),
    ("tensor_fp8xfp8_rcr_prefill", "float16", False, True, 128, 1, FAST),  # 128 x 64
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, False, 4096, 1, FAST),
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, False, 256, 3, FAST),
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, True, 4096, 1, dict(FAST, block_n=256)),
    ("rowcol_fp8xbf8_rcr_prefill", "bfloat16", True, True, 4096, 1, FAST),
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", False, True, 4096, 1, FAST),  # group scales: promoted
    # acc_in: loaded into the accumulator before the first K tile, or (fast_accum) added in the
    # epilogue; 128 x 128 or 128 x 64 tiles without overlap (acc_in_config)
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, True, 4096, 1, ACC),
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, False, 4096, 1, ACC),
    ("tensor_fp8xfp8_rcr_prefill", "float16", True, True, 128, 1, ACC),  # 128 x 64
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", True, True, 4096, 1, ACC),  # 128 x 128, not 256
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", True, False, 4096, 1, ACC),
    ("abquant_fp8xfp8_rcr_prefill", "float32", True, True, 4096, 1, ACC),
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", True, False, 256, 3, ACC),
    ("abquant_fp8xfp8_rcr_prefill", "bfloat16", True, True, 4096, 1, dict(ACC, block_n=256, overlap=True)),
    ("rowcol_i8xi8_rcr_prefill", "bfloat16", True, True, 4096, 1, ACC),
    ("rowcol_i8xi8_rcr_prefill", "bfloat16", True, False, 4096, 1, ACC),
    ("rowcol_i8xi8_rcr_prefill", "bfloat16", True, False, 256, 2, ACC),
    ("rowcol_i8xi8_rcr_prefill", "bfloat16", True, True, 4096, 1, dict(ACC, block_n=256)),
    ("rowcol_fp8xfp8_rcr_prefill", "float32", True, True, 4096, 1, dict(FAST, **ACC)),
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, False, 4096, 1, dict(FAST, **ACC)),
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, False, 256, 3, dict(FAST, **ACC)),
    ("rowcol_fp8xfp8_rcr_prefill", "bfloat16", True, True, 4096, 1, dict(FAST, block_n=256, **ACC)),
]


def _build_id(b):
    extra = "".join(f"-{k}" if v is True else f"-{k}{v}" for k, v in b[6].items())
    return f"{b[0]}-{b[1]}-{b[4]}-sk{b[5]}{'' if b[3] else '-masked'}{extra}"


@pytest.fixture(scope="module")
def sm90_builds(tmp_path_factory):
    import json

    out = tmp_path_factory.mktemp("gluon_sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, "-c", _BUILD, str(out), json.dumps(BUILDS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(BUILDS)), ids=[_build_id(b) for b in BUILDS])
def test_sm90_build_uses_wgmma_tma_mbarriers_and_setmaxnreg(index, sm90_builds):
    family, out, bias, tma_store, m, split, kw = BUILDS[index]
    spec_kw = {k: v for k, v in kw.items() if k in ("fast_accum", "has_acc", "group_n")}
    spec = _spec(family, m=m, out_dtype=getattr(torch, out), has_bias=bias, **spec_kw)
    assert select.gluon_serves(spec, parse_family(family).pipeline, 64) is None
    built = sm90_builds[index]
    ptx = Path(built["base"] + ".ptx").read_text()
    cubin = built["base"] + ".cubin"
    # Each consumer's K tile: four m64nSUB_Nk32 wgmmas per sub-tile (e4m3 -> f32, or s8 -> s32);
    # the overlapped main loop has a second copy of the first sub-tile's chain (its prologue);
    # with group scales the loop is unrolled by two (two register sets of scales).
    f8 = {"fp8": "e4m3", "bf8": "e5m2"}
    kind = (r"s32\.s8\.s8" if spec.integer_mainloop
            else rf"f32\.{f8[spec.a_type.value]}\.{f8[spec.b_type.value]}")
    n = built["sub_n"]
    unroll = 2 if built["scale_unroll"] else 1
    chains = unroll * built["sub_tiles"] + (1 if built["overlap"] else 0)
    wgmmas = 2 * 4 * chains
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.{kind}", ptx)) == wgmmas
    # Accumulating in the wgmma accumulator (int8, fp8 fast_accum), a K tile's chains are issued
    # before the previous K tile's are retired: a wait with one chain per sub-tile outstanding.
    # Promoted, every chain is waited for (its partial sum is added on the CUDA cores).
    mma_acc = spec.integer_mainloop or (spec.fast_accum and not spec.scheme.grouped)
    assert built["mma_acc"] == mma_acc and built["has_acc"] == spec.has_acc
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx))
    assert waits == ({"0", str(built["sub_tiles"])} if mma_acc else {"0"})
    assert built["tag"].endswith("_fa") == (mma_acc and not spec.integer_mainloop)
    if spec.has_acc:  # 128 x 256 and the overlapped loop spill with acc_in: narrowed
        assert built["block_n"] <= 128 and not built["overlap"]
    # TMA loads (Triton 3.8 names the destination shared::cta, 3.6 shared::cluster: one CTA's either way)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::(cluster|cta)\.global\.mbarrier::complete_tx::bytes", ptx)
    assert ("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in ptx) is tma_store  # TMA stores
    assert "mbarrier.arrive.expect_tx" in ptx and "mbarrier.try_wait.parity" in ptx
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)  # the producer warp
    assert re.search(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+232;", ptx)  # the consumers
    sass = subprocess.run([str(BIN / "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                          check=True).stdout
    ops = re.findall(r"\b(QGMMA|IGMMA|UTMALDG|UTMASTG|USETMAXREG|SYNCS\.ARRIVE\.TRANS64[.A-Z0-9]*)", sass)
    mma = "IGMMA" if spec.integer_mainloop else "QGMMA"
    # TMA loads: A and B per K tile (and the overlapped loop's extra ring item).
    assert ops.count(mma) == wgmmas and ops.count("UTMALDG") == (4 if built["overlap"] else 2)
    assert ops.count("UTMASTG") == (2 * built["sub_tiles"] if tma_store else 0)
    assert ops.count("USETMAXREG") >= 4
    assert any(o.startswith("SYNCS.ARRIVE") for o in ops)
    assert built["num_warps"] == 12  # 4 + 4 consumer warps, the producer warp padded to 4
    assert built["shared"] <= 232448
    usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", cubin], capture_output=True,
                           text=True).stdout
    assert "STACK:0" in usage and "LOCAL:0" in usage  # no spills


def test_split_k_config_and_tag():
    from tileq.kernels.gluon.config import split_schedule

    cfg = GluonConfig(block_n=128, stages=6, split_k=3)
    assert cfg.tag == "m128n128k128_s6_sk3_ws2x64"
    with pytest.raises(ValueError, match="block_n <= 128 and no overlap"):
        GluonConfig(block_n=256, stages=4, overlap=True, split_k=2)
    # 272 tiles on 132 SMs: two full waves, the last 8 tiles split.
    assert split_schedule(256, 17408, cfg, 132) == (132, 264, 8)
    # Fewer tiles than SMs: every tile split, one program per item.
    assert split_schedule(256, 5120, cfg, 132) == (132, 0, 80)
    assert split_schedule(128, 1024, cfg, 132) == (24, 0, 8)
    # Whole waves: nothing to split; no split: every tile whole.
    assert split_schedule(512, 8448, cfg, 132) == (132, 264, 0)
    assert split_schedule(256, 17408, GluonConfig(), 132) == (132, 272, 0)


# ---- the launcher, against a stand-in kernel -----------------------------------------------


@pytest.fixture
def gluon_plan_for(monkeypatch):
    """A Gluon plan for CPU tensors (as make_plan gives on an H200) and a stand-in kernel."""
    from tileq.kernels.gluon import launch as glaunch
    from tileq.device import for_arch
    from tileq.dispatch.plan import _gemm_cached
    from tileq.problem import build_problem

    rec = KernelRecorder()
    monkeypatch.setitem(glaunch._gl(), "kernel", rec)

    def make(spec, pad=0, seed=0, out=None):
        args = make_args(spec, seed=seed, pad=pad)
        problem = args.call(build_problem, out=out)
        plan = _gemm_cached(problem.spec, "triton", False, for_arch("sm_90"), None, True, (), False)
        assert plan.route.impl == "gluon"
        return args, problem, plan

    return rec, make



def _with_gluon(plan, cfg):
    """``plan`` running the Gluon kernel with ``cfg`` instead."""
    return replace(plan, route=replace(plan.route, gluon=cfg))

def test_launcher_descriptors_and_constexprs(gluon_plan_for):
    from tileq.kernels.launch import make_launch

    rec, make = gluon_plan_for
    _, problem, plan = make(_spec(m=300, n=577, k=859, has_bias=True), pad=5)  # lda = ldb = 864
    gl_launch = make_launch(problem, plan)
    assert type(gl_launch).__name__ == "GluonLaunch" and gl_launch.usable
    gl_launch(problem.a, problem.b, problem.a_scale, problem.b_scale, problem.bias, None, None)
    (grid, args, kwargs), = rec.calls
    cfg = plan.route.gluon
    assert cfg == GluonConfig(block_n=64, stages=8, epi_preload=True)  # 3 x 5 tiles of 128 x 128 fill few SMs
    assert kwargs["EPI_PRELOAD"] is False  # masked stores (N = 577): the vectors are loaded late
    assert grid == (3 * 10,)
    a_desc, b_desc, c_desc, out, ws = args[:5]
    assert ws is None  # no split tiles, no workspace
    assert (a_desc.shape, a_desc.strides, a_desc.block_shape) == ([300, 859], [864, 1], [128, 128])
    assert (b_desc.shape, b_desc.strides, b_desc.block_shape) == ([577, 859], [864, 1], [64, 128])
    assert a_desc.base.data_ptr() == problem.a.data_ptr() and b_desc.base.data_ptr() == problem.b.data_ptr()
    # N = 577 bf16 rows are 1154 bytes: no TMA store, masked stores.
    assert c_desc is None and kwargs["TMA_STORE"] is False and out.shape == (300, 577)
    assert args[8] is None and not kwargs["HAS_ACC"]  # no acc_in
    assert args[9:] == (300, 577, 859, 577, 0, 1, 0, 0, 1)  # M N K ldc ld_acc, scale strides
    assert kwargs["A_SCALE"] == "vector" and kwargs["B_SCALE"] == "vector" and kwargs["HAS_BIAS"]
    assert kwargs["MMA_ACC"] is False and kwargs["INT_DOT"] is False
    assert (kwargs["num_warps"], kwargs["maxnreg"], kwargs["STAGES"], kwargs["BN"]) == (4, 168, 8, 64)
    assert (kwargs["CONSUMER_REGS"], kwargs["PRODUCER_REGS"]) == (232, 40)
    # An out= with 16-byte aligned rows is written by TMA stores through a [64, BN] descriptor.
    out = torch.empty(300, 584, dtype=torch.bfloat16)[:, :577]
    _, problem, plan = make(_spec(m=300, n=577, k=859), pad=5, out=out)
    make_launch(problem, plan)(problem.a, problem.b, problem.a_scale, problem.b_scale, None, None, out)
    _, args, kwargs = rec.calls[-1]
    assert kwargs["TMA_STORE"] is True and args[3] is out
    assert (args[2].shape, args[2].strides, args[2].block_shape) == ([300, 577], [584, 1], [64, 64])


def test_launcher_swaps_one_column_b_groups(gluon_plan_for):
    """bquant with one-column b_scale groups runs swapped: the weight [N, K] on the kernel's A
    side with b_scale [Gk, N] read per row and group, the activations on its B side with their
    per-row a_scale as the kernel's column vector, M and N exchanged, TRANS_C, C's TMA box
    transposed ([BN, 64] of the row-major [M, N] output)."""
    from tileq.kernels.launch import make_launch

    rec, make = gluon_plan_for
    spec = _spec("bquant_fp8xfp8_rcr_prefill", m=300, n=576, k=1024, group_n=1)
    _, problem, plan = make(spec)
    assert plan.route.gluon.swap_ab and plan.route.gluon.tag.endswith("_swap_ws2x64")
    launch = make_launch(problem, plan)
    launch(problem.a, problem.b, problem.a_scale, problem.b_scale, None, None, None)
    (grid, args, kwargs), = rec.calls
    a_desc, b_desc, c_desc, out = args[:4]
    assert kwargs["TRANS_C"] is True and kwargs["A_SCALE"] == "group" and kwargs["B_SCALE"] == "vector"
    assert a_desc.base.data_ptr() == problem.b.data_ptr() and b_desc.base.data_ptr() == problem.a.data_ptr()
    assert (a_desc.shape, a_desc.block_shape) == ([576, 1024], [128, 128])
    assert (b_desc.shape, b_desc.block_shape) == ([300, 1024], [plan.route.gluon.block_n, 128])
    assert (c_desc.shape, c_desc.block_shape) == ([300, 576], [plan.route.gluon.sub_n, 64]) and out.shape == (300, 576)
    assert args[5] is problem.b_scale and args[6] is problem.a_scale  # the kernel's A scale, B scale
    sb = problem.b_scale  # [Gk, N]: the kernel reads it per row n (stride 1 here) and group g
    assert args[9:] == (576, 300, 1024, 576, 0, sb.stride(1), sb.stride(0), 0, problem.a_scale.stride(0))
    # abquant's A groups stay on the rows: not swapped (128 x 64 tiles)
    _, problem2, plan2 = make(_spec("abquant_fp8xfp8_rcr_prefill", m=300, n=576, k=1024, group_n=1))
    assert not plan2.route.gluon.swap_ab


@needs_interpreter
def test_split_reduce_transposed(gluon_plan_for):
    """A swapped split-K launch: the reduction writes C^T's split tiles transposed into C."""
    from tileq.kernels.gluon.launch import GluonLaunch

    rec, make = gluon_plan_for
    out = torch.zeros(300, 576, dtype=torch.bfloat16)
    _, problem, plan = make(_spec("bquant_fp8xfp8_rcr_prefill", m=300, n=576, k=1024, group_n=1), out=out)
    plan = _with_gluon(plan, GluonConfig(split_k=2, swap_ab=True))

    def fill(grid, args, kwargs):  # block [BM, BN] of C^T: value = row index within the block
        ws = args[4].view(-1, 2, 128, 128)
        ws[:] = torch.arange(128, dtype=torch.float32).view(1, 1, 128, 1) / 64

    rec.on_call = fill
    GluonLaunch(problem, plan, None)(problem.a, problem.b, problem.a_scale, problem.b_scale, None, None, out)
    (grid, args, kwargs), = rec.calls
    assert kwargs["SPLIT_K"] == 2 and kwargs["TRANS_C"] is True and args[9:11] == (576, 300)
    # 5 x 3 tiles of C^T (576 x 300), fewer than the SMs: all split; C[m, n] = 2 * (n % 128) / 64
    want = (2 * (torch.arange(576) % 128).float() / 64).expand(300, 576)
    assert torch.equal(out.float(), want.to(torch.bfloat16).float())


@needs_interpreter
@pytest.mark.parametrize("n,programs,n_split", [
    (577, 45, 15),  # 3 x 5 tiles, fewer than the SMs: every tile split, 45 items
    (5700, 132, 3),  # 3 x 45 tiles: one full wave of 132, the last 3 tiles split
])
def test_launcher_split_k_writes_partials_and_reduces(gluon_plan_for, n, programs, n_split):
    """A split-K config: the kernel gets an fp32 workspace of [BM, BN] blocks, one per split
    item, and the grid of the schedule; the reduction (Triton, interpreted here) sums each split
    tile's blocks into its place in C, and only there. The stand-in kernel writes known
    partials (split s: s + 1, so every split tile sums to 6) and leaves the whole tiles alone."""
    from tileq.kernels.gluon.launch import GluonLaunch

    rec, make = gluon_plan_for
    out = torch.zeros(300, n, dtype=torch.bfloat16)
    _, problem, plan = make(_spec(m=300, n=n, k=1024), pad=0, out=out)
    plan = _with_gluon(plan, GluonConfig(split_k=3))

    def fill(grid, args, kwargs):
        ws = args[4].view(-1, 3, 128, 128)
        for s_ in range(3):
            ws[:, s_] = s_ + 1

    rec.on_call = fill
    launch = GluonLaunch(problem, plan, None)
    launch(problem.a, problem.b, problem.a_scale, problem.b_scale, None, None, out)
    (grid, args, kwargs), = rec.calls
    assert kwargs["SPLIT_K"] == 3 and kwargs["OVERLAP"] is False and kwargs["BN"] == 128
    assert grid == (programs,) and args[4].dtype == torch.float32
    assert args[4].numel() >= n_split * 3 * 128 * 128
    assert args[9:14] == (300, n, 1024, n, 0)  # M N K ldc, no acc_in
    want = torch.zeros(300, n)
    if n_split == 15:
        want[:] = 6.0
    else:  # tiles 132-134 in grouped order: the last column tile of each row tile
        want[:, 44 * 128:] = 6.0
    assert torch.equal(out.float(), want)


def test_launcher_passes_acc_in_and_fast_accum(gluon_plan_for):
    """acc_in: its pointer and leading dimension reach the kernel (HAS_ACC), a forced 128 x 256
    overlapped config runs 128 x 128 without overlap, and calls with and without acc_in are
    different launches; fast_accum: MMA_ACC (never the overlapped loop)."""
    from tileq.kernels.direct import KernelCall
    from tileq.kernels.launch import make_launch

    rec, make = gluon_plan_for
    spec = _spec("abquant_fp8xfp8_rcr_prefill", m=300, n=576, k=1024, has_acc=True, has_bias=True)
    acc = torch.randn(300, 600)[:, :576]  # padded leading dimension 600
    args, problem, plan = make(spec)
    args.kwargs["acc"] = acc
    from tileq.problem import build_problem

    problem = args.call(build_problem)
    plan = _with_gluon(plan, GluonConfig(block_n=256, stages=4, overlap=True))
    launch = make_launch(problem, plan)
    launch(problem.a, problem.b, problem.a_scale, problem.b_scale, problem.bias, acc, None)
    (grid, kargs, kwargs), = rec.calls
    assert kargs[8] is acc and kwargs["HAS_ACC"] and kwargs["HAS_BIAS"]
    assert kargs[9:14] == (300, 576, 1024, 576, 600)  # M N K ldc ld_acc
    assert (kwargs["BN"], kwargs["OVERLAP"], kwargs["STAGES"]) == (128, False, 6)
    assert grid == (3 * 5,)
    # The direct launch specializes on which optional pointers are present: acc_in included.
    _, no_acc, plan_no_acc = make(replace(spec, has_acc=False))
    plain = make_launch(no_acc, _with_gluon(plan_no_acc, plan.route.gluon))
    assert isinstance(launch.variant(True)[1], KernelCall)
    assert launch.variant(True)[1].sid != plain.variant(True)[1].sid

    rec.calls.clear()
    _, problem, plan = make(_spec(m=300, n=576, k=1024, fast_accum=True))
    assert plan.route.gluon.tag == "m128n64k128_s8_ep_ws2x64"
    plan = _with_gluon(plan, GluonConfig(overlap=True))  # a forced overlap: not for MMA_ACC
    make_launch(problem, plan)(problem.a, problem.b, problem.a_scale, problem.b_scale, None, None, None)
    (_, kargs, kwargs), = rec.calls
    assert kwargs["MMA_ACC"] and not kwargs["INT_DOT"] and not kwargs["OVERLAP"] and not kwargs["HAS_ACC"]


@needs_interpreter
def test_launcher_falls_back_to_the_triton_kernel(gluon_plan_for):
    """Unaligned rows: the Triton launch for the signature; an unaligned base pointer: the Triton
    kernel for that call. Both compute the reference's result (the interpreter runs them here)."""
    from tileq.kernels.launch import GemmLaunch, make_launch

    rec, make = gluon_plan_for
    args, problem, plan = make(_spec(m=70, n=40, k=72))  # lda = ldb = 72: 72 % 16 != 0
    assert type(make_launch(problem, plan)) is GemmLaunch
    args, problem, plan = make(_spec(m=70, n=40, k=64), seed=3)
    launch = make_launch(problem, plan)
    a = problem.a
    shifted = torch.empty(a.numel() + 16, dtype=torch.uint8)[1:1 + a.numel()].view(a.dtype).view(a.shape)
    shifted.copy_(a)
    assert shifted.data_ptr() % 16 and shifted.stride() == a.stride()
    got = launch(shifted, problem.b, problem.a_scale, problem.b_scale, None, None, None)
    assert not rec.calls
    check_close(got, args.call(tileq.gemm, backend="reference"), torch.bfloat16)
    launch(a, problem.b, problem.a_scale, problem.b_scale, None, None, None)
    assert len(rec.calls) == 1


@needs_interpreter
def test_call_cache_keys_on_the_switch(monkeypatch):
    spec = _spec(m=70, n=40, k=64)
    args = make_args(spec, seed=1)
    api.clear_call_cache()
    try:
        for env in ("0", "1"):
            monkeypatch.setenv("TILEQ_GLUON", env)
            args.call(tileq.gemm, backend="triton")
        assert len(api._CALLS) == 2
    finally:
        api.clear_call_cache()


# ---- GPU: the kernel against the reference (sm_90) -----------------------------------------

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not _SM90, reason="needs an sm_90 GPU")(test))


@pytest.fixture
def gluon_on(monkeypatch):
    """TILEQ_GLUON=1 and a count of the Gluon kernel's launches."""
    from tileq.kernels.gluon import launch as glaunch

    monkeypatch.setenv("TILEQ_GLUON", "1")
    api.clear_call_cache()
    real = glaunch._gl()["kernel"]
    launches = []

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setitem(glaunch._gl(), "kernel", Counting())
    yield launches
    api.clear_call_cache()


def _run(spec, *, pad=0, out=None, seed=0, prepare=(), tol=None):
    """The Gluon call against the reference; ``prepare``: functions that adjust the arguments."""
    args = make_args(spec, seed=seed, device="cuda", pad=pad)
    for fn in prepare:
        fn(args)
    if spec.out_dtype == torch.float16 and args.a_scale is not None:
        # Random fp8 operands summed over K overflow fp16's 65504: scale the rows down (exactly).
        args.a_scale = args.a_scale * 2.0**-10
    if out is None:
        out = torch.full((spec.m, spec.n), float("nan"), dtype=spec.out_dtype, device="cuda")
    got = args.call(tileq.gemm, out=out)
    want = args.call(tileq.gemm, backend="reference")
    torch.cuda.synchronize()
    check_close(got, want, spec.out_dtype, tol)
    return args, got


def _small_integers(args):
    """8-bit operands in -2..2: with K <= 2048 every partial sum is an integer below 2**13, exact
    in the fp8 wgmma's reduced-precision accumulator (13 mantissa bits), so fast accumulation
    must give the reference's sums exactly: a K tile lost or added twice shows at any size."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    for t in (args.a, args.b):
        t.copy_(torch.randint(-2, 3, t.shape, generator=gen, device="cuda").to(t.dtype))


def _acc_like_product(args):
    """acc_in as large as A @ B (the helper's default, randn * 100, would hide under the
    tolerance next to 8-bit products summed over K: a kernel ignoring acc_in would pass), with
    integer values (exact in int32 and in fp32), in a wider buffer: leading dimension N + 24,
    the padding poisoned (NaN, or 2**30 for int32) so that a read past N shows."""
    acc = args.kwargs["acc"]
    m, n = acc.shape
    size = (args.a.float() @ args.b.float()).abs().max().item()  # (fp8 x fp8 products: exact in fp32)
    gen = torch.Generator(device="cuda").manual_seed(12)
    values = torch.randint(-int(size), int(size) + 1, (m, n), generator=gen, device="cuda")
    poison = float("nan") if acc.dtype.is_floating_point else 2**30
    buf = torch.full((m, n + 24), poison, dtype=acc.dtype, device="cuda")
    buf[:, :n] = values.to(acc.dtype)
    args.kwargs["acc"] = buf[:, :n]


ODD_SHAPES = [(fam, m, n, k) for fam in SERVED
              for m in ((65, 127, 300, 727, 4096) if fam == "rowcol_fp8xfp8_rcr_prefill" else (65, 727))
              for n in (577, 5120) for k in (859, 5120)]


@gpu
@pytest.mark.parametrize("family,m,n,k", ODD_SHAPES)
def test_gpu_odd_shapes(family, m, n, k, gluon_on):
    # Leading dimensions padded to multiples of 16 (TMA's row alignment): the K tail, M and N
    # edges are then zero-filled by TMA; N = 577 bf16 rows take the masked-store epilogue.
    pad = (-k) % 16
    _run(_spec(family, m, n, k, has_bias=True), pad=pad, seed=m + n + k)
    assert len(gluon_on) == 1


@pytest.fixture
def forced_gluon_config(monkeypatch):
    """Make the planner return a given Gluon config (its cache cleared before and after)."""
    from tileq.dispatch import gemm as dgemm
    from tileq.dispatch import gluon as gdispatch
    from tileq.dispatch.plan import _gemm_cached

    def force(cfg):
        # (the planner calls choose_tiles; patching gluon_config alone forced nothing)
        monkeypatch.setattr(dgemm, "choose_tiles", lambda spec, num_sms: (cfg, "forced by the test"))
        monkeypatch.setattr(gdispatch, "gluon_config", lambda spec, num_sms: cfg)
        _gemm_cached.cache_clear()
        api.clear_call_cache()

    yield force
    monkeypatch.undo()
    _gemm_cached.cache_clear()
    api.clear_call_cache()


FORCED_CONFIGS = [GluonConfig(block_n=256, stages=4), GluonConfig(block_n=256, stages=3, epi_bufs=2),
                  GluonConfig(block_n=256, stages=4, overlap=True), GluonConfig(overlap=True),
                  GluonConfig(block_n=64, stages=8, overlap=True),
                  GluonConfig(split_k=2), GluonConfig(block_n=64, stages=8, split_k=3),
                  GluonConfig(split_k=16),  # (K = 1040: 9 K tiles, splits 9-15 empty)
                  GluonConfig(scale_unroll=False),  # group scales one step ahead, not unrolled
                  GluonConfig(block_n=256, stages=4, overlap=True, scale_unroll=False),
                  GluonConfig(epi_preload=True), GluonConfig(epi_preload=True, split_k=3)]  # (vectors preloaded)


@gpu
@pytest.mark.parametrize("cfg", FORCED_CONFIGS, ids=lambda c: c.tag)
@pytest.mark.parametrize("family", SERVED + ["bquant_fp8xfp8_rcr_prefill"])
@pytest.mark.parametrize("m,n,k", [(65, 577, 859), (727, 4000, 1024), (1500, 5120, 1040)])
def test_gpu_forced_configs(cfg, family, m, n, k, gluon_on, forced_gluon_config):
    """Tiles of two 128-column sub-tiles: odd N (a sub-tile wholly or partly past N; N = 577
    bf16 takes the masked stores), group scales per sub-tile, bias; the overlapped main loop
    (each K tile's wgmma started one step early, an extra ring item after the last tile);
    split-K (fp32 partials per K range, the bias from the first, summed in order; K = 859 in
    three splits leaves the last one a single tail tile)."""
    forced_gluon_config(cfg)
    kw = dict(group_n=128) if family.startswith("bquant") else {}
    _run(_spec(family, m, n, k, has_bias=True, **kw), pad=(-k) % 16, seed=m + n + k)
    assert len(gluon_on) == 1


def test_forced_gluon_config_reaches_the_plan(forced_gluon_config, monkeypatch):
    """The GPU tests' forced configs are what the plan runs (CPU check of the fixture)."""
    forced_gluon_config(GluonConfig(block_n=64, stages=8, split_k=3))
    p = _plan(monkeypatch, "1", _spec(m=4096))
    assert p.route.gluon == GluonConfig(block_n=64, stages=8, split_k=3) and "forced by the test" in p.describe()


FAST_FAMILIES = ["rowcol_fp8xfp8_rcr_prefill", "tensor_fp8xfp8_rcr_prefill", "rowcol_fp8xbf8_rcr_prefill",
                 "rowcol_bf8xbf8_rcr_prefill",
                 "abquant_fp8xfp8_rcr_prefill"]  # group scales: fast_accum runs the precise kernel


@gpu
@pytest.mark.parametrize("cfg", [None] + FORCED_CONFIGS, ids=lambda c: c.tag if c else "plan")
@pytest.mark.parametrize("family", FAST_FAMILIES)
@pytest.mark.parametrize("acc", [False, True], ids=["", "acc_in"])
@pytest.mark.parametrize("m,n,k", [(65, 577, 859), (300, 5120, 1040), (727, 4000, 2048)])
def test_gpu_fast_accum_exact_on_small_integers(cfg, family, acc, m, n, k, gluon_on, forced_gluon_config):
    """fast_accum: each K tile accumulated exactly once in the wgmma accumulator (the pipelined
    loop hands a ring slot back only after the next K tile's wgmma retired its reader), across
    tiles, split-K items (an empty last split at K = 859 in three) and 128 x 256 tiles; odd M
    and N (masked stores at N = 577: fp32 rows of 2308 bytes), the K tail, a bias, padded rows;
    with acc_in added in the epilogue. fp32 output: exact sums, so fp32 rounding only (a lost or
    repeated K tile is off by a sizable fraction of max|C|)."""
    if cfg is not None:
        forced_gluon_config(cfg)
    spec = _spec(family, m, n, k, fast_accum=True, has_bias=True, has_acc=acc, out_dtype=torch.float32)
    _run(spec, pad=(-k) % 16, seed=m + n + k, prepare=(_small_integers,) + ((_acc_like_product,) if acc else ()),
         tol=1e-5)  # (scales, split sums and group promotions round in fp32: a few ulps of max|C|)
    assert len(gluon_on) == 1


@gpu
@pytest.mark.parametrize("family", FAST_FAMILIES[:4])
@pytest.mark.parametrize("m,n,k", [(65, 577, 859), (727, 5120, 2048), (4096, 5120, 4096)])
def test_gpu_fast_accum_random(family, m, n, k, gluon_on):
    """Random fp8 operands: within the bf16 tolerance up to K = 4096 (fast accumulation's error
    grows with K: 0.56-0.70% of max|C| at K = 4096-5120 with the Triton kernel, H200, 2026-11-29,
    bench/results/h200/fast-accum-errors/)."""
    _run(_spec(family, m, n, k, fast_accum=True, has_bias=True), pad=(-k) % 16, seed=m + k)
    assert len(gluon_on) == 1


ACC_FAMILIES = [("rowcol_fp8xfp8_rcr_prefill", {}), ("tensor_fp8xfp8_rcr_prefill", {}),
                ("abquant_fp8xfp8_rcr_prefill", {}), ("aquant_fp8xfp8_rcr_preshufflequant", {}),
                ("bquant_fp8xfp8_rcr_prefill", dict(group_n=128)), ("abquant_bf8xbf8_rcr_prefill", {}),
                ("rowcol_i8xi8_rcr_prefill", {}), ("tensor_i8xi8_rcr_prefill", {}),
                ("rowcol_fp8xfp8_rcr_prefill", dict(fast_accum=True))]


@gpu
@pytest.mark.parametrize("cfg", [None] + FORCED_CONFIGS, ids=lambda c: c.tag if c else "plan")
@pytest.mark.parametrize("family,kw", ACC_FAMILIES, ids=lambda x: x if isinstance(x, str) else "-".join(x) or "")
@pytest.mark.parametrize("m,n,k", [(65, 577, 859), (727, 4000, 1024), (1500, 5120, 1040)])
def test_gpu_acc_in(cfg, family, kw, m, n, k, gluon_on, forced_gluon_config):
    """acc_in [M, N] (int32 for int8, fp32 otherwise) as large as the product, in a padded
    buffer: added once before the scales (split-K: by the first split only), zero past M and N;
    with promotion it starts the accumulator, with int8 the wgmma accumulator, with fast_accum
    the epilogue adds it. Forced 128 x 256 and overlapped configs run 128 x 128 (acc_in_config);
    odd M/N, the K tail, a bias, masked and TMA stores."""
    if cfg is not None:
        forced_gluon_config(cfg)
    spec = _spec(family, m, n, k, has_acc=True, has_bias=True, **kw)
    _run(spec, pad=(-k) % 16, seed=m + n + k, prepare=(_acc_like_product,))
    assert len(gluon_on) == 1


@gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gpu_int8_acc_in_exact(out_dtype, gluon_on):
    """int8 with acc_in: acc_in + A @ B in int32 exactly, then the same fp32 epilogue as the
    reference (a K = 4096 fp32 output within fp32 rounding)."""
    spec = _spec("rowcol_i8xi8_rcr_prefill", 1000, 2048, 4096, has_acc=True, has_bias=True, out_dtype=out_dtype)
    _run(spec, seed=5, prepare=(_acc_like_product,), tol=1e-6 if out_dtype == torch.float32 else None)
    assert len(gluon_on) == 1


@gpu
@pytest.mark.parametrize("cfg", [None, GluonConfig(scale_unroll=False), GluonConfig(split_k=3),
                                 GluonConfig(block_n=256, stages=4, overlap=True)],
                         ids=lambda c: c.tag if c else "plan")
@pytest.mark.parametrize("family,kw", [
    ("bquant_fp8xfp8_rcr_prefill", dict(group_n=1)),
    ("abquant_fp8xfp8_rcr_prefill", dict(group_n=1, has_bias=True)),
    ("abquant_fp8xfp8_rcr_prefill", dict(group_n=1, out_dtype=torch.float32)),
    ("abquant_fp8xfp8_rcr_prefill", dict(group_n=1, a_scale_layout=ScaleLayout.PRESHUFFLED)),
])
@pytest.mark.parametrize("m,n,k", [(65, 577, 859), (300, 5120, 1040), (1500, 4000, 2048)])
def test_gpu_per_column_b_groups(cfg, family, kw, m, n, k, gluon_on, forced_gluon_config):
    """b_scale groups of one column (b_scale [K / 128, N]): every column's own scale per K group,
    odd N (the last tile's columns past N), K tails, split tiles; a forced 128 x 256 config runs
    128 x 64 (column_groups_config)."""
    if cfg is not None:
        forced_gluon_config(cfg)
    _run(_spec(family, m, n, k, **kw), pad=(-k) % 16, seed=m + n + k)
    assert len(gluon_on) == 1


@gpu
@pytest.mark.parametrize("cfg", [None, GluonConfig(swap_ab=True), GluonConfig(split_k=3, swap_ab=True),
                                 GluonConfig(block_n=256, stages=4, overlap=True, swap_ab=True),
                                 GluonConfig(block_n=64, stages=8, swap_ab=True)],
                         ids=lambda c: c.tag if c else "plan")
@pytest.mark.parametrize("kw", [
    dict(), dict(has_bias=True), dict(out_dtype=torch.float32, has_bias=True), dict(has_acc=True),
    dict(a_scale_kind=ScaleKind.SCALAR), dict(a_scale_kind=ScaleKind.NONE, has_bias=True),
], ids=lambda kw: "-".join(f"{k}={getattr(v, 'value', v)}" for k, v in kw.items()) or "plain")
@pytest.mark.parametrize("m,n,k", [(65, 577, 859), (300, 5120, 1040), (1500, 4000, 2048)])
def test_gpu_swapped_column_groups(cfg, kw, m, n, k, gluon_on, forced_gluon_config):
    """bquant with one-column b_scale groups, swapped (the weight on the kernel's A side, each
    C^T tile written transposed): every config the plan or a user can give it, odd M and N (the
    transposed TMA box clipped at both edges, masked stores at N = 577), K tails, split tiles
    (the transposed reduction), a bias along the tile's rows, acc_in read transposed, an fp32
    output, per-tensor and no activation scales; an out= view whose rows are longer than N."""
    if cfg is not None:
        forced_gluon_config(cfg)
    spec = _spec("bquant_fp8xfp8_rcr_prefill", m, n, k, group_n=1, **kw)
    prepare = (_acc_like_product,) if spec.has_acc else ()
    _run(spec, pad=(-k) % 16, seed=m + n + k, prepare=prepare)
    if m == 300 and not spec.has_acc:
        wide = torch.full((m, n + 8), float("nan"), dtype=spec.out_dtype, device="cuda")
        _run(spec, seed=m + k, out=wide[:, :n])
    assert len(gluon_on) >= 1


@gpu
@pytest.mark.parametrize("family,kw", [
    ("bquant_fp8xfp8_rcr_prefill", dict(group_n=128)),  # 128-wide weight blocks, no a_scale groups
    ("abquant_fp8xfp8_rcr_prefill", dict(a_scale_layout=ScaleLayout.PRESHUFFLED)),  # K-group-major
    ("abquant_fp8xfp8_rcr_prefill", dict(out_dtype=torch.float32, has_bias=True)),
])
@pytest.mark.parametrize("m,n,k", [(300, 577, 859), (4096, 5120, 5120)])
def test_gpu_block_scale_variants(family, kw, m, n, k, gluon_on):
    _run(_spec(family, m, n, k, **kw), pad=(-k) % 16, seed=m + k)
    assert len(gluon_on) == 1


@gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,ld", [(577, 584), (5120, 5120)])
def test_gpu_out_and_dtypes(out_dtype, n, ld, gluon_on):
    """out= views with 16-byte aligned rows (TMA stores clipped at N), every output dtype."""
    spec = _spec(m=300, n=n, k=1024, out_dtype=out_dtype)
    out = torch.full((300, ld), float("nan"), dtype=out_dtype, device="cuda")[:, :n]
    _, got = _run(spec, out=out)
    assert got is out and len(gluon_on) == 1


@gpu
def test_gpu_long_k_precise_accumulation(gluon_on):
    """fp32 output at K = 17408: promoted every 128 of K, as accurate as the Triton kernel."""
    _run(_spec(m=256, n=1024, k=17408, out_dtype=torch.float32), seed=7)
    assert len(gluon_on) == 1


@gpu
def test_gpu_fallbacks(gluon_on):
    """Unaligned rows (contiguous K = 859) and an unaligned base pointer run the Triton kernel."""
    _run(_spec(m=300, n=577, k=859))
    assert not gluon_on
    spec = _spec(m=300, n=512, k=1024)
    args = make_args(spec, seed=2, device="cuda")
    buf = torch.empty(300 * 1024 + 16, dtype=torch.uint8, device="cuda")
    a = buf[1:1 + 300 * 1024].view(torch.float8_e4m3fn).view(300, 1024)
    a.copy_(args.a)
    got = tileq.gemm(a, args.b, args.a_scale, args.b_scale, scheme="rowcol")
    check_close(got, args.call(tileq.gemm, backend="reference"), torch.bfloat16)
    assert not gluon_on
    args.call(tileq.gemm)
    assert len(gluon_on) == 1


@gpu
def test_gpu_deterministic_and_linear(gluon_on):
    spec = _spec(m=1000, n=2048, k=4096, has_bias=True)
    args = make_args(spec, seed=3, device="cuda")
    first = args.call(tileq.gemm)
    for _ in range(3):
        assert torch.equal(args.call(tileq.gemm), first)
    y = tileq.linear(args.a, args.b.t(), args.a_scale, args.b_scale, scheme="rowcol", bias=args.kwargs["bias"])
    assert torch.equal(y, first)
    assert len(gluon_on) == 5


@gpu
@pytest.mark.parametrize("family,m,n", [("rowcol_fp8xfp8_rcr_prefill", 300, 512),
                                        ("abquant_fp8xfp8_rcr_prefill", 4096, 5120),  # 128 x 256 tiles
                                        ("rowcol_fp8xfp8_rcr_prefill", 300, 577)])  # masked stores
def test_gpu_direct_launches(family, m, n, monkeypatch):
    """Later calls of a signature skip Triton's JIT launch (KernelCall keeps the compiled
    kernel; its launcher encodes the TMA descriptors): same results, and a handle was kept."""
    from tileq.kernels import direct
    from tileq.kernels.gluon import launch as glaunch

    monkeypatch.delenv("TILEQ_DIRECT_LAUNCH", raising=False)
    monkeypatch.delenv("TILEQ_GLUON", raising=False)
    api.clear_call_cache()
    spec = _spec(family, m=m, n=n, k=1024, has_bias=True)
    args = make_args(spec, seed=8, device="cuda")
    first = args.call(tileq.gemm)
    check_close(first, args.call(tileq.gemm, backend="reference"), torch.bfloat16)
    for _ in range(3):
        assert torch.equal(args.call(tileq.gemm), first)
    kernel = glaunch._gl()["kernel"]
    assert any(key[1] is kernel for key in direct._HANDLES)
    api.clear_call_cache()


@gpu
def test_gpu_cuda_graph_capture(gluon_on):
    spec = _spec(m=512, n=4096, k=4096, has_bias=True)
    args = make_args(spec, seed=4, device="cuda")
    out = torch.empty(512, 4096, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        args.call(tileq.gemm, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        args.call(tileq.gemm, out=out)
    fresh = make_args(spec, seed=5, device="cuda")
    args.a.copy_(fresh.a)
    args.b.copy_(fresh.b)
    args.a_scale.copy_(fresh.a_scale)
    args.b_scale.copy_(fresh.b_scale)
    args.kwargs["bias"].copy_(fresh.kwargs["bias"])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_close(out, fresh.call(tileq.gemm, backend="reference"), torch.bfloat16)
    assert len(gluon_on) == 3


def test_bench_builds_each_gluon_cases_baseline():
    """tileq bench's Gluon cases (--cases gluon; scripts/gpu_run.sh bench-gluon): the kernel serves
    each, and each gets its torch baseline from the registry, built from the case's operands
    (cuBLASLt row-wise with the case's accumulation, block-wise, torch._int_mm + dequantization);
    int8 also torch._int_mm alone (the report's vs-_int_mm table); bquant's one-column weight
    groups have no torch product (no baseline: the Triton kernel and bf16 matmul stand beside it)."""
    from tileq.bench.baselines import REGISTRY, SAME_MATH_KINDS, Context
    from tileq.bench.cases import (build_operands, draw_activation, draw_weight, parse_case_list,
                                   quantize_weight_side)

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    m, n, k = 128, 256, 384
    want = {"rowcol:fp8xfp8:rcr": {"torch_scaled_mm_rowwise"}, "rowcol:fp8xfp8:rcr:fast": {"torch_scaled_mm_rowwise"},
            "abquant:fp8xfp8:rcr": {"torch_scaled_mm_blockwise"}, "rowcol:i8xi8:rcr": {"torch_int_mm_dequant"},
            "bquant:fp8xfp8:rcr": set()}
    cases = parse_case_list("gluon")
    assert [c.name for c in cases] == list(want)
    for case in cases:
        spec = case.spec(m, n, k)
        assert select.gluon_serves(spec, "prefill", 64) is None, case.name
        ops = build_operands(case, draw_activation(m, k, 0, cpu), quantize_weight_side(case, draw_weight(n, k, 0, cpu)))
        applicable = [i for i in REGISTRY if i.kind in SAME_MATH_KINDS and i.module is None
                      and i.unavailable(case, m, n, k, cuda) is None]
        assert {i.name for i in applicable} == want[case.name]
        for impl in applicable:
            run = impl.build(ops, Context(cpu, "triton"))
            assert callable(run.fn) and run.expected == "quantized"
            if case.fast_accum:
                assert "use_fast_accum=True" in run.note
    int8 = cases[3]
    raw = next(i for i in REGISTRY if i.name == "torch_int_mm")
    assert raw.kind == "raw" and raw.unavailable(int8, m, n, k, cuda) is None
    ops = build_operands(int8, draw_activation(m, k, 0, cpu), quantize_weight_side(int8, draw_weight(n, k, 0, cpu)))
    assert raw.build(ops, Context(cpu, "triton")).expected == "raw"
