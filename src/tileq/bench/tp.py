"""``tileq tpbench``: a Qwen3-14B/32B-shaped model (random weights) under transformers' tensor
parallelism, bf16 against tileq configs, decode TPOT per mode (GPU; run under torchrun).

    torchrun --nproc-per-node 2 -m tileq tpbench --layers 8 --out OUT
    torchrun --nproc-per-node 1 -m tileq tpbench --layers 8 --out OUT     # the one-GPU baseline

Every rank builds the same seeded bf16 model, transformers shards it by the model's tp_plan
(``maybe_distribute_model``: each rank keeps its slice of the identical full weights), then
``tileq.quantize_`` (and ``fuse_decoder_`` with ``--fuse``) converts the slices. Per config and
batch: TPOT eager, compiled, compiled + CUDA graph (``tileq.bench.e2e.measure_tpot``), the share
of one eager decode step's GPU time spent in NCCL kernels (torch profiler), and whether every
rank's greedy tokens are identical (they must be: the row-wise outputs are all-reduced). Rank 0
writes ``tp.csv`` and ``tp.md`` under ``--out``.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import torch

MODELS = {
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=40, num_key_value_heads=8,
                      head_dim=128, vocab_size=151936),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, vocab_size=151936),
}
CONFIGS = ("bf16", "A8W8", "FP8Row", "W4A16")
BATCHES = (1, 16)
MODES = ("eager", "compile", "graph")


def _mesh():
    """(mesh or None, rank, world, device): the process group as torchrun describes it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    if world == 1:
        return None, 0, 1, device
    mesh = torch.distributed.init_device_mesh("cuda", (world,))
    return mesh, torch.distributed.get_rank(), world, device


def build(model_name: str, layers: int, config: str, mesh, device, fuse: bool, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.distributed import DistributedConfig

    from .e2e import _bf16_model, quantize_model

    cfg = Qwen3Config(**MODELS[model_name], num_hidden_layers=layers, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    model = _bf16_model(lambda: Qwen3ForCausalLM(cfg), device, seed)  # the same weights on every rank
    if mesh is not None:  # every rank keeps its slice (distribute_tensor with src_data_rank=None)
        dc = DistributedConfig(tp_plan="auto", tp_size=mesh.size())
        model = type(model).maybe_distribute_model(model, dc, mesh)
    line = quantize_model(model, config, fuse and config != "bf16")
    return model.eval(), line


def comm_share(model, prompt) -> float:
    """NCCL kernels' share of one eager decode step's GPU kernel time."""
    from torch.profiler import ProfilerActivity, profile

    from .e2e import _cache, _prefill, _step

    cache = _cache(model, prompt.shape[0], prompt.shape[1] + 8)
    tok = _prefill(model.forward, cache, prompt)
    tok = _step(model.forward, cache, tok)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(model.forward, cache, tok)
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    total = nccl = 0.0
    for e in prof.events():  # kernels only: their device time
        if e.device_type != DeviceType.CUDA:
            continue
        t = getattr(e, "device_time", None)
        t = e.cuda_time if t is None else t
        total += t
        if "nccl" in e.name.lower():
            nccl += t
    return nccl / total if total else float("nan")


def greedy_tokens(model, prompt, steps: int = 8) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=steps, do_sample=False)
    return out[:, prompt.shape[1]:]


def ranks_agree(tokens: torch.Tensor, world: int) -> bool:
    if world == 1:
        return True
    got = [torch.empty_like(tokens) for _ in range(world)]
    torch.distributed.all_gather(got, tokens)
    return all(torch.equal(g, got[0]) for g in got)


def run(args) -> int:
    from .e2e import compiled_forward, measure_tpot

    if not torch.cuda.is_available():
        raise SystemExit("tileq tpbench: error: needs CUDA GPUs (run it under torchrun on the GPU machine)")
    mesh, rank, world, device = _mesh()
    rows = []
    for config in args.configs:
        model, line = build(args.model, args.layers, config, mesh, device, args.fuse)
        gen = torch.Generator(device="cpu").manual_seed(1)
        for batch in args.batches:
            prompt = torch.randint(0, 1000, (batch, args.prompt), generator=gen).to(device)
            compiled = compiled_forward(model) if {"compile", "graph"} & set(args.modes) else None
            t = measure_tpot(model, prompt, args.tokens, args.eager_tokens, args.modes, compiled)
            agree = ranks_agree(greedy_tokens(model, prompt), world)
            share = comm_share(model, prompt)
            rows.append({"model": args.model, "layers": args.layers, "tp": world, "config": config,
                         "fused": bool(args.fuse and config != "bf16"), "batch": batch,
                         **{f"tpot_{m}_ms": round(t.get(f"tpot_{m}_ms", float("nan")), 4) for m in MODES},
                         "nccl_share_eager": round(share, 4), "ranks_agree": agree, "summary": line})
            if rank == 0:
                print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    if rank == 0:
        write(rows, Path(args.out))
    if mesh is not None:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0 if all(r["ranks_agree"] for r in rows) else 1


def write(rows: list, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    keys = list(rows[0])
    with open(out / "tp.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    cols = [k for k in keys if k != "summary"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (out / "tp.md").write_text("# tileq tpbench\n\n" + "\n".join(lines) + "\n")
