"""The processes ``tests/test_tp.py`` spawns: each is one rank of a gloo group on the CPU.

A worker asserts; ``torch.multiprocessing.spawn`` re-raises a failing rank's exception (with its
traceback) in the test. The references (one process, no sharding) are computed in every worker
from the same files, so no tensor crosses a process boundary except through torch.distributed.
"""

from __future__ import annotations

import os
import socket
import warnings

import torch

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, vocab_size=512, max_position_embeddings=128)
MODELS = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny(path, family: str = "qwen3", seed: int = 0) -> None:
    """A bf16 tiny model with random weights (and biases on Llama's projections) at ``path``."""
    import transformers

    cfg_name, model_name = MODELS[family]
    # Llama: 4 key/value heads of 64 (one per rank on 4 ranks), biases on every projection
    over = {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4, "head_dim": 64} \
        if family == "llama" else {}
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**{**TINY, **over}))
    with torch.no_grad():  # biases are zero at init: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path)


def ids(batch: int = 2, seq: int = 9):
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))


def logits(model, x=None):
    with torch.no_grad():
        return model(ids() if x is None else x).logits.float()


def warm_imports() -> None:
    """What every rank imports, imported once before forking."""
    import transformers
    from transformers.distributed import DistributedConfig  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

    import tileq.distributed.load
    import tileq.integrations.hf  # noqa: F401

    transformers.AutoModelForCausalLM  # noqa: B018 - the lazy module's import


def setup(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TILEQ_BACKEND="reference")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # ranks share the CI machine's cores
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load(path, tp: bool):
    import transformers
    from transformers.distributed import DistributedConfig

    kw = {"distributed_config": DistributedConfig(tp_plan="auto")} if tp else {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).eval()


def close_to(got, want, bound, what, above=5):
    """|got - want| <= bound, with the expected values' spread ``above`` times the bound."""
    err = (got - want).abs().max().item()
    assert want.std().item() > above * bound, (what, want.std().item(), bound)
    assert err <= bound, f"{what}: max |tp - single| = {err:.4g} > {bound:.4g}"


# ----------------------------------------------------------------------------- scenarios


def _same_shards(tp_model, single_model, rank, world):
    """Every QuantLinear of ``tp_model`` holds exactly its rank's slice of ``single_model``'s."""
    from tileq.distributed.shard import ShardSpec, local_tensors, shard_tensors
    from tileq.nn import QuantLinear

    n = 0
    for name, layer in tp_model.named_modules():
        if not isinstance(layer, QuantLinear):
            continue
        ref = single_model.get_submodule(name)
        info = layer.tp_info
        assert info.spec == ShardSpec(info.spec.style, rank, world), (name, info.spec)
        want = shard_tensors(ref, info.spec, name)
        got = local_tensors(layer)
        for key in ("weight", "weight_scale", "bias", "tp_bias", "input_scale"):
            a, b = got[key], want[key]
            assert (a is None) == (b is None), (name, key)
            assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), (name, key)
        n += 1
    assert n > 0


