"""tileq e2e's CPU-checkable parts: refusal without a GPU, config parsing, the model build and
quantization on a small model, the report's table, the gate before timing."""

import argparse
import csv
import os

import pytest
import torch

import tileq.cli
from tileq import settings
from tileq.bench import e2e
from tileq.errors import UnsupportedError

pytest.importorskip("transformers")

pytestmark = pytest.mark.transformers


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


def test_share_of_bound_in_the_rows_and_the_report(monkeypatch):
    """Each TPOT row gets the step's bytes (bound.step_bytes at its batch), its bound at the run's
    bandwidth and the share bound / TPOT; the report prints them per config beside bf16's."""
    from tileq.bench import bound

    model = _tiny_model(1, torch.device("cpu"), 0)
    args = argparse.Namespace(layers=1, small=False, prompt=8, tokens=4, eager_tokens=4, fuse=False, batches=[1, 4],
                              configs=["bf16", "A8W8"], modes=["eager", "graph"],
                              bandwidth=(2e12, "how it was measured"))
    assert e2e.bound_context(args) == 8 + e2e.cache_steps(4, 4, ["eager", "graph"]) // 2
    base = dict(config="bf16", layers=1, setup="bf16")
    rows = e2e.with_bound([dict(base, metric="ttft_eager_ms", batch=1, value=3.0),
                           dict(base, metric="tpot_graph_ms", batch=1, value=0.004),
                           dict(base, metric="tpot_graph_ms", batch=4, value=0.005)], model, base, args)
    want = {b: bound.step_bytes(model, batch=b, context_len=e2e.bound_context(args)) for b in (1, 4)}
    assert "step_bytes" not in rows[0]
    assert rows[1]["step_bytes"] == want[1]["total"] and rows[1]["bound_ms"] == pytest.approx(want[1]["total"] / 2e9)
    assert rows[2]["share_of_bound"] == pytest.approx(want[4]["total"] / 2e9 / 0.005)
    assert {(r["metric"], r["batch"]): r["value"] for r in rows[3:]} == {
        (f"step_bytes_{p}", b): v for b in (1, 4) for p, v in want[b].items()}

    quant = [dict(r, config="A8W8") for r in rows]
    for r in quant:
        if "share_of_bound" in r:
            r["value"] *= 0.5
            r["share_of_bound"] *= 2
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "no GPU")
    md = e2e.report(rows + quant, args)
    assert "2.00 TB/s, bf16 GEMV bandwidth: how it was measured" in md
    table = md.split("Decode step against its byte bound")[1]
    assert "| config | step GB b1 | bound ms b1 | share eager b1 | share graph b1 | step GB b4 |" in table
    share1, share4 = rows[1]["share_of_bound"], rows[2]["share_of_bound"]
    assert (f"| A8W8 | {want[1]['total'] / 1e9:.2f} (w {want[1]['weights'] / 1e9:.2f} + KV 0.00) | "
            f"{rows[1]['bound_ms']:.3f} | - | {2 * share1:.0%} ({share1:.0%}) |") in table
    assert f"| {share4:.0%} |" in table.splitlines()[4]  # bf16's own row, no brackets


