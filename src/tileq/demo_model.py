"""The model half of ``tileq demo``: a transformers model quantized with every config.

CPU: a tiny random Qwen3 (2 layers, hidden 256) runs through the torch reference; each config's
logits at every prompt position are compared with the bf16 model's (cosine: the check; top-1
agreement, low on a random model whose logits are near ties) and a few tokens are generated,
bf16's first; nothing is timed. GPU: ``tileq e2e`` on a Qwen3-14B-shaped model cut to a few
layers (TTFT and TPOT against bf16, eager and with CUDA graphs). Returns 1 when a config's
agreement falls below its floor.
"""

from __future__ import annotations

import torch

from .nn.configs import CONFIGS

CONFIG_NAMES = tuple(CONFIGS)
# Floors of the mean cosine between quantized and bf16 logits of the tiny model (every position).
COS_FLOOR = {"A8W8": 0.99, "FP8Row": 0.97, "FP8Block": 0.97, "W8A16": 0.995, "W4A16": 0.9, "W4A8": 0.9}


def tiny_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=256)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)  # wider than the default init: logits that spread
    return model.to(torch.bfloat16).eval()


def cpu_model_demo(seed: int = 0) -> int:
    from .nn import config_from_name, quantize_

    try:
        import transformers  # noqa: F401
    except ImportError:
        print("model demo skipped: transformers is not installed (pip install tileq[hf])")
        return 0
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(seed))
    positions = ids.numel()
    base = tiny_qwen3(seed)
    with torch.no_grad():
        want = base(ids).logits.float()  # [2, 16, vocab]: every position's next-token logits
        bf16_tokens = base.generate(ids[:1], max_new_tokens=4, do_sample=False)[0, 16:].tolist()
    best2 = want.topk(2, dim=-1).values
    gap = (best2[..., 0] - best2[..., 1]).median().item()
    print("\nA tiny random Qwen3 (2 layers, hidden 256) quantized with each config, against the same model in "
          "bf16\n(CPU: the torch reference executor; no timings, they need a GPU):")
    head = (f"{'config':<10} {'converted':>9} {'logits cos':>10} {'top-1 agree':>11} {'logit shift':>11}  "
            "generated (greedy)")
    print(head + "\n" + "-" * (len(head) + 4))
    print(f"{'bf16':<10} {'-':>9} {1:>10.4f} {1:>11.2f} {0:>11.3f}  {bf16_tokens}")
    failed = []
    for name in CONFIG_NAMES:
        model = tiny_qwen3(seed)
        summary = quantize_(model, config_from_name(name))
        with torch.no_grad():
            got = model(ids).logits.float()
            out = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).mean().item()
        top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        shift = (got - want).abs().amax(-1).median().item()  # the largest logit change, median position
        ok = cos >= COS_FLOOR[name] and bool(torch.isfinite(got).all())
        if not ok:
            failed.append(name)
        print(f"{name:<10} {len(summary.converted):>9} {cos:>10.4f} {top1:>11.2f} {shift:>11.3f}  "
              f"{out[0, 16:].tolist()}{'' if ok else '  BELOW FLOOR ' + str(COS_FLOOR[name])}")
    print(f"logits cos: mean cosine with bf16's logits over the {positions} prompt positions (the check); "
          "logit shift: the largest change of one logit, median over them.")
    print(f"top-1 agree: the share of positions whose most likely next token is bf16's; it falls where the "
          f"logit shift exceeds this random model's gap between its two best logits (median {gap:.2f}: near "
          "ties), and greedy tokens then differ too; a trained model's margins are far wider.")
    if failed:
        print(f"FAILED: {', '.join(failed)} below their cosine floor")
        return 1
    print(f"all {len(CONFIG_NAMES)} configs pass their cosine floor (" +
          ", ".join(f"{k} {v}" for k, v in COS_FLOOR.items()) + ")")
    return 0


def gpu_model_demo(out: str, layers: int = 2) -> int:
    """tileq e2e on a Qwen3-14B-shaped model cut to ``layers`` layers."""
    import argparse

    from .bench.e2e import ALL_CONFIGS, run

    args = argparse.Namespace(layers=layers, configs=list(ALL_CONFIGS), batches=[1, 16], prompt=128,
                              tokens=32, eager_tokens=8, modes=["eager", "graph"], fuse=False, small=False,
                              seed=0, out=f"{out}/e2e")
    print(f"\ntileq e2e on a Qwen3-14B-shaped model cut to {layers} layers (full widths):")
    return run(args)
