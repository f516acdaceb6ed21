"""tileq.moe (routing, token sorting, QuantExperts, fused_moe, the tileq::fused_moe op) and its
transformers integration (tileq.integrations.hf_moe) on tiny random models, CPU.

Exactness: through the reference backend ``fused_moe`` equals ``fused_moe_ref`` (a slot-by-slot
loop over ``tileq.linear``'s reference, no sorting, no grouped GEMM) bit for bit: every row's
result is a float64 dot product rounded the same way, whatever the grouping, and the combine sums
over k in the same order. Through the Triton kernels (interpreter) the grouped GEMM sums in fp32,
so gate_up may round one bf16 ulp differently: the tolerance is a few bf16 ulps of the output.
Against transformers' unquantized experts the difference is the 8-bit quantization error.
"""

import copy

import pytest
import torch

import tileq.nn as tnn
from tileq.errors import DTypeError, ShapeError, UnsupportedError
from tileq.moe import (
    MASKED_MAX_ROWS,
    QuantExperts,
    Routing,
    align,
    choose_form,
    fused_moe,
    fused_moe_ref,
    route,
    softmax_topk,
)

transformers = pytest.importorskip("transformers")

from tileq.integrations import hf_moe

pytestmark = pytest.mark.transformers

CONFIGS = ["A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A8"]


def _weights(e=5, h=256, i=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(e, 2 * i, h, generator=g) * 0.05).bfloat16()
    dn = (torch.randn(e, h, i, generator=g) * 0.05).bfloat16()
    return gu, dn


