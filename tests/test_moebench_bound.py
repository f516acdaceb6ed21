"""tileq moebench's share of the byte bound (the GPU run's numbers need a GPU; the arithmetic and the
report do not)."""

import pytest

from tileq.bench import bound
from tileq.bench import moe as bench_moe


def test_bound_shapes_are_one_experts_gemvs():
    assert bench_moe.bound_shapes(["qwen3-30b-a3b", "deepseek-v3"]) == [(1536, 2048), (2048, 768), (4096, 7168),
                                                                        (7168, 2048)]
    # DeepSeek-V3's experts are 58.7 and 29.4 MB in bf16: Qwen3-30B-A3B's (6.3, 3.1 MB) are left out
    assert bound.bandwidth_shapes(bench_moe.bound_shapes(["qwen3-30b-a3b", "deepseek-v3"])) == [(4096, 7168),
                                                                                               (7168, 2048)]


def test_share_of_bound_in_rows_and_report(tmp_path):
    """bound = touched expert bytes / the bandwidth; share = bound / time, shown beside the TB/s."""
    rows = [{"model": "m", "tokens": 1, "routing": "uniform", "impl": "tileq A8W8", "us": 20.0, "experts_hit": 8,
             "touched_gb": 0.05, "tbps": 2.5, "rel_err": 0.01, "note": ""},
            {"model": "m", "tokens": 1, "routing": "uniform", "impl": "fp8 scaled_grouped_mm", "note": "absent"}]
    bench_moe.with_bound(rows, None)
    assert "share_of_bound" not in rows[0]
    bench_moe.with_bound(rows, 3.125e12)
    assert rows[0]["bound_us"] == pytest.approx(16.0) and rows[0]["share_of_bound"] == pytest.approx(0.8)
    assert "bound_us" not in rows[1]
    md = bench_moe.write(rows, tmp_path, ["# t"])
    assert "| experts hit | TB/s touched (share of bound) | rel err |" in md
    assert "| m | 1 | uniform | tileq A8W8 | 20.0 |  | 8 | 2.50 (80%) | 0.0100 |  |" in md
    assert "| m | 1 | uniform | fp8 scaled_grouped_mm |  |  |  |  |  | absent |" in md
    head = (tmp_path / "moe.csv").read_text().splitlines()
    assert "bound_us,share_of_bound" in head[0] and ",16.0,0.8," in head[1]