def test_cache_holds_every_step():
    """The static cache of one measure_tpot call is sized for every step the modes take."""
    assert e2e.cache_steps(128, 32, ["eager"]) == e2e.WARM_STEPS + 32
    assert e2e.cache_steps(128, 32, ["eager", "compile", "graph"]) == 2 * e2e.WARM_STEPS + 1 + 32 + 32 + 2 + 128


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
    for name in ("_gemm_kernel", "_split_reduce_kernel", "_ws_gemm_kernel", "_i4p_kernel",
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


def test_parser_accepts_profile_host():
    from tileq.bench.cli import add_e2e

    parser = argparse.ArgumentParser()
    add_e2e(parser.add_subparsers(dest="cmd"))
    assert parser.parse_args(["e2e", "--profile-host"]).profile_host is True
    assert parser.parse_args(["e2e"]).profile_host is False  # off by default
    assert parser.parse_args(["e2e"]).compile_ttft is True
    assert parser.parse_args(["e2e", "--no-compile-ttft"]).compile_ttft is False


def test_report_without_the_compiled_ttft(monkeypatch):
    rows = [dict(config="bf16", layers=2, metric="ttft_eager_ms", batch=1, value=40.0, setup="bf16"),
            dict(config="bf16", layers=2, metric="tpot_graph_ms", batch=1, value=10.0, setup="bf16")]
    args = argparse.Namespace(layers=2, small=False, prompt=512, tokens=128, eager_tokens=32, fuse=False,
                              configs=["bf16"], batches=[1], modes=["graph"], compile_ttft=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "no GPU")
    md = e2e.report(rows, args)
    assert "| config | TTFT eager b1 ms | x bf16 | TPOT graph b1 ms | x bf16 |" in md
    assert "--no-compile-ttft`" in md


def _breakdown(config, prefix, ms):
    rows = [dict(config=config, layers=2, metric=f"{prefix}_kernel_ms_{cat}", batch=1, value=ms, setup="s")
            for cat in [c for c, _ in e2e.KERNEL_CATEGORIES] + ["other"]]
    return rows + [dict(config=config, layers=2, metric=f"{prefix}_kernels", batch=1, value=10, setup="s")]


def test_report_prints_the_compiled_prefill_table_only_with_its_rows(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "no GPU")
    args = argparse.Namespace(layers=2, small=False, prompt=512, tokens=128, eager_tokens=32, fuse=False,
                              configs=["bf16"], batches=[1], modes=["eager", "compile"])
    rows = [dict(config="bf16", layers=2, metric="tpot_eager_ms", batch=1, value=60.0, setup="bf16"),
            *_breakdown("bf16", "decode", 1.0), *_breakdown("bf16", "prefill", 2.0)]
    md = e2e.report(rows, args)
    assert "GPU kernel time of one eager prefill (512-token prompt)" in md
    assert "compiled prefill" not in md and "--profile-host" not in md
    args.profile_host = True
    md = e2e.report(rows + _breakdown("bf16", "prefill_compile", 0.5), args)
    assert "GPU kernel time of one compiled prefill (512-token prompt, --profile-host) at batch 1" in md
    assert "--profile-host`" in md
    table = md.split("compiled prefill")[1]
    assert "| bf16 | 0.50 | 0.50 | 0.50 | 0.50 | 0.50 | 2.50 |" in table
    assert md.count("| config | act_quant |") == 3


def test_write_host_profile_on_a_python_callable(tmp_path):
    calls = []

    def work():
        for _ in range(4):
            calls.append(sum(i * i for i in range(1000)))

    path = tmp_path / "host_profile" / "A8W8-fused_decode_eager.txt"
    ms = e2e.write_host_profile(work, path, "A8W8:fused: decode_eager", calls=4)
    assert ms > 0 and len(calls) == 8  # once timed, once under cProfile
    text = path.read_text()
    assert text.startswith("A8W8:fused: decode_eager\nwall ms per call (without the profiler): ")
    assert "over 4 calls" in text
    assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text
    assert "work" in text and "tottime" in text


def test_host_diagnostics_on_cpu(tmp_path, capsys):
    """--profile-host on a 1-layer 1/8-width model on the CPU: the compiled prefill's kernel breakdown
    needs CUDA and is reported missing; the host profiles (eager decode, and the compiled decode and
    prefill of a forward compiled with the eager backend) are written with their rows."""
    model = e2e.build_model(1, torch.device("cpu"), seed=0, small=True)
    prompt = torch.randint(0, 4096, (1, 8))
    base = dict(config="A8W8:fused", layers=1, setup="s")
    rows = e2e._host_diagnostics("A8W8:fused", model, prompt, None, base, tmp_path)
    assert [r["metric"] for r in rows] == ["host_profile_decode_eager_ms", "host_profile_prefill_eager_ms"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A8W8-fused_decode_eager.txt",
                                                          "A8W8-fused_prefill_eager.txt"]
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="eager")
    rows = e2e._host_diagnostics("A8W8:fused", model, prompt, compiled, base, tmp_path)
    assert [r["metric"] for r in rows] == ["host_profile_decode_compile_ms", "host_profile_decode_eager_ms",
                                           "host_profile_prefill_eager_ms", "host_profile_prefill_compile_ms"]
    assert all(r["value"] > 0 and r["batch"] == 1 for r in rows)
    for what in ("decode_compile", "decode_eager", "prefill_eager", "prefill_compile"):
        assert "wall ms per call (without the profiler)" in (tmp_path / f"A8W8-fused_{what}.txt").read_text()
    out = capsys.readouterr().out
    assert "[A8W8:fused] compiled prefill breakdown not measured" in out
    torch._dynamo.reset()


