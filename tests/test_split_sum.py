"""A decode split over K summed by the portable kernel itself (``dispatch.gemm.sums_in_kernel``):
one launch instead of the GEMM and the split-K reduction. The last program of each tile adds
the partials in split order, the reduction kernel's order, so the result is the same bits; its
tile counters go back to zero. Run through Triton's interpreter; the sm_90 build of such a kernel
(its atomics after the PDL wait) is checked in tests/test_pdl.py, the GPU run in
tests/test_gpu.py."""

from dataclasses import replace

import pytest
import torch

from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.dispatch import gemm as gemm_mod
from tileq.dispatch import plan as plan_mod
from tileq.kernels import buffers, launch
from tileq.problem import build_problem
from tileq.reference import gemm_ref
from tileq.testing import check_close, make_args

CASES = [
    # family, M, N, K, split, swapped, extra make_args keywords
    ("rowcol_i8xi8_rcr_decode", 1, 136, 768, 3, True, dict(bias=True)),
    ("rowcol_i8xi8_rcr_decode", 5, 72, 640, 2, False, dict(acc=True)),
    ("rowcol_fp8xfp8_rcr_decode", 3, 80, 1024, 4, True, dict()),
    ("abquant_fp8xfp8_rcr_decode", 2, 136, 640, 2, False, dict(bias=True)),
    ("bquant_bf16xi4_rcr_decode", 4, 64, 512, 2, True, dict()),
    ("abquant_fp8xfp8_rcr_decode", 1, 72, 3072, 8, True, dict(bias=True)),  # the rule's largest split
]


def _launch(problem, cfg, in_kernel: bool, monkeypatch):
    base = plan_mod.make_plan(problem.spec, problem.device, backend="triton")
    p = plan_mod.with_config(base, cfg)
    with monkeypatch.context() as mp:
        if not in_kernel:
            mp.setattr(gemm_mod, "sums_in_kernel", lambda pipeline, cfg: False)
        assert p.route.in_kernel_sum is in_kernel
        return launch.GemmLaunch(problem, p), p


@pytest.mark.parametrize("family,m,n,k,split,swapped,extra", CASES)
def test_in_kernel_sum_equals_the_reduction_kernel(family, m, n, k, split, swapped, extra, monkeypatch):
    spec = family_spec(parse_family(family), m, n, k)
    problem = make_args(spec, seed=3, **extra).call(build_problem)
    base = plan_mod.make_plan(problem.spec, problem.device, backend="triton")
    cfg = replace(base.config, split_k=split, swap_ab=swapped, block_m=64 if swapped else 16,
                  block_n=16 if swapped else 64, block_k=128, num_stages=2)
    counters = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setattr(buffers, "tile_counters", lambda device, count: counters[:count])
    fixed, p = _launch(problem, cfg, True, monkeypatch)
    assert fixed.reduce is None and fixed.counters == fixed.main.grid[0]
    two, _ = _launch(problem, cfg, False, monkeypatch)
    assert two.reduce is not None
    a = problem.a.data if hasattr(problem.a, "packed_dim") else problem.a
    b = problem.b.data if hasattr(problem.b, "packed_dim") else problem.b
    args = (a, b, problem.a_scale, problem.b_scale, problem.bias, problem.acc)
    y1 = fixed(*args, torch.full((m, n), float("nan"), dtype=spec.out_dtype))
    assert torch.all(counters == 0)  # each tile's last program put its counter back
    y2 = two(*args, None)
    assert torch.equal(y1, y2)
    check_close(y1, gemm_ref(problem), spec.out_dtype)
    assert "summed in the kernel" in p.describe()


def test_only_decode_splits_sum_in_the_kernel():
    from tileq.kernels.config import TileConfig

    assert gemm_mod.sums_in_kernel("decode", TileConfig(64, 16, 256, 4, 4, 2, swap_ab=True))
    assert not gemm_mod.sums_in_kernel("decode", TileConfig(64, 16, 256, 4, 4, 1, swap_ab=True))
    assert not gemm_mod.sums_in_kernel("prefill", TileConfig(128, 128, 64, 8, 3, 2))
