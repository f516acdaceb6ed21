"""Tuned tables: hits show in explain, misses use the heuristic, bad tables are refused."""

import json

import pytest
import torch

from tileq.dispatch import tuned
from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.dispatch.plan import _gemm_cached, make_plan

FAM = parse_family("rowcol_i8xi8_rcr_decode")


def table(**over):
    doc = {"gpu": "NVIDIA H200", "capability": [9, 0], "arch": "sm_90", "date": "2026-11-29",
           "triton": "3.6.0", "torch": "2.11.0", "command": "tileq tune --out t.json",
           "entries": {"rowcol_i8xi8_rcr_decode|m4|n5120|k5120": {"config": "m16n32k512_w4_s4"}}}
    doc.update(over)
    return doc


@pytest.fixture
def use_table(tmp_path, monkeypatch):
    def install(doc):
        path = tmp_path / "t.json"
        path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
        monkeypatch.setenv("TILEQ_TUNED_TABLES", str(path))
        monkeypatch.setattr(tuned, "_shipped_tables", lambda: [])  # only the table under test
        tuned.clear_cache()
        _gemm_cached.cache_clear()
        return path
    yield install
    tuned.clear_cache()
    _gemm_cached.cache_clear()


def plan_for(m, n=5120, k=5120):
    return make_plan(family_spec(FAM, m, n, k), torch.device("cuda"), backend="triton", arch="sm_90")


def test_hit_and_neighbouring_bucket(use_table):
    use_table(table())
    p = plan_for(3)  # bucket 4: exact hit
    assert p.config.tag == "m16n32k512_w4_s4" and p.route.config_source == "table: t.json"
    assert "[table: t.json]" in p.describe()
    p = plan_for(8)  # bucket 8 not tuned: borrows bucket 4
    assert p.config.tag == "m16n32k512_w4_s4" and "M bucket 4" in p.route.config_source
    p = plan_for(40)  # borrows bucket 4 but needs an M tile covering 40 rows
    assert p.config.block_m == 64


def test_miss_uses_heuristic(use_table):
    use_table(table())
    assert plan_for(1, n=4096).route.config_source == "heuristic"
    assert plan_for(1024).route.config_source in ("heuristic",) or plan_for(1024).route.pipeline == "prefill"



def test_the_tables_switch_keys_the_plan(use_table, tmp_path, monkeypatch):
    """TILEQ_TUNED_TABLES reaches the planner through settings.current() and is part of the plan
    cache's key: a new value takes effect on the next plan, with no cache to clear."""
    use_table(table())
    assert plan_for(3).route.config_source == "table: t.json"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(table(entries={})))
    monkeypatch.setenv("TILEQ_TUNED_TABLES", str(other))
    assert plan_for(3).route.config_source == "heuristic"

@pytest.mark.parametrize("doc,reason", [
    ("{not json", "Expecting property name"),
    (table(entries={"rowcol_i8xi8_rcr_decode|m4|n5120|k5120": "m16n32"}), "config tag"),
    (table(entries={"bad-key": "m16n32k512_w4_s4"}), "family\\|m<bucket>"),
    ({"gpu": "x"}, "missing fields"),
    (table(arch="sm_80", capability=[8, 0]), "made for sm_80"),
])
def test_bad_tables_are_refused_with_a_warning(use_table, doc, reason):
    use_table(doc)
    with pytest.warns(UserWarning, match=reason):
        p = plan_for(3)
    assert p.route.config_source == "heuristic"


def test_illegal_entry_is_not_used(use_table):
    # BK=512 does not divide group_k=128: the legality predicate rejects the entry.
    fam = parse_family("abquant_fp8xfp8_rcr_decode")
    doc = table(entries={"abquant_fp8xfp8_rcr_decode|m4|n5120|k5120": "m16n32k512_w4_s4"})
    use_table(doc)
    p = make_plan(family_spec(fam, 4, 5120, 5120), torch.device("cuda"), backend="triton", arch="sm_90")
    assert p.route.config_source == "heuristic" and p.config.block_k <= 128


def test_shipped_h200_table_is_valid():
    paths = tuned._shipped_tables()
    assert any(p.name == "sm_90_h200.json" for p in paths)
    for p in paths:
        doc = json.loads(p.read_text())
        entries = tuned.parse_table(doc, str(p))
        assert entries and doc["gpu"] and doc["command"] and doc["triton"]