def test_host_profile_failure_is_reported(tmp_path, capsys, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(e2e, "profile_host", fail)
    assert e2e._host_diagnostics("bf16", None, None, None, dict(config="bf16"), tmp_path) == []
    assert "[bf16] host profile not measured: boom" in capsys.readouterr().out


def test_torchao_peer_unavailable_is_said_not_failed(monkeypatch, capsys):
    """A peer config where torchao does not import: PeerUnavailable before any model is built,
    and the run records it as unavailable (not an error row)."""
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name == "torchao" or name.startswith("torchao."):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(e2e.PeerUnavailable, match=r"torchao is not importable here .*pip install torchao"):
        e2e.torchao_config("torchao.FP8Row")
    called = []
    monkeypatch.setattr(e2e, "build_model", lambda *a, **k: called.append(1))
    args = argparse.Namespace(checkpoint=None, layers=1, small=True, seed=0, fuse=False, modes=["graph"])
    with pytest.raises(e2e.PeerUnavailable):
        e2e.run_config("torchao.A8W8", args, {}, None)
    assert not called


def test_peer_names_pass_the_config_check(monkeypatch):
    """--configs accepts the peers by name and refuses unknown ones, naming the peers."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = argparse.Namespace(model="qwen3-14b", layers=1, make_checkpoint=None, checkpoint=None,
                              configs=["torchao.nope"])
    with pytest.raises(UnsupportedError, match="torchao.FP8Row"):
        e2e.run(args)


def test_config_variants_with_switches(monkeypatch):
    """NAME@SWITCH=VALUE: the config's name and the tileq switches set while it is measured (put
    back after); anything but a tileq switch is refused before any work."""
    assert e2e.split_config("A8W8:fused") == ("A8W8:fused", {})
    assert e2e.split_config("A8W8:fused@TILEQ_QK_ROPE=0@TILEQ_PDL=0") == (
        "A8W8:fused", {"TILEQ_QK_ROPE": "0", "TILEQ_PDL": "0"})
    for bad in ("A8W8@PATH=/x", "A8W8@TILEQ_QK_ROPE", "A8W8@TRITON_INTERPRET=0"):
        with pytest.raises(UnsupportedError, match="SWITCH=VALUE"):
            e2e.split_config(bad)
    monkeypatch.setenv("TILEQ_PDL", "1")
    monkeypatch.delenv("TILEQ_QK_ROPE", raising=False)
    with e2e.switches({"TILEQ_QK_ROPE": "0", "TILEQ_PDL": "0"}):
        assert os.environ["TILEQ_QK_ROPE"] == "0" and os.environ["TILEQ_PDL"] == "0"
        assert settings.current().qk_rope is False
    assert "TILEQ_QK_ROPE" not in os.environ and os.environ["TILEQ_PDL"] == "1"
    with pytest.raises(UnsupportedError, match="TILEQ_QK_ROPE"):
        with e2e.switches({"TILEQ_QK_ROPE": "maybe"}):
            pass
    assert "TILEQ_QK_ROPE" not in os.environ


def test_compiled_step_agreement_starts_both_steps_from_one_cache_state():
    """The check behind the report's 'compiled step cos vs eager' column: the second callable runs
    from the cache state the eager step started from (same tensors), so the same forward agrees
    exactly; a forward that computes something else shows a lower cosine."""
    from transformers import StaticCache

    model = e2e.build_model(1, torch.device("cpu"), seed=0, small=True)
    cache = StaticCache(config=model.config, max_cache_len=16)
    ids = torch.randint(0, 4096, (1, 5))
    with torch.inference_mode():
        tok = e2e._prefill(model.forward, cache, ids)
        keys = cache.layers[0].keys
        cos, top1, nxt, floor = e2e.compiled_step_agreement(model, model.forward, cache, tok)
        assert cos == pytest.approx(1.0, abs=1e-6) and top1 == 1.0 and nxt.shape == (1, 1)
        assert 0.99 < floor < 1.0 - 1e-7  # the nudged input changes the logits, a little
        assert not e2e.disagrees(cos, floor)
        assert cache.layers[0].keys is keys and int(cache.layers[0].cumulative_length) == 6  # one step further

        def wrong(**kw):
            out = model.forward(**kw)
            out.logits = out.logits.flip(-1)
            return out

        cos, top1, _, floor = e2e.compiled_step_agreement(model, wrong, cache, nxt)
    assert cos < e2e.COMPILED_AGREEMENT_MIN and e2e.disagrees(cos, floor)


def test_disagreement_is_judged_against_the_rounding_floor():
    """A quantized model's compiled step may sit below 0.99 when its eager step is that sensitive to
    a last-bit change of its input (rounding amplified by the activation quantization); beyond
    FLOOR_FACTOR times that sensitivity, or below 0.99 with a tight floor, it computes something else."""
    assert not e2e.disagrees(0.9627, 0.96)  # a floor of 0.04 covers 0.037
    assert e2e.disagrees(0.9627, 0.999)  # bf16-like floor: 0.037 is far beyond it
    assert not e2e.disagrees(0.995, 0.9999)  # within 0.99 whatever the floor
    assert e2e.disagrees(0.80, 0.96)  # 0.20 > 4 x 0.04


def test_kernel_table_lists_kernels_longest_first(tmp_path):
    names = {"_gemm_kernel": (1.5, 4), "triton_poi_fused_add_0": (0.02, 4), "_add_rmsnorm_quantize_kernel": (0.2, 4)}
    path = tmp_path / "kernels" / f"{e2e._file_name('A8W8:fused@TILEQ_QK_ROPE=1')}_decode.csv"
    e2e.write_kernel_table(names, path)
    assert path.name == "A8W8-fused-TILEQ_QK_ROPE-1_decode.csv"  # no "=": not every copying tool takes it
    lines = path.read_text().splitlines()
    assert lines[0] == "category,ms,calls,us_per_call,kernel"
    assert [line.split(",")[0] for line in lines[1:]] == ["tileq_gemm", "act_quant", "other"]
    assert lines[1].split(",")[3] == "375.00"  # 1.5 ms over 4 calls


# ----------------------------------------------------------------------------- the gate


def _double_off_reference(module, inputs, output):
    """A layer whose kernel path computes twice its output (as a weight scale x2 would), while its
    reference backend stays right."""
    return output if settings.current().backend == "reference" else output * 2


def _fake_peer(model, name):
    """A stand-in for torchao's quantize_ (not installed here): every nn.Linear weight but lm_head's
    rounded to int8 steps per output channel, in place, still an nn.Linear."""
    n = 0
    for fqn, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in fqn:
            w = mod.weight.data.float()
            step = w.abs().amax(dim=1, keepdim=True) / 127
            mod.weight.data = (torch.round(w / step) * step).to(mod.weight.dtype)
            n += 1
    return f"fake {name}: {n} layers"


def _tiny_model(layers, device, seed, small=False, model="qwen3-14b"):
    """A Qwen3 narrower than --small's (the interpreter runs its kernels in seconds), e2e's vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=4096)
    cfg._attn_implementation = "sdpa"
    return e2e._bf16_model(lambda: Qwen3ForCausalLM(cfg), device, seed)


