"""How far apart two ways of running one decode step land, from the same cache state.

``tileq e2e`` compares each compiled step with the eager one; a quantized model can disagree there
for two reasons: a compiled route that computes something else, or rounding differences that
activation quantization amplifies (a last-bit change of a bf16 input moves an 8-bit code by one
step, about 0.8% of the row's largest value, and 40 layers of random weights carry it on). This
script tells them apart: per config it runs the step eagerly with the fused layers' q/k kernel
(the default eager route) and eagerly with transformers' q/k norms, rotation and cache update
(TILEQ_QK_ROPE=0: the default compiled route's operations), and eagerly with the token's
embedding's last bit changed (the rounding floor). Logits cosine of each to the default step.

    PYTHONPATH=src python3 scripts/step_agreement.py --layers 40 --configs A8W8:fused
"""

from __future__ import annotations

import argparse

import torch

from tileq.bench import e2e


def _logits(model, cache, tok, saved, nudged: bool = False):
    e2e.restore_cache(cache, saved)
    return e2e.step_logits(model, cache, tok, nudged)


@torch.inference_mode()
def agreement(name: str, layers: int, prompt_len: int, seed: int, small: bool = False) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = e2e.build_model(layers, dev, seed, small=small)
    e2e.quantize_model(model, name, fuse=False)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=dev,
                           generator=torch.Generator(dev).manual_seed(seed))
    cache = e2e._cache(model, 1, prompt_len + 8)
    tok = e2e._prefill(model.forward, cache, prompt)
    saved = e2e.cache_state(cache)
    out = {}
    base = _logits(model, cache, tok, saved)
    out["eager again"] = e2e.logits_cos(_logits(model, cache, tok, saved), base)
    with e2e.switches({"TILEQ_QK_ROPE": "0"}):
        out["eager, TILEQ_QK_ROPE=0"] = e2e.logits_cos(_logits(model, cache, tok, saved), base)
    # The embedding's last bit: every hidden state of the step moves by about one bf16 rounding.
    out["eager, the token's embedding x (1 + 2^-8)"] = e2e.logits_cos(_logits(model, cache, tok, saved, True), base)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--configs", default="bf16,A8W8:fused")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="1/8-width model (runs on the CPU: torch references)")
    args = ap.parse_args()
    print(f"| config | pair | logits cosine to the default eager step | 1 - cosine |\n|---|---|---|---|")
    for name in args.configs.split(","):
        for pair, cos in agreement(name, args.layers, args.prompt, args.seed, args.small).items():
            print(f"| {name} | {pair} | {cos:.4f} | {1 - cos:.2e} |", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
