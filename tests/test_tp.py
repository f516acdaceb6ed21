"""Tensor parallelism (tileq.distributed): shard arithmetic in one process, then gloo process
groups on the CPU (2 and 4 ranks, spawned) running transformers' tp_plan="auto" on tiny Qwen3 and
Llama models. QuantLinear runs the torch reference on CPU tensors (TILEQ_BACKEND=reference in the
workers). The scenarios are in tests/tp_workers.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tp_workers as W

import tileq
from tileq.distributed.shard import (
    ShardSpec,
    chunk,
    shard_quant_linear,
    unshard_quant_linear,
)
from tileq.errors import ShapeError, UnsupportedError
from tileq.nn import QuantLinear, W4A16Config
from tileq.nn.configs import CONFIGS

pytestmark = pytest.mark.transformers


def _layer(config, n=512, k=512, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    layer = QuantLinear.from_linear(lin, config)
    layer.qualified_name = "model.layers.0.mlp.down_proj"
    return layer


def _x(k, m=5):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)


@pytest.mark.parametrize("style", ["colwise", "rowwise", "packed_colwise"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_shard_roundtrip_and_partial_sums(name, style):
    """Slices join back into the very same layer, and the ranks' outputs make the layer's."""
    # N = 511: an odd N whose last block (FP8Block) is partial, on the last rank
    layer = _layer(CONFIGS[name](), n=512 if style == "packed_colwise" else 511)
    world = 2
    parts = [shard_quant_linear(layer, ShardSpec(style, r, world)) for r in range(world)]
    full = unshard_quant_linear(parts, ShardSpec(style, 0, world), layer.out_features, layer.in_features)
    for key in ("weight", "weight_scale", "bias"):
        assert torch.equal(getattr(full, key), getattr(layer, key)), key
    assert full.is_prepacked == layer.is_prepacked
    x = _x(layer.in_features)
    want = layer(x).float()
    if style == "rowwise":  # the partial products summed, the bias once: what the all-reduce does
        ks = [chunk(layer.in_features, r, world) for r in range(world)]
        got = sum(p(x[:, lo:hi]).float() for p, (lo, hi) in zip(parts, ks)) + layer.bias
        # per rank activation scales (A8W8/FP8/W4A8) differ from the whole row's: one step
        bound = 0.02 if layer.config.act_dtype is None else 0.1
        assert (got - want).abs().max() <= bound * want.abs().max()
    elif style == "colwise":
        assert torch.equal(torch.cat([p(x) for p in parts], -1).float(), want)
    if style != "rowwise":
        assert sum(p.out_features for p in parts) == layer.out_features and parts[1].out_features < 256 + 1


def test_row_shard_keeps_bias_out_of_the_gemm():
    layer = _layer(CONFIGS["A8W8"]())
    part = shard_quant_linear(layer, ShardSpec("rowwise", 1, 2))
    assert part.bias is None and torch.equal(part.tp_bias, layer.bias)
    assert "tp_bias" not in part.state_dict()  # checkpoints hold the layer's own tensors only


@pytest.mark.parametrize("name,style,world,n,k,words", [
    ("FP8Block", "colwise", 4, 256, 256, "cuts a 128x128 scale block"),
    ("FP8Block", "rowwise", 4, 256, 256, "cuts a K group of 128"),
    ("W4A16", "rowwise", 2, 64, 134, "cuts an int4 pair"),
    ("W4A16", "rowwise", 4, 64, 256, "cuts a K group of 128"),
])
def test_shard_that_cuts_a_unit_is_refused(name, style, world, n, k, words):
    config = CONFIGS[name]() if name != "W4A16" or k != 134 else W4A16Config(group_size=None)
    layer = _layer(config, n=n, k=k)
    with pytest.raises(ShapeError, match=rf"model\.layers\.0\.mlp\.down_proj: .*{words}"):
        shard_quant_linear(layer, ShardSpec(style, 1, world))


def test_more_ranks_than_rows_and_unknown_style():
    layer = _layer(CONFIGS["A8W8"](), n=3, k=64)
    with pytest.raises(ShapeError, match="leave rank 3 no slice"):
        shard_quant_linear(layer, ShardSpec("colwise", 3, 4))
    with pytest.raises(UnsupportedError, match="tp_plan style tileq shards"):
        ShardSpec("sequence_parallel", 0, 2)


def test_chunk_is_torch_chunk():
    for length in (1, 7, 64, 65, 130):
        for world in (1, 2, 3, 4, 8):
            pieces = torch.arange(length).chunk(world)
            for r in range(world):
                lo, hi = chunk(length, r, world)
                want = pieces[r] if r < len(pieces) else torch.arange(0)
                assert torch.equal(torch.arange(lo, hi), want)


# ----------------------------------------------------------------------------- spawned ranks


def _spawn(fn, world, *args):
    # fork: the ranks inherit this process's imports (transformers' auto classes alone take ~8 s
    # to import in a fresh process on 2 cores). No CUDA here, so forking is safe.
    W.warm_imports()
    torch.multiprocessing.start_processes(fn, args=(world, W.free_port(), *args), nprocs=world, join=True,
                                          start_method="fork")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for family in ("qwen3", "llama"):
        W.save_tiny(root / family, family)
        out[family] = str(root / family)
    out["root"] = root
    return out


def test_quantize_sharded_qwen3(tiny_dirs):
    """Every config on 2 ranks: logits, slices, per-rank fusion, the gathered checkpoint."""
    out = tiny_dirs["root"] / "saved"
    out.mkdir()
    _spawn(W.quantize_scenario, 2, tiny_dirs["qwen3"], "qwen3", list(CONFIGS), str(out))


def test_quantize_sharded_llama_with_biases_4_ranks(tiny_dirs):
    """64 input features of o_proj per rank: int4 in groups of 64, held as pk_int4."""
    _spawn(W.quantize_scenario, 4, tiny_dirs["llama"], "llama", ["A8W8", "W4A16:64"], None)


def test_block_cut_refused_on_4_ranks(tiny_dirs):
    _spawn(W.refusal_scenario, 4, tiny_dirs["llama"])


def test_sharded_load_of_each_format(tiny_dirs):
    """compressed-tensors, tileq's format and DeepSeek fp8, loaded slice by slice on 2 ranks."""
    from formats_artefacts import fp8_block_quantize

    root = tiny_dirs["root"] / "ckpt"
    paths = []
    for name, fmt in (("A8W8", "compressed-tensors"), ("W4A16", "compressed-tensors"), ("FP8Row", "tileq")):
        model = W.load(tiny_dirs["qwen3"], False)
        tileq.quantize_(model, CONFIGS[name]())
        assert tileq.save_pretrained(model, root / name, format=fmt) == fmt
        paths.append(str(root / name))
    paths.append(str(fp8_block_quantize(tiny_dirs["qwen3"], root / "fp8")))
    _spawn(W.load_scenario, 2, paths)