def test_gate_before_timing_on_cpu(tmp_path, monkeypatch, capsys):
    """The e2e loop on a tiny 1-layer model on the CPU, timing stubbed: A8W8 through the Triton kernels
    (the interpreter) passes its gate against its reference backend; W8A16 with one layer doubled on
    the kernel path only fails it, is not timed, shows as FAILED and makes the run exit 1; a peer (no
    reference) is judged against bf16, its bound widened by A8W8's deviation from bf16."""
    real_quantize = e2e.quantize_model

    def quantize(model, name, fuse):
        line = real_quantize(model, name, fuse)
        if name == "W8A16":
            model.model.layers[0].mlp.down_proj.register_forward_hook(_double_off_reference)
        return line

    timed = []

    def fake_time(model, label, args, prompts, base, agree, setup_s):
        timed.append(label)
        return [dict(base, metric="ttft_eager_ms", batch=1, value=1.0, **agree),
                dict(base, metric="tpot_eager_ms", batch=1, value=2.0)]

    monkeypatch.setattr(e2e, "build_model", _tiny_model)
    monkeypatch.setattr(e2e, "quantize_model", quantize)
    monkeypatch.setattr(e2e, "time_config", fake_time)
    monkeypatch.setattr(e2e, "torchao_config", lambda name: None)
    monkeypatch.setattr(e2e, "quantize_torchao", _fake_peer)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "no GPU")  # the report's header names the GPU
    args = argparse.Namespace(model="qwen3-14b", layers=1, small=True, seed=0, prompt=8, batches=[1], tokens=4,
                              eager_tokens=4, modes=["eager"], fuse=False, checkpoint=None, out=str(tmp_path),
                              configs=["torchao.A8W8", "A8W8@TILEQ_BACKEND=triton", "W8A16"])
    assert e2e.measure(args, torch.device("cpu")) == 1
    assert timed == ["bf16", "A8W8@TILEQ_BACKEND=triton", "torchao.A8W8"]  # bf16 first, peers last, W8A16 not timed

    with open(tmp_path / "e2e.csv") as f:
        gates = {r["config"]: r for r in csv.DictReader(f) if r["metric"] == "gate"}
    assert "bf16" not in gates  # the baseline
    ok, bad, peer = gates["A8W8@TILEQ_BACKEND=triton"], gates["W8A16"], gates["torchao.A8W8"]
    assert (ok["gate_baseline"], ok["gate"]) == ("reference", "pass")
    assert (bad["gate_baseline"], bad["gate"]) == ("reference", "FAILED")
    assert float(bad["gate_cos"]) < 0.99 and float(bad["logits_cos"]) < 0.99  # the numbers are reported
    assert (peer["gate_baseline"], peer["gate"]) == ("bf16", "pass")
    assert "2x the deviation from bf16 of A8W8@TILEQ_BACKEND=triton" in peer["gate_bound"]
    assert "no reference backend" in peer["gate_note"]

    with open(tmp_path / "e2e.csv") as f:  # the byte bound: step bytes counted, no bandwidth on a CPU
        tpots = {r["config"]: r for r in csv.DictReader(f) if r["metric"] == "tpot_eager_ms"}
    assert set(tpots) == {"bf16", "A8W8@TILEQ_BACKEND=triton", "torchao.A8W8"}
    assert all(float(r["step_bytes"]) > 0 and r["bound_ms"] == r["share_of_bound"] == "" for r in tpots.values())
    assert float(tpots["A8W8@TILEQ_BACKEND=triton"]["step_bytes"]) < float(tpots["bf16"]["step_bytes"])

    md = (tmp_path / "e2e.md").read_text()
    assert "n/a: needs a GPU" in md and "| bf16 | 0.0" in md.split("Decode step against its byte bound")[1]
    assert next(line for line in md.splitlines() if line.startswith("| bf16 | 1.00 | 1.00 |")).endswith("| baseline |")
    row = next(line for line in md.splitlines() if line.startswith("| W8A16 | - | - |"))
    assert row.endswith("| FAILED |")  # in the timing table, untimed
    gate_table = md.split("Gate (before timing")[1]
    assert "| W8A16 | reference | " in gate_table and "| FAILED |" in gate_table
    assert "| torchao.A8W8 | bf16 | " in gate_table and "cos >= " in gate_table
    out = capsys.readouterr().out
    assert "[e2e] W8A16: FAILED its gate: not timed" in out
    assert "FAILED their gate, not timed: W8A16" in out


