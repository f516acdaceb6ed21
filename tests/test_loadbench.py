"""tileq loadbench on a CPU: the whole command end to end on e2e's 1/8-width model (every load in a
fresh process, times only), the checkpoint it writes against what save_pretrained writes, and the
summary's ratios and target marks on made-up GPU results."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import tileq.cli
from tileq.bench import e2e, load

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.transformers, pytest.mark.one_release]  # the loader is tested on both: test_hf_quantizer.py


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_loadbench_end_to_end_on_cpu(tmp_path, capsys):
    """bf16, bf16 + quantize_ and on-load of one checkpoint, one fresh process each (about 30 s on
    a 2-core machine: most of it is three Python processes importing torch and transformers)."""
    out, work = tmp_path / "out", tmp_path / "work"
    rc = tileq.cli.main(["loadbench", "--small", "--layers", "1", "--configs", "A8W8", "--repeats", "1",
                         "--device", "cpu", "--workdir", str(work), "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    rows = {r["mode"]: r for r in _rows(out / "results.csv")}
    assert set(rows) == set(load.MODES)
    for r in rows.values():
        assert (r["model"], r["layers"], r["device"], r["error"]) == ("qwen3-14b", "1", "cpu", "")
        assert float(r["load_s"]) > 0 and r["peak_bytes"] == "" and r["peak_over_resident"] == ""
        assert r["torch"] == torch.__version__ and r["transformers"] == transformers.__version__
    assert rows["bf16"]["config"] == "bf16" and float(rows["bf16"]["time_over_bf16"]) == 1.0
    bf16, after, on_load = rows["bf16"], rows["bf16+quantize_"], rows["on-load"]
    assert after["config"] == on_load["config"] == "A8W8"
    # quantizing on load gives the model quantize_ gives: the same layers, the same bytes, fewer than bf16's
    assert on_load["resident_bytes"] == after["resident_bytes"]
    assert int(on_load["resident_bytes"]) < int(bf16["resident_bytes"])
    assert on_load["quantized_modules"] == after["quantized_modules"] == "7"  # 4 attention + 3 MLP linears
    # the CSV holds 4 decimals: the ratio of the rounded times differs from the written ratio by their rounding
    t_on, t_bf = float(on_load["load_s"]), float(bf16["load_s"])
    slack = t_on / t_bf * (5e-5 / t_on + 5e-5 / t_bf) + 5e-5
    assert float(on_load["time_over_bf16"]) == pytest.approx(t_on / t_bf, abs=slack)
    # the checkpoint this run wrote is gone (disk room), the workdir it was asked for stays
    assert work.is_dir() and not any(work.iterdir())
    md = (out / "report.md").read_text()
    assert "| 1 | A8W8 |" in md and "page cache warm" in md and "tileq loadbench --layers 1" in md
    assert stdout.strip().splitlines()[-1].startswith("| 1 | A8W8 |")  # the table, last
    assert "run 3/3: on-load A8W8" in stderr  # progress: which child is running


@pytest.mark.parametrize("model", ["qwen3-14b", "qwen3-moe"])
def test_checkpoint_holds_what_save_pretrained_writes(tmp_path, model):
    """Written shard by shard without building the model, yet the same tensors (names, shapes,
    dtypes: the MoE experts one tensor per expert) and config as save_pretrained's, one shard per
    layer; a second call reuses it."""
    from safetensors import safe_open

    def tensors(folder):
        found = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                found.update({k: (tuple(st.get_slice(k).get_shape()), st.get_slice(k).get_dtype()) for k in st.keys()})
        return found

    path, written = load.ensure_checkpoint(tmp_path, model, 2, small=True, seed=0)
    assert written and path.name == f"{model}-2layers-small"
    net = e2e.build_model(2, torch.device("cpu"), seed=0, small=True, model=model)
    net.save_pretrained(tmp_path / "reference")
    assert tensors(path) == tensors(tmp_path / "reference")
    assert len(list(path.glob("*.safetensors"))) == 2 + 2  # embeddings, each layer, norm + head
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors(path))
    ours, theirs = (json.loads((p / "config.json").read_text()) for p in (path, tmp_path / "reference"))
    assert ours == theirs
    assert load.ensure_checkpoint(tmp_path, model, 2, small=True, seed=0) == (path, False)
    assert load.ensure_checkpoint(tmp_path, model, 2, small=True, seed=1)[1]  # other weights: rewritten


def test_random_tensors_repeat_a_pool_of_normal_values():
    pool = load.random_pool(0)
    t = load.random_tensor((3, load.FILL_BLOCK), torch.bfloat16, pool)
    assert t.dtype == torch.bfloat16 and torch.equal(t[0], t[1]) and torch.equal(t[1], t[2])
    assert 0.015 < t[0].float().std().item() < 0.025
    assert not torch.equal(load.random_tensor((4, 8), torch.bfloat16, pool), load.random_tensor((4, 8), torch.bfloat16, pool))  # own starts
    assert torch.equal(load.random_tensor((7,), torch.bfloat16, pool), torch.ones(7, dtype=torch.bfloat16))


def _run(mode, config, load_s, peak, resident, repeat=0, **extra):
    return dict(model="qwen3-14b", layers=8, mode=mode, config=config, repeat=repeat, load_s=load_s,
                peak_bytes=peak, allocated_bytes=resident, resident_bytes=resident, quantized_modules=0,
                device_name="NVIDIA H100 80GB HBM3", torch="2.11", transformers="5.17", tileq="0.1.0", **extra)


def test_summary_ratios_and_targets_on_gpu_results(tmp_path):
    """Median time, largest peak, the ratios against the same layers' bf16 load, and the targets
    marked: what a GPU run reports, from made-up child results."""
    gb = 10**9
    runs = [_run("bf16", "bf16", 10.0, 16 * gb, 16 * gb), _run("bf16", "bf16", 12.0, 16 * gb, 16 * gb, 1),
            _run("bf16+quantize_", "A8W8", 20.0, 17 * gb, 8 * gb), _run("bf16+quantize_", "A8W8", 22.0, 17 * gb, 8 * gb, 1),
            _run("on-load", "A8W8", 13.0, 9 * gb, 8 * gb), _run("on-load", "A8W8", 14.0, 8.8 * gb, 8 * gb, 1),
            _run("bf16+quantize_", "W4A16", 30.0, 17 * gb, 4 * gb),
            _run("on-load", "W4A16", 18.0, 5 * gb, 4 * gb), dict(_run("on-load", "W4A16", 0, 0, 0, 1), error="boom")]
    rows = load.summarize(runs)
    by = {(r["config"], r["mode"]): r for r in rows}
    a8 = by["A8W8", "on-load"]
    assert a8["load_s"] == 13.5 and a8["peak_bytes"] == 9 * gb and a8["repeats"] == 2
    assert a8["time_over_bf16"] == pytest.approx(13.5 / 11.0) and a8["peak_over_resident"] == pytest.approx(9 / 8)
    w4 = by["W4A16", "on-load"]
    assert w4["error"] == "boom" and w4["repeats"] == 1 and w4["peak_over_resident"] == 1.25
    text = load.table(rows)
    assert "| 8 | A8W8 | 11.00 / 21.00 / 13.50 | 1.23 (met) | 16 / 17 / 9 | 16 / 8 | 1.12 (met) |" in text
    assert "| 8 | W4A16 | 11.00 / 30.00 / 18.00 | 1.64 (NOT met) | 16 / 17 / 5 | 16 / 4 | 1.25 (NOT met) |" in text
    load.write_csv(rows, tmp_path / "results.csv")
    got = {(r["config"], r["mode"]): r for r in _rows(tmp_path / "results.csv")}
    assert got["A8W8", "on-load"]["peak_over_resident"] == "1.1250" and got["A8W8", "on-load"]["load_s_runs"] == \
        "13.000;14.000"


def test_resident_bytes_counts_each_storage_once():
    net = torch.nn.Linear(8, 8, bias=False)
    net.register_buffer("view", net.weight.detach()[:2])  # a view of the weight: no bytes of its own
    net.register_buffer("own", torch.zeros(4))
    assert load.resident_bytes(net) == 8 * 8 * 4 + 4 * 4


def test_loadbench_refuses_a_missing_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert tileq.cli.main(["loadbench", "--device", "cuda", "--out", "unused"]) == 2
    assert "tileq loadbench: error: --device: expected cpu on a machine without a CUDA GPU, got 'cuda'" in \
        capsys.readouterr().err
