"""GPU correctness at real sizes (skipped without CUDA: CPU CI covers the interpreter path).

Outputs are poisoned with NaN before each run; results must match the reference, be finite and
not all zero. Run on the H200 by scripts/gpu_run.sh.
"""

import pytest
import torch

import tileq
from tileq.catalog.families import catalog, family_spec
from tileq.catalog.names import parse_family
from tileq.testing import check_close, make_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _shape(fam, m, n, k):
    if fam.a.value == "i4" and fam.layout[0] == "c" and m % 2:
        m += 1
    if fam.b.value == "i4" and fam.layout[1] == "r" and n % 2:
        n += 1
    if (fam.a.value == "i4" and fam.layout[0] == "r" or fam.b.value == "i4" and fam.layout[1] == "c") and k % 2:
        k += 1
    return m, n, k


def run(fam, m, n, k, pipeline=None, pad=0, out_dtype=torch.bfloat16, seed=0):
    m, n, k = _shape(fam, m, n, k)
    spec = family_spec(fam, m, n, k, out_dtype=out_dtype)
    args = make_args(spec, seed=seed, device="cuda", pad=pad, bias=True)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    got = args.call(tileq.gemm, backend="triton", out=out, pipeline=pipeline)
    want = args.call(tileq.gemm, backend="reference")
    torch.cuda.synchronize()
    return check_close(got, want, out_dtype)


@pytest.mark.parametrize("family", [f.name for f in catalog()])
def test_family_at_odd_real_size(family):
    fam = parse_family(family)
    m = 727 if fam.pipeline != "decode" else 13
    run(fam, m, 577, 859)


@pytest.mark.parametrize("family", ["rowcol_i8xi8_rcr_prefill", "rowcol_fp8xfp8_rcr_prefill",
                                    "abquant_fp8xfp8_rcr_prefill", "bquant_fp8xi4_rcr_prefill",
                                    "aquant_i4xfp8_crr_preshufflequant", "bquant_bf16xi4_rcr_prefill"])
@pytest.mark.parametrize("m", list(range(1, 17)))
def test_small_m_through_prefill(family, m):
    run(parse_family(family), m, 1024, 1024, pipeline="prefill", seed=m)


@pytest.mark.parametrize("family", ["rowcol_i8xi8_rcr_decode", "tensor_fp8xfp8_rrr_decode",
                                    "abquant_fp8xfp8_rcr_decode", "bquant_bf16xi4_rcr_decode"])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 33, 64])
def test_decode_sizes(family, m):
    run(parse_family(family), m, 5120, 1536, seed=m)


@pytest.mark.parametrize("family", ["rowcol_i8xi8_rcr_prefill", "rowcol_fp8xfp8_rcr_prefill",
                                    "rowcol_i8xi8_rcr_decode", "bquant_fp8xi4_rcr_decode"])
def test_k_equals_one(family):
    fam = parse_family(family)
    run(fam, 300 if fam.pipeline == "prefill" else 5, 257, 1 if fam.b.value != "i4" else 2)


@pytest.mark.parametrize("family", ["rowcol_i8xi8_rcr_prefill", "rowcol_fp8xfp8_ccr_prefill",
                                    "aquant_i4xfp8_crr_decode", "bquant_fp8xi4_rcr_prefill",
                                    "abquant_fp8xfp8_rrr_decode"])
def test_padded_leading_dimensions(family):
    fam = parse_family(family)
    run(fam, 515 if fam.pipeline != "decode" else 9, 384, 640, pad=64)


def test_cuda_graph_capture_and_replay():
    fam = parse_family("rowcol_fp8xfp8_rcr_decode")
    spec = family_spec(fam, 4, 4096, 4096)
    args = make_args(spec, seed=1, device="cuda")
    out = torch.empty(4, 4096, dtype=torch.bfloat16, device="cuda")
    args.call(tileq.gemm, out=out)  # warm-up compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        args.call(tileq.gemm, out=out)
    fresh = make_args(spec, seed=2, device="cuda")
    args.a.copy_(fresh.a)
    args.b.copy_(fresh.b)
    args.a_scale.copy_(fresh.a_scale)
    args.b_scale.copy_(fresh.b_scale)
    graph.replay()
    torch.cuda.synchronize()
    want = fresh.call(tileq.gemm, backend="reference")
    check_close(out, want, torch.bfloat16)


def test_deterministic_bit_identical():
    """Every path sums its partials in a fixed order: the same bits run to run."""
    fam = parse_family("abquant_fp8xfp8_rcr_decode")
    spec = family_spec(fam, 3, 7168, 2048)
    args = make_args(spec, seed=3, device="cuda")
    first = args.call(tileq.gemm)
    for _ in range(5):
        assert torch.equal(first, args.call(tileq.gemm))


def test_warmup_compiles_the_planned_kernels():
    names = tileq.warmup([
        tileq.describe(scheme="rowcol", a="int8", b="int8", m=1, n=4096, k=4096),
        dict(scheme="abquant", a="fp8", b="fp8", m=4096, n=4096, k=4096),
    ])
    assert names[0].startswith("rowcol_i8xi8_rcr_decode__") and names[1].startswith("abquant_fp8xfp8_rcr_prefill__")