def quantize_scenario(rank, world, port, path, family, configs, out_dir):
    """quantize_ on a tp_plan="auto" model: logits vs one process, slices vs quantize-then-shard,
    fuse_decoder_ per rank, save_pretrained gathered on rank 0."""
    setup(rank, world, port)

    import tileq
    from tileq.integrations.hf import fuse_decoder_
    from tileq.nn.configs import CONFIGS
    bf16 = logits(load(path, False))
    for name in configs:
        name, _, group = name.partition(":")  # "W4A16:64": int4 groups of 64 (pk_int4 layout)
        config = CONFIGS[name](group_size=int(group)) if group else CONFIGS[name]()
        single = load(path, False)
        tileq.quantize_(single, config)
        want = logits(single)
        sharded = load(path, True)
        summary = tileq.quantize_(sharded, config)
        assert summary.skipped == [("lm_head", "in config.skip_modules")], summary.skipped
        got = logits(sharded)
        # Weight-only: the only difference is the bf16 rounding of the partial sums (row-wise
        # layers). Quantized activations: a row-wise rank quantizes its own K slice (its own
        # per-token scales), which may move values by one quantization step; bounded by the
        # single process's own quantization error against bf16.
        # Bound: a third of the logits' spread, and never more than the single process's own
        # error against bf16 (one quantization).
        q_err = (want - bf16).abs().max().item()
        if config.act_dtype is None:
            bound = 0.02 * want.abs().max().item()
        else:
            bound = min(q_err, 0.3 * want.std().item())
        # fp8 per-token quantization moves these logits by up to a third of their spread
        close_to(got, want, bound, f"{name} rank {rank}", above=2)
        _same_shards(sharded, single, rank, world)
        if name in ("A8W8", "W4A16"):
            fs = fuse_decoder_(sharded)
            assert len(fs.fused) == TINY["num_hidden_layers"], str(fs)
            fuse_decoder_(single)
            close_to(logits(sharded), logits(single), bound, f"{name} fused rank {rank}", above=2)
        if out_dir is not None and name in ("A8W8", "FP8Block", "W4A16"):
            fmt = tileq.save_pretrained(sharded, os.path.join(out_dir, f"{name}-tp"))
            if rank == 0:
                fmt1 = tileq.save_pretrained(single, os.path.join(out_dir, f"{name}-single"))
                assert fmt == fmt1, (fmt, fmt1)
                _same_files(os.path.join(out_dir, f"{name}-tp"), os.path.join(out_dir, f"{name}-single"))
            import torch.distributed as dist

            dist.barrier()


def _same_files(a, b):
    from safetensors.torch import load_file

    ta, tb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def load_scenario(rank, world, port, checkpoints):
    """tileq.from_pretrained(path, tp_plan="auto") of each checkpoint: the rank's slices of the
    one-process load, host reads no larger than a slice, logits within the quantize bound."""
    setup(rank, world, port)
    import tileq
    from tileq.nn import QuantLinear

    for path in checkpoints:
        single = tileq.from_pretrained(path)
        sizes = {}
        reads = {}
        for name, mod in single.named_modules():
            if isinstance(mod, QuantLinear):
                sizes[name] = mod
        sharded = tileq.from_pretrained(path, tp_plan="auto",
                                        on_read=lambda k, t, reads=reads: reads.__setitem__(k, tuple(t.shape)))
        _same_shards(sharded, single, rank, world)
        # No rank reads a whole tensor of a sharded layer: every weight read is a slice.
        for name in sizes:
            for key, shape in reads.items():
                if key.startswith(name + ".weight") and key.endswith(("weight", "weight_packed")):
                    full = single.get_submodule(name)
                    assert shape[0] < full.out_features or shape[1] * (2 if full.config.weight_dtype == "int4"
                                                                       else 1) < full.in_features, (key, shape)
        got, want = logits(sharded), logits(single)
        close_to(got, want, 0.3 * want.std().item(), f"{path} rank {rank}", above=2)


def refusal_scenario(rank, world, port, path):
    """4 ranks of the Llama model: its attention's 64-row / 64-column slices would cut FP8Block's
    128 x 128 blocks, so q/k/v/o stay in bf16 (with their own tp hooks); the MLP is quantized."""
    setup(rank, world, port)
    import tileq

    sharded = load(path, True)
    summary = tileq.quantize_(sharded, tileq.FP8BlockConfig())
    kept = dict(summary.skipped)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        why = kept.get(f"model.layers.0.self_attn.{proj}", "")
        assert f"model.layers.0.self_attn.{proj}: its tensor-parallel shard" in why, why
        assert "cuts a 128x128 scale block" in why or "cuts a K group of 128" in why, why
    assert "model.layers.1.mlp.down_proj" in summary.converted
    got = logits(sharded)
    single = load(path, False)
    tileq.quantize_(single, tileq.FP8BlockConfig(), filter_fn=lambda m, n: ".mlp." in n)
    want = logits(single)
    close_to(got, want, 0.3 * want.std().item(), f"FP8Block with bf16 attention rank {rank}", above=2)