def _tokens(t, h=256, e=5, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids, w = softmax_topk(torch.randn(t, e, generator=g), k, normalize=True)
    return x, ids, w


# ----------------------------------------------------------------------------- fused_moe


@pytest.mark.parametrize("name", CONFIGS)
def test_fused_moe_equals_slot_by_slot_reference(name):
    ex = QuantExperts.from_weights(*_weights(), tnn.config_from_name(name))
    x, ids, w = _tokens(5)
    want = fused_moe_ref(x, ids, w, ex)
    assert want.float().std() > 0.05  # far above zero: the check below can fail
    for form in ("contiguous", "masked"):
        assert torch.equal(fused_moe(x, (ids, w), ex, form=form), want), form


def test_edge_routings():
    ex = QuantExperts.from_weights(*_weights(), tnn.FP8BlockConfig())
    x, ids, w = _tokens(4)
    cases = {
        "one token": (x[:1], ids[:1], w[:1]),
        "all to two experts": (x, torch.tensor([[3, 1]] * 4), w),  # experts 0, 2, 4 empty
        "k=1": (x, ids[:, :1], torch.ones(4, 1)),
        "bf16 weights": (x, ids, w.bfloat16()),
    }
    for what, (xx, ii, ww) in cases.items():
        want = fused_moe_ref(xx, ii, ww, ex)
        for form in ("contiguous", "masked"):
            assert torch.equal(fused_moe(xx, (ii, ww), ex, form=form), want), (what, form)
    empty = fused_moe(x[:0], (ids[:0], w[:0]), ex)
    assert empty.shape == (0, 256) and empty.dtype == torch.bfloat16


def test_router_logits_and_interpreter_kernels(monkeypatch):
    ex = QuantExperts.from_weights(*_weights(e=4, h=128, i=64), tnn.A8W8Config())
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(3, 128, generator=g).bfloat16(), torch.randn(3, 4, generator=g)
    routing = Routing("softmax", 2, True)
    ids, w = route(logits, routing)
    want = fused_moe_ref(x, ids, w, ex)
    assert torch.equal(fused_moe(x, logits, ex, routing=routing), want)
    # The Triton kernels (interpreter): quantization, grouped GEMMs, silu_mul_quantize.
    monkeypatch.setenv("TILEQ_BACKEND", "triton")
    for form in ("contiguous", "masked"):
        got = fused_moe(x, (ids, w), ex, form=form, backend="triton")
        assert (got.float() - want.float()).abs().max() <= 0.03 * want.float().abs().max(), form


def test_align_forms():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    c = align(ids, w, 4, form="contiguous")
    assert c.offsets.tolist() == [0, 2, 3, 6, 6] and c.offsets.dtype == torch.int32
    assert c.tokens.tolist() == [0, 2, 1, 0, 1, 2]  # stable: token order within an expert
    assert torch.equal(c.weights, torch.tensor([0.4, 0.9, 0.3, 0.6, 0.7, 0.1]))
    # slot (t, j) lands on the grouped row holding it
    assert [c.tokens[r].item() for r in c.slot_rows.tolist()] == [0, 0, 1, 1, 2, 2]
    m = align(ids, w, 4, form="masked")
    assert m.counts.tolist() == [2, 1, 3, 0] and m.capacity == 3
    assert m.dest.tolist() == [0, 1, 3, 6, 7, 8]  # expert e's rows at e * C + 0..counts[e]-1
    assert m.slot_rows.tolist() == [6, 0, 7, 3, 1, 8]


def test_align_traces_without_host_sync():
    # A data-dependent op (nonzero, .item(), .tolist(), bincount's size) breaks a fullgraph trace.
    ids, w = softmax_topk(torch.randn(5, 8), 3, normalize=False)
    for form in ("contiguous", "masked"):
        torch._dynamo.reset()
        fn = torch.compile(lambda i, x, f=form: align(i, x, 8, form=f).slot_rows, fullgraph=True, backend="eager")
        assert torch.equal(fn(ids, w), align(ids, w, 8, form=form).slot_rows)


def test_choose_form():
    assert choose_form(1, 128)[0] == "masked" and choose_form(MASKED_MAX_ROWS // 128, 128)[0] == "masked"
    assert choose_form(MASKED_MAX_ROWS // 128 + 1, 128)[0] == "contiguous"
    assert "MASKED_MAX_ROWS" in choose_form(4096, 256)[1]


def test_refusals():
    ex = QuantExperts.from_weights(*_weights(e=4, h=128, i=64), tnn.A8W8Config())
    x, ids, w = _tokens(3, h=128, e=4)
    with pytest.raises(ShapeError, match=r"hidden_states: expected a 2-D tensor \[T, H\] with H=128"):
        fused_moe(x[:, :64], (ids, w), ex)
    with pytest.raises(DTypeError, match="hidden_states: expected dtype bfloat16 or float16"):
        fused_moe(x.float(), (ids, w), ex)
    with pytest.raises(ShapeError, match=r"topk_ids: expected a 2-D tensor \[T, k\] with T=3"):
        fused_moe(x, (ids[:2], w[:2]), ex)
    with pytest.raises(UnsupportedError, match="routing: expected a tileq.moe.Routing"):
        fused_moe(x, torch.randn(3, 4), ex)
    with pytest.raises(UnsupportedError, match="form: expected one of"):
        fused_moe(x, (ids, w), ex, form="dense")
    with pytest.raises(UnsupportedError, match="experts: expected a tileq.moe.QuantExperts"):
        fused_moe(x, (ids, w), torch.nn.Linear(2, 2))
    with pytest.raises(ShapeError, match=r"down_proj: expected shape \[E, H, I\]"):
        QuantExperts.from_weights(torch.randn(2, 8, 16), torch.randn(2, 16, 3), tnn.A8W8Config())
    with pytest.raises(UnsupportedError, match="must be even"):
        QuantExperts.from_weights(torch.randn(2, 6, 16), torch.randn(2, 16, 3), tnn.W4A16Config())


def test_state_dict_round_trip():
    for name in ("FP8Block", "W4A8"):
        ex = QuantExperts.from_weights(*_weights(e=3, h=128, i=64), tnn.config_from_name(name))
        sd = ex.state_dict()
        assert sorted(sd) == ["down_proj", "down_proj_scale", "gate_up_proj", "gate_up_proj_scale"]
        fresh = QuantExperts(3, 128, 64, config=tnn.config_from_name(name))
        fresh.load_state_dict(sd)
        assert all(torch.equal(fresh.state_dict()[k].view(torch.uint8) if v.dtype.itemsize == 1 else
                               fresh.state_dict()[k], v.view(torch.uint8) if v.dtype.itemsize == 1 else v)
                   for k, v in sd.items())
        x, ids, w = _tokens(2, h=128, e=3)
        assert torch.equal(fused_moe(x, (ids, w), fresh), fused_moe(x, (ids, w), ex))
    bad = dict(sd, gate_up_proj=sd["gate_up_proj"].to(torch.int8) if sd["gate_up_proj"].dtype != torch.int8 else sd["gate_up_proj"].float())
    with pytest.raises(DTypeError, match="gate_up_proj: expected dtype torch.uint8"):
        fresh.load_state_dict(bad)
    moved = fresh.to(torch.float16)  # a float cast changes the compute dtype, never the stored weights
    assert moved.dtype == torch.float16 and moved.gate_up_proj.dtype == torch.uint8


def test_opcheck_and_fullgraph():
    from tileq.moe.layer import fused_moe_op

    # int8 weights: opcheck compares the inputs before and after, which CPU fp8 cannot
    ex = QuantExperts.from_weights(*_weights(e=4, h=128, i=128), tnn.A8W8Config())
    x, ids, w = _tokens(3, h=128, e=4)
    args = (x, ids, w, ex.gate_up_proj, ex.gate_up_proj_scale, ex.down_proj, ex.down_proj_scale, ex.spec.key,
            "auto", "")
    torch.library.opcheck(fused_moe_op.op, args)  # a tileq.ops.TileqOp: its OpOverload
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    routing = Routing("softmax", 2, True, "logits")
    logits = torch.randn(3, 4)
    compiled = torch.compile(lambda h, lg: fused_moe(h, lg, ex, routing=routing), fullgraph=True, backend=backend)
    assert torch.equal(compiled(x, logits), fused_moe(x, logits, ex, routing=routing))
    assert "tileq.fused_moe_inline.default" in seen  # the op through its inline twin (tileq.ops)


# ----------------------------------------------------------------------------- transformers


TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "max_position_embeddings": 64}


def _model(family, layers=2):
    torch.manual_seed(0)
    tiny = {**TINY, "num_hidden_layers": layers}
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**tiny, intermediate_size=256, moe_intermediate_size=128, head_dim=32,
                                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**tiny, intermediate_size=256, moe_intermediate_size=128,
                                          shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**tiny, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV3Config(**{**tiny, "num_key_value_heads": 4}, intermediate_size=256,
                                            moe_intermediate_size=128, first_k_dense_replace=1, n_routed_experts=8,
                                            n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                                            q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                            v_head_dim=32)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def _ids(seed=1):
    return torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(seed))


def _routers(model):
    return [m for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_routing_matches_transformers(family):
    model = _model(family)
    routers = _routers(model)
    assert routers
    g = torch.Generator().manual_seed(2)
    for router in routers:
        with torch.no_grad():
            # non-zero router weights (some init to zeros) and correction bias: real top-k choices
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
            bias = getattr(router, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.1)
            hidden = torch.randn(9, 128, generator=g).bfloat16()
            logits, want_w, want_ids = router(hidden)
        ids, w = route(logits, Routing.of(router), bias)
        assert torch.equal(ids, want_ids) and torch.equal(w, want_w) and w.dtype == want_w.dtype


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_quantized_model_vs_bf16(family):
    model = _model(family)
    quant = copy.deepcopy(model)
    summary = tnn.quantize_(quant, tnn.A8W8Config())
    experts = [n for n, _ in summary.experts]
    assert experts == [n for n, m in model.named_modules() if hf_moe.is_experts_module(m)] and experts
    assert f"experts {experts[0]}: 8 experts" in str(summary)
    mod = quant.get_submodule(experts[0])
    assert isinstance(mod, QuantExperts) and isinstance(mod, type(model.get_submodule(experts[0])))
    assert quant.config._experts_implementation == "tileq"
    x = _ids()
    with torch.no_grad():
        want, got = model(x).logits.float(), quant(x).logits.float()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos >= 0.99, cos


def test_moe_block_vs_eager_experts():
    # One sparse MoE block: tileq's experts against transformers' eager loop on the same routing.
    model = _model("qwen3_moe")
    block = model.model.layers[0].mlp
    eager = copy.deepcopy(block.experts)
    eager.config = copy.deepcopy(eager.config)
    eager.config._experts_implementation = "eager"
    q = hf_moe.convert(block.experts, tnn.A8W8Config())
    hidden = torch.randn(6, 128).bfloat16()
    with pytest.raises(UnsupportedError, match=r"config._experts_implementation: expected 'tileq'.*got 'grouped_mm'"):
        q(hidden, *block.gate(hidden)[:0:-1])
    q.config = copy.deepcopy(q.config)
    q.config._experts_implementation = "tileq"
    hidden = torch.randn(6, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.no_grad():
        _, w, ids = block.gate(hidden)
        want = eager(hidden, ids, w).float()
        got = q(hidden, ids, w).float()
    err = (got - want).norm() / want.norm()
    assert want.abs().max() > 1e-3 and err < 0.05, err


def test_summary_filter_and_unconverted_module_runs_eager():
    model = _model("qwen2_moe")
    ref = copy.deepcopy(model)
    keep = "model.layers.1.mlp.experts"
    summary = tnn.quantize_(model, tnn.W8A16Config(), filter_fn=lambda m, n: n != keep)
    assert [n for n, _ in summary.experts] == ["model.layers.0.mlp.experts"]
    assert (keep, "filter_fn returned False") in summary.skipped
    assert not isinstance(model.get_submodule(keep), QuantExperts)
    # Under 'tileq' the kept module runs transformers' eager loop on its bf16 weights.
    hidden = torch.randn(5, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        _, w, ids = gate(hidden)
        ref_mod = ref.get_submodule(keep)
        ref_mod.config._experts_implementation = "eager"
        assert torch.equal(model.get_submodule(keep)(hidden, ids, w), ref_mod(hidden, ids, w))


def test_experts_refusal_reasons():
    model = _model("qwen3_moe")
    mod = model.model.layers[0].mlp.experts
    assert hf_moe.experts_refusal(mod) is None
    mod.is_transposed = True
    assert "is_transposed=True" in hf_moe.experts_refusal(mod)
    mod.is_transposed = False
    mod.act_fn = torch.nn.GELU()
    assert "activation GELU" in hf_moe.experts_refusal(mod)
    skipped = []
    assert hf_moe.quantize_experts_(model, tnn.A8W8Config(), skipped=skipped) == [("model.layers.1.mlp.experts",
                                                                                     hf_moe.describe(model.model.layers[1].mlp.experts))]
    assert skipped == [("model.layers.0.mlp.experts", "activation GELU (tileq's experts compute SiLU)")]


def test_compiled_model_fullgraph():
    torch._dynamo.reset()
    model = _model("qwen3_moe", layers=1)
    tnn.quantize_(model, tnn.A8W8Config())
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x = _ids()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        assert torch.equal(compiled(x).logits, model(x).logits)
    assert "tileq.fused_moe_inline.default" in seen  # the op through its inline twin (tileq.ops)


# ----------------------------------------------------------------------------- tileq moebench


def test_moebench_options_and_dry_run(capsys, tmp_path):
    from tileq.bench import cli as bench_cli
    from tileq.bench import moe as bench_moe
    from tileq.cli import build_parser, main

    assert bench_cli.MOEBENCH_MODELS == tuple(bench_moe.MODELS) and bench_cli.MOEBENCH_TOKENS == bench_moe.TOKENS
    assert bench_cli.MOEBENCH_ROUTINGS == bench_moe.ROUTINGS and bench_cli.MOEBENCH_CONFIGS == bench_moe.CONFIGS
    assert bench_cli.MOEBENCH_BASELINES == bench_moe.BASELINES and bench_cli.MOEBENCH_FORMS == bench_moe.FORMS
    from tileq.moe.layer import FORMS

    assert bench_moe.FORMS == FORMS
    args = build_parser().parse_args(["moebench", "--models", "deepseek-v3", "--tokens", "1,16", "--configs", "A8W8"])
    assert (args.models, args.tokens, args.configs, args.routings) == (["deepseek-v3"], [1, 16], ["A8W8"],
                                                                      ["uniform", "skewed"])
    assert main(["moebench", "--configs", "W3A3"]) == 2
    assert "--configs" in capsys.readouterr().err
    assert main(["moebench", "--dry", "--models", "qwen3-30b-a3b", "--routings", "skewed", "--configs", "A8W8,W4A16",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    errs = {line.split(":")[0]: float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "rel err" in line}
    assert set(errs) == {"dry skewed tileq A8W8", "dry skewed tileq W4A16", "dry skewed bf16 grouped_mm"}
    assert errs["dry skewed tileq A8W8"] < 0.05 and errs["dry skewed tileq W4A16"] < bench_moe.TOLERANCE["int4"]


def test_moebench_write(tmp_path):
    from tileq.bench.moe import write

    rows = [{"model": "m", "tokens": 1, "routing": "uniform", "impl": "bf16 grouped_mm", "us": 10.0, "vs_bf16": 1.0,
             "experts_hit": 8, "touched_gb": 0.1, "tbps": 1.0, "rel_err": 0.0, "note": ""},
            {"model": "m", "tokens": 1, "routing": "uniform", "impl": "fp8 scaled_grouped_mm", "note": "absent"}]
    md = write(rows, tmp_path, ["# t"])
    assert "| m | 1 | uniform | fp8 scaled_grouped_mm |  |  |  |  |  | absent |" in md
    assert (tmp_path / "moe.csv").read_text().splitlines()[0].startswith("model,tokens,routing,impl,us")


def test_quantized_model_through_interpreter_kernels(monkeypatch):
    # Every GEMM, quantization and the fused SiLU·mul through the Triton kernels (interpreter).
    model = _model("mixtral", layers=1)
    quant = copy.deepcopy(model)
    tnn.quantize_(quant, tnn.FP8BlockConfig())
    x = _ids()[:1, :4]
    with torch.no_grad():
        want = model(x).logits.float()
        monkeypatch.setenv("TILEQ_BACKEND", "triton")
        got = quant(x).logits.float()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) >= 0.99