@pytest.mark.parametrize("family", ["bquant_fp8xi4_rcr_prefill", "bquant_bf16xi4_rcr_prefill",
                                    "bquant_fp8xi4_rcr_decode", "bquant_bf16xi4_rcr_decode",
                                    "rowcol_i8xi8_rcr_decode", "abquant_fp8xfp8_rcr_decode",
                                    "bquant_fp8xi4_rrr_prefill", "aquant_i4xfp8_crr_decode"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_swapped_variant_at_real_size(family, split_k):
    from dataclasses import replace

    from tileq.dispatch.plan import execute, make_plan, with_config
    from tileq.problem import build_problem

    fam = parse_family(family)
    m, n, k = _shape(fam, 727 if fam.pipeline != "decode" else 13, 577, 859)
    spec = family_spec(fam, m, n, k)
    args = make_args(spec, seed=4, device="cuda", bias=True)
    want = args.call(tileq.gemm, backend="reference")
    problem = args.call(build_problem)
    problem.out = torch.full((m, n), float("nan"), dtype=spec.out_dtype, device="cuda")
    base = make_plan(problem.spec, torch.device("cuda"))
    cfg = replace(base.config, swap_ab=True, split_k=split_k, block_m=128 if fam.pipeline != "decode" else 64,
                  block_n=128 if fam.pipeline != "decode" else 16, num_warps=8 if fam.pipeline != "decode" else 4)
    got = execute(with_config(base, cfg), problem)
    torch.cuda.synchronize()
    check_close(got, want, spec.out_dtype)


def _count_jit_runs(monkeypatch, fn) -> list:
    """Count launches that go through ``JITFunction.run`` (``fn[grid](...)`` calls ``fn.run``)."""
    runs, original = [], fn.run

    def run(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fn, "run", run)
    return runs


def _refill(args, fresh) -> None:
    """Copy fresh values into the operands a captured graph reads (same buffers)."""
    for name in ("a", "b", "a_scale", "b_scale"):
        dst, src = getattr(args, name), getattr(fresh, name)
        if dst is not None:
            (dst.data if hasattr(dst, "packed_dim") else dst).copy_(src.data if hasattr(src, "packed_dim") else src)


@pytest.mark.parametrize("family,swap,split_k", [
    ("rowcol_fp8xfp8_rcr_decode", False, 1),
    ("rowcol_i8xi8_rcr_prefill", False, 1),
    ("abquant_fp8xfp8_rcr_decode", False, 3),
    ("rowcol_fp8xfp8_rcr_prefill", False, 2),
    ("bquant_fp8xi4_rcr_decode", True, 1),
    ("bquant_bf16xi4_rcr_decode", True, 3),
    ("rowcol_i8xi8_rcr_decode", True, 2),
])
def test_direct_launch_matches_jit_launch(family, swap, split_k, monkeypatch):
    """Launching the compiled kernel directly (kernels/direct.py KernelCall) gives bit-identical
    results to JITFunction.run, for plain, split-K and swapped configs, and is really taken."""
    from dataclasses import replace

    from tileq.kernels import launch
    from tileq.kernels import split_k as split_k_module
    from tileq.dispatch.plan import execute, make_plan, with_config
    from tileq.problem import build_problem

    fam = parse_family(family)
    decode = fam.pipeline == "decode"
    m, n, k = _shape(fam, 13 if decode else 300, 577, 859)
    spec = family_spec(fam, m, n, k)
    args = make_args(spec, seed=5, device="cuda", bias=True)
    problem = args.call(build_problem)
    base = make_plan(problem.spec, torch.device("cuda"))
    cfg = replace(base.config, swap_ab=swap, split_k=split_k)
    if swap:
        cfg = replace(cfg, block_m=64, block_n=16, num_warps=4)
    plan = with_config(base, cfg)
    runs = _count_jit_runs(monkeypatch, launch._gemm_kernel)
    # (none where the kernel sums its split)
    reduce_runs = _count_jit_runs(monkeypatch, split_k_module._split_reduce_kernel)
    reduced = split_k > 1 and not plan.route.in_kernel_sum

    def run():
        problem.out = torch.full((m, n), float("nan"), dtype=spec.out_dtype, device="cuda")
        return execute(plan, problem)

    monkeypatch.setenv("TILEQ_DIRECT_LAUNCH", "0")
    via_jit = [run() for _ in range(2)]
    assert len(runs) == 2 and len(reduce_runs) == (2 if reduced else 0)
    monkeypatch.delenv("TILEQ_DIRECT_LAUNCH")
    run()  # the first direct-mode launch of this specialization keeps the compiled kernel
    before = (len(runs), len(reduce_runs))
    direct = [run() for _ in range(3)]
    assert (len(runs), len(reduce_runs)) == before  # not through JITFunction.run
    torch.cuda.synchronize()
    for got in via_jit[1:] + direct:
        assert torch.equal(got, via_jit[0])
    check_close(direct[-1], args.call(tileq.gemm, backend="reference"), spec.out_dtype)


def test_direct_launch_under_cuda_graph_capture(monkeypatch):
    """Direct launches (public call cache and an explicit swapped split-K plan) captured in a CUDA
    graph replay on new data like eager JIT launches."""
    from dataclasses import replace

    from tileq.kernels import launch
    from tileq.kernels import split_k as split_k_module
    from tileq.dispatch.plan import execute, make_plan, with_config
    from tileq.problem import build_problem

    monkeypatch.delenv("TILEQ_DIRECT_LAUNCH", raising=False)
    rowcol = make_args(family_spec(parse_family("rowcol_fp8xfp8_rcr_decode"), 4, 4096, 4096), seed=1,
                       device="cuda", bias=True)
    out1 = torch.empty(4, 4096, dtype=torch.bfloat16, device="cuda")
    spec2 = family_spec(parse_family("bquant_fp8xi4_rcr_decode"), 4, 4096, 4096)
    args2 = make_args(spec2, seed=1, device="cuda")
    problem2 = args2.call(build_problem)
    problem2.out = torch.empty(4, 4096, dtype=torch.bfloat16, device="cuda")
    base = make_plan(problem2.spec, torch.device("cuda"))
    plan2 = with_config(base, replace(base.config, swap_ab=True, split_k=4, block_m=64, block_n=16,
                                      num_warps=4))

    def step():
        rowcol.call(tileq.gemm, out=out1)
        execute(plan2, problem2)

    for _ in range(2):  # compile and keep the kernels outside the capture
        step()
    torch.cuda.synchronize()
    runs = _count_jit_runs(monkeypatch, launch._gemm_kernel)
    reduce_runs = _count_jit_runs(monkeypatch, split_k_module._split_reduce_kernel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assert not runs and not reduce_runs  # captured through the direct launcher
    _refill(rowcol, make_args(family_spec(parse_family("rowcol_fp8xfp8_rcr_decode"), 4, 4096, 4096),
                              seed=2, device="cuda", bias=True))
    _refill(args2, make_args(spec2, seed=2, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    got1, got2 = out1.clone(), problem2.out.clone()
    check_close(got1, rowcol.call(tileq.gemm, backend="reference"), torch.bfloat16)
    check_close(got2, args2.call(tileq.gemm, backend="reference"), torch.bfloat16)
    monkeypatch.setenv("TILEQ_DIRECT_LAUNCH", "0")
    step()
    torch.cuda.synchronize()
    assert torch.equal(out1, got1) and torch.equal(problem2.out, got2)


@pytest.mark.parametrize("family,m,n,k,split", [
    ("rowcol_i8xi8_rcr_decode", 1, 5120, 5120, 3),
    ("rowcol_fp8xfp8_rcr_decode", 16, 7168, 5120, 2),
    ("abquant_fp8xfp8_rcr_decode", 4, 5120, 17408, 4),
])
def test_decode_split_sums_in_the_kernel(family, m, n, k, split, monkeypatch):
    """A decode split summed by the kernel (one launch) gives the reduction kernel's bits, and
    replays in a CUDA graph on new data (its tile counters back at zero after every call)."""
    from dataclasses import replace

    from tileq.dispatch import gemm as gemm_mod
    from tileq.dispatch import plan as plan_mod
    from tileq.kernels import buffers
    from tileq.problem import build_problem

    fam = parse_family(family)
    spec = family_spec(fam, m, n, k)
    args = make_args(spec, seed=6, device="cuda", bias=True)
    problem = args.call(build_problem)
    base = plan_mod.make_plan(problem.spec, torch.device("cuda"))
    cfg = replace(base.config, split_k=split)
    plan = plan_mod.with_config(base, cfg)
    assert plan.route.in_kernel_sum

    def run(p):
        problem.out = torch.full((m, n), float("nan"), dtype=spec.out_dtype, device="cuda")
        return plan_mod.execute(p, problem)

    fixed = run(plan)
    with monkeypatch.context() as mp:
        mp.setattr(gemm_mod, "sums_in_kernel", lambda pipeline, cfg: False)
        two_launches = run(plan_mod.with_config(base, cfg))
    torch.cuda.synchronize()
    assert torch.equal(fixed, two_launches)
    check_close(fixed, args.call(tileq.gemm, backend="reference"), spec.out_dtype)
    out = torch.empty(m, n, dtype=spec.out_dtype, device="cuda")
    problem.out = out
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_mod.execute(plan, problem)
    for seed in (7, 8):
        fresh = make_args(spec, seed=seed, device="cuda", bias=True)
        _refill(args, fresh)
        graph.replay()
        torch.cuda.synchronize()
        check_close(out, fresh.call(tileq.gemm, backend="reference", bias=args.kwargs["bias"]), spec.out_dtype)
    counters = buffers.tile_counters(torch.device("cuda"), 1)
    assert int(counters.abs().sum()) == 0
