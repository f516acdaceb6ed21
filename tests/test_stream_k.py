"""Stream-K in the portable kernel (``TileConfig.stream_k``, ``gemm_kernel._stream_k``): a grid of
as many programs as the SMs hold, each summing an equal contiguous range of (tile, K tile) units;
a tile shared by programs is summed by its last one, in program order. Run through Triton's
interpreter with a small SM count, so that ranges start and end inside tiles, span several tiles
and share a tile among three or more programs; the sm_90 build is checked in tests/test_pdl.py,
the GPU run in tests/test_gpu.py."""

from dataclasses import replace

import pytest
import torch

from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.dispatch import plan as plan_mod
from tileq.kernels import buffers, launch
from tileq.kernels.config import TileConfig, config_problem
from tileq.device import get_arch
from tileq.problem import build_problem
from tileq.reference import gemm_ref
from tileq.testing import check_close, make_args

CASES = [
    # family, M, N, K, SMs, swapped, extra make_args keywords
    ("rowcol_i8xi8_rcr_decode", 1, 200, 768, 3, True, dict(bias=True)),      # 4 tiles x 6 K tiles on 6 programs
    ("rowcol_i8xi8_rcr_decode", 5, 72, 1280, 2, False, dict(acc=True)),     # unswapped, acc_in
    ("rowcol_fp8xfp8_rcr_decode", 3, 136, 1000, 2, True, dict()),           # a partial last K tile
    ("rowcol_fp8xfp8_rcr_decode", 16, 64, 2048, 5, True, dict(bias=True)),  # one tile over ten programs
    ("abquant_fp8xfp8_rcr_decode", 2, 136, 640, 2, True, dict(bias=True)),  # group promotion
    ("bquant_bf16xi4_rcr_decode", 4, 64, 512, 1, True, dict()),             # int4 weight
]


@pytest.mark.parametrize("family,m,n,k,sms,swapped,extra", CASES)
def test_stream_k_matches_the_reference_and_the_plain_kernel(family, m, n, k, sms, swapped, extra, monkeypatch):
    spec = family_spec(parse_family(family), m, n, k)
    problem = make_args(spec, seed=5, **extra).call(build_problem)
    base = plan_mod.make_plan(problem.spec, problem.device, backend="triton")
    cfg = replace(base.config, split_k=1, swap_ab=swapped, block_m=64 if swapped else 16,
                  block_n=16 if swapped else 64, block_k=128, num_stages=2)
    counters = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setattr(buffers, "tile_counters", lambda device, count: counters[:count])
    monkeypatch.setattr(launch, "_sm_count", lambda device, interpreted: sms)
    p = plan_mod.with_config(base, replace(cfg, stream_k=True))
    streamed = launch.GemmLaunch(problem, p)
    plain = launch.GemmLaunch(problem, plan_mod.with_config(base, cfg))
    tiles = streamed.counters
    units = tiles * -(-k // 128)
    assert streamed.main.grid[0] == min(units, 2 * sms) and streamed.reduce is None
    a = problem.a.data if hasattr(problem.a, "packed_dim") else problem.a
    b = problem.b.data if hasattr(problem.b, "packed_dim") else problem.b
    args = (a, b, problem.a_scale, problem.b_scale, problem.bias, problem.acc)
    y = streamed(*args, torch.full((m, n), float("nan"), dtype=spec.out_dtype))
    assert torch.all(counters == 0)  # each shared tile's last program put its counter back
    check_close(y, gemm_ref(problem), spec.out_dtype)
    # The same sum cut at other places: equal to the unsplit kernel within the sum's rounding.
    torch.testing.assert_close(y.float(), plain(*args, None).float(), rtol=2e-2, atol=2e-2)
    again = streamed(*args, None)
    assert torch.equal(y, again)  # program order, not arrival order: the same bits every run
    assert "_stk" in p.instance.name and "stream-K" in p.describe()


def test_stream_k_config_tag_and_legality():
    cfg = TileConfig(64, 16, 256, 4, 4, stream_k=True, swap_ab=True)
    assert cfg.tag == "m64n16k256_w4_s4_stk_swap"
    assert TileConfig.parse_tag(cfg.tag) == cfg
    spec = family_spec(parse_family("rowcol_i8xi8_rcr_decode"), 1, 4096, 4096)
    assert config_problem(spec, cfg, get_arch("sm_90")) is None
    assert "split_k 1" in config_problem(spec, replace(cfg, split_k=2), get_arch("sm_90"))
    with pytest.raises(ValueError):
        TileConfig.parse_tag("m64n16k256_w4_s4_sk2_stk")


def test_stream_k_programs_follow_shared_memory():
    arch = get_arch("sm_90")
    spec = family_spec(parse_family("rowcol_i8xi8_rcr_decode"), 1, 4096, 4096)
    small = TileConfig(64, 16, 256, 4, 4, stream_k=True, swap_ab=True)  # 80 KB: two per SM
    big = TileConfig(64, 16, 512, 4, 6, stream_k=True, swap_ab=True)    # 240 KB would not fit twice
    assert launch.stream_k_programs(spec, small, arch, 132, 10**6) == 264
    assert launch.stream_k_programs(spec, replace(big, num_stages=3), arch, 132, 10**6) == 132
    assert launch.stream_k_programs(spec, small, arch, 132, 100) == 100  # one unit each at most