def test_gate_bounds_widen_by_the_yardstick_only():
    """The fixed bound holds unless the yardstick's deviation, times its factor, is larger; NaN logits
    fail; a far-off config fails whatever the yardstick within reason."""
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(1, 512, generator=gen)
    near = want + 1e-4 * torch.randn(1, 512, generator=gen)
    far = want + 0.5 * torch.randn(1, 512, generator=gen)
    ref = e2e.GATE_BOUNDS["reference"]
    g = e2e.judge("reference", near, want, (1.0, 0.0), "a tight floor")
    assert g.passed and (g.min_cos, g.max_rel) == (ref.min_cos, ref.max_rel)
    g = e2e.judge("reference", far, want, (0.999, 0.01), "a tight floor")
    assert not g.passed and "4x a tight floor" in g.bound
    loose = e2e.logits_gap(far, want)
    g = e2e.judge("reference", far, want, (1 - (1 - loose[0]) / 2, loose[1] / 2), "a loose floor")
    assert g.passed and g.min_cos < ref.min_cos and g.max_rel > ref.max_rel
    nan = want.clone()
    nan[0, 3] = float("nan")
    assert not e2e.judge("reference", nan, want).passed
    assert not e2e.judge("bf16", want, nan).passed


def test_peer_gate_without_its_scheme_in_the_run():
    """A model without tileq layers is judged against bf16 with the fixed bf16 bound, and says why."""
    model = e2e.build_model(1, torch.device("cpu"), seed=0, small=True)
    prompt = torch.randint(0, 4096, (1, 6))
    bf16 = e2e.first_logits(model, prompt)
    _fake_peer(model, "torchao.A8W8")
    gate = e2e.gate_config("torchao.A8W8", model, prompt, e2e.first_logits(model, prompt), bf16, {"W4A16": (0.5, 1.0)})
    assert gate.baseline == "bf16" and gate.passed and gate.basis == "fixed"
    assert "no tileq A8W8 passed its gate" in gate.note
    gate = e2e.gate_config("torchao.A8W8", model, prompt, bf16, None, {})
    assert not gate.passed and "bf16's logits were not measured" in gate.note


def test_reference_logits_keep_the_kernel_paths_launches():
    """The reference run switches the backend on the same model and leaves each QuantLinear's kept
    launches as the kernel path made them (its tables set aside, not cleared); the reference runs
    with empty tables."""
    import tileq
    from tileq.nn import QuantLinear

    model = e2e.build_model(1, torch.device("cpu"), seed=0, small=True)
    tileq.quantize_(model, tileq.A8W8Config())
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    prompt = torch.randint(0, 4096, (1, 6))
    kept = [m._runners for m in layers]
    for m in layers:
        m._runners["marker"] = "kept"
    seen = []
    hook = layers[0].register_forward_hook(lambda m, i, o: seen.append((settings.current().backend, dict(m._runners))))
    ref, nudged = e2e.reference_logits(model, prompt)
    hook.remove()
    assert [b for b, _ in seen] == ["reference", "reference"] and all("marker" not in r for _, r in seen)
    assert all(m._runners is k and k["marker"] == "kept" for m, k in zip(layers, kept))
    assert not torch.equal(ref, nudged) and 0.99 < e2e.logits_cos(ref, nudged) < 1.0
    assert settings.current().backend == "auto"
