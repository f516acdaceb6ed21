"""tileq e2e's CPU-checkable parts: refusal without a GPU, config parsing, the model build and
quantization on a small model, the report's table."""

import argparse

import pytest
import torch

import tileq.cli
from tileq.bench import e2e

pytest.importorskip("transformers")


def test_e2e_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert tileq.cli.main(["e2e", "--layers", "1"]) == 2
    assert "tileq e2e: expected a CUDA GPU" in capsys.readouterr().err


def test_quantize_model_variants_on_a_small_model():
    model = e2e.build_model(1, torch.device("cpu"), seed=0, small=True)
    assert model.config.hidden_size == 640 and next(model.parameters()).dtype == torch.bfloat16
    assert e2e.quantize_model(model, "bf16", fuse=False) == "bf16 (unquantized)"
    line = e2e.quantize_model(model, "A8W8:fused", fuse=False)
    assert line.startswith("7 layers quantized, 1 kept") and "fused decoder layers: 1" in line
    ids = torch.randint(0, 4096, (1, 5))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_report_table(monkeypatch):
    rows = [dict(config="bf16", layers=2, metric="ttft_eager_ms", batch=1, value=40.0, setup="bf16"),
            dict(config="bf16", layers=2, metric="tpot_graph_ms", batch=1, value=10.0, setup="bf16"),
            dict(config="bf16", layers=2, metric="tpot_eager_ms", batch=1, value=60.0, setup="bf16"),
            dict(config="bf16", layers=2, metric="host_ms_eager", batch=1, value=55.0, setup="bf16"),
            dict(config="A8W8", layers=2, metric="ttft_eager_ms", batch=1, value=30.0, setup="q",
                 logits_cos=0.999, top1_match=1.0),
            dict(config="A8W8", layers=2, metric="tpot_graph_ms", batch=1, value=5.0, setup="q"),
            dict(config="A8W8", layers=2, metric="tpot_eager_ms", batch=1, value=63.0, setup="q"),
            dict(config="A8W8", layers=2, metric="host_ms_eager", batch=1, value=62.0, setup="q"),
            dict(config="A8W8", layers=2, metric="decode_kernels", batch=1, value=99, setup="q"),
            dict(config="A8W8", layers=2, metric="quant_share", batch=1, value=0.05, setup="q")]
    args = argparse.Namespace(layers=2, small=False, prompt=512, tokens=128, eager_tokens=32, fuse=False,
                              configs=["bf16", "A8W8"], batches=[1], modes=["graph", "eager"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "no GPU")  # the header names the GPU
    md = e2e.report(rows, args)
    # modes in their fixed order (eager, compile, graph); the graph mode compiles, so TTFT compile is a column
    assert "| config | TTFT eager b1 ms | x bf16 | TTFT compile b1 ms | x bf16 | TPOT eager b1 ms | x bf16 | " \
           "TPOT graph b1 ms | x bf16 | host ms/step eager b1 |" in md
    assert "| A8W8 | 30.00 | 0.75 | - | - | 63.00 | 1.05 | 5.00 | 0.50 | 62.00 | 5.0% | 99 |" in md
    assert "| bf16 | 40.00 | 1.00 | - | - | 60.00 | 1.00 | 10.00 | 1.00 | 55.00 |" in md


def test_cache_holds_every_step():
    """The static cache of one measure_tpot call is sized for every step the modes take."""
    assert e2e.cache_steps(128, 32, ["eager"]) == e2e.WARM_STEPS + 32
    assert e2e.cache_steps(128, 32, ["eager", "compile", "graph"]) == 2 * e2e.WARM_STEPS + 32 + 32 + 2 + 128


def test_checkpoint_models_for_e2e(tmp_path):
    """tileq e2e --checkpoint: the quantized model comes from tileq.from_pretrained, the baseline is
    the bf16 model its config.json describes."""
    import tileq
    from tileq.nn import QuantLinear

    model = e2e.build_model(1, torch.device("cpu"), seed=0, small=True)
    tileq.quantize_(model, tileq.A8W8Config())
    tileq.save_pretrained(model, tmp_path / "ckpt")
    loaded, how = e2e.load_checkpoint(str(tmp_path / "ckpt"), torch.device("cpu"), fuse=True)
    assert "fused decoder layers: 1" in how
    assert isinstance(loaded.model.layers[0].mlp.down_proj, QuantLinear)
    dense = e2e.dense_like(str(tmp_path / "ckpt"), torch.device("cpu"), seed=0)
    assert isinstance(dense.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert next(dense.parameters()).dtype == torch.bfloat16


def test_kernel_categories_name_every_tileq_gemm_kernel():
    """The profiler breakdown counts every tileq GEMM kernel (Triton, Gluon, int4 decode and
    prefill, the dequantize kernel of the int4 prefill path) as tileq_gemm."""
    for name in ("_gemm_kernel", "_splitk_reduce_kernel", "_ws_gemm_kernel", "_i4p_kernel",
                 "_i4p_prefill_kernel", "_dequant_kernel"):
        assert e2e._category(name) == "tileq_gemm", name
    assert e2e._category("_rmsnorm_quant_kernel") == "act_quant"
    assert e2e._category("nvjet_hsh_128x256") == "other_matmul"


def test_make_checkpoint_writes_one_folder_per_config(tmp_path, capsys):
    """tileq e2e --make-checkpoint: the e2e model (1/8 width here) quantized per config and saved
    into DIR/<config>, each loadable by tileq.from_pretrained (what e2e --checkpoint times)."""
    from tileq.nn import QuantLinear

    assert tileq.cli.main(["e2e", "--make-checkpoint", str(tmp_path), "--small", "--layers", "1",
                           "--configs", "A8W8,W4A16"]) == 0
    out = capsys.readouterr().out
    assert "[make-checkpoint] A8W8:" in out and "[make-checkpoint] 2 checkpoint(s)" in out
    for name in ("A8W8", "W4A16"):
        assert (tmp_path / name / "config.json").exists()
        model, _ = e2e.load_checkpoint(str(tmp_path / name), torch.device("cpu"), fuse=False)
        assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert tileq.cli.main(["e2e", "--make-checkpoint", str(tmp_path), "--configs", "A8W8:fused"]) == 2
    assert "without ':fused'" in capsys.readouterr().err
