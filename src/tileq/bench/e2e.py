"""``tileq e2e``: a Qwen3-14B-shaped transformers model (random weights made on the GPU) decoded in
bf16 and with each tileq config, on the same stack (transformers' model code, a static KV cache,
greedy decoding), each decode step run in the ``--modes`` asked for: eager (transformers' forward),
compile (``torch.compile(model.forward, fullgraph=True)``, no CUDA graph) and graph (that compiled
step captured in a CUDA graph and replayed, as serving stacks run it).

Per config: TTFT (the prompt's forward + the first token, batch 1, eager and compiled), TPOT per
mode at each batch (eager and compile: ``eager_tokens`` steps on the GPU timeline, so host gaps
count, and the host's wall time per step; graph: the captured step replayed ``tokens`` times),
peak memory, the share of kernel time spent in activation quantization, and the kernel time of
one decode step (compiled where measured) and one eager prefill by category (torch profiler:
activation quantization, tileq GEMMs, other matmuls, attention, the rest) with the number of
kernels (each kernel by name in OUT/kernels/<config>_<decode|prefill>.csv). Every config decodes the same weights
(same seed). Before it is timed, each config is gated (``gate_config``, bounds in ``GATE_BOUNDS``): its first-step
logits against its own reference backend (the same model object with TILEQ_BACKEND=reference), or, for peers
(no tileq reference), against bf16's; a config that fails is reported as FAILED and not timed, and the run
exits 1 at the end.

Each TPOT is set against the step's byte bound (``with_bound``): the bytes one decode step must read
(``bound.step_bytes``: weights and scales once, the experts a step touches on average, the KV cache,
the embedding rows) over the bandwidth bf16 cuBLAS reaches on decode GEMVs of the bf16 model's own
linear shapes, measured once per run (``measure_bandwidth``); share of bound = bound / TPOT, in the
CSV's ``step_bytes``, ``bound_ms``, ``share_of_bound`` columns of each TPOT row and a table of the report.

``--profile-host`` (a diagnostic) adds, per config, the same kernel breakdown of one compiled
prefill and cProfile reports of compiled and eager decode steps and compiled prefills, one text
file each in OUT/host_profile/ (``profile_host``, ``write_host_profile``).

``--checkpoint DIR`` times a quantized checkpoint (``tileq.from_pretrained``) against bf16 with its
shapes; ``--make-checkpoint DIR`` writes such checkpoints (the model above, random weights, each
config quantized and saved into DIR/<config> by ``tileq.save_pretrained``: compressed-tensors
where it has an equivalent, else tileq's format), on the GPU when there is one, and times nothing.
"""

from __future__ import annotations

import cProfile
import contextlib
import csv
import gc
import io
import math
import os
import pstats
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import settings
from ..errors import UnsupportedError, expect
from ..integrations import compat
from ..nn.configs import CONFIGS
from . import bound

QWEN3_14B = dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=40,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                 max_position_embeddings=40960, tie_word_embeddings=False, num_hidden_layers=40)

# Qwen3-30B-A3B: 128 routed experts, top-8 (no shared experts), every layer sparse.
QWEN3_MOE = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=40960,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                 num_hidden_layers=48)
MODELS = {"qwen3-14b": ("Qwen3-14B", QWEN3_14B), "qwen3-moe": ("Qwen3-30B-A3B", QWEN3_MOE)}  # --model

EAGER_ROUNDS = 4
ALL_CONFIGS = ("bf16", *CONFIGS)  # the baseline and every tileq config, by name

# Peers timed in the same run and modes where importable (--configs torchao.<name>): torchao's
# quantize_ with the config of the same scheme, on every nn.Linear but lm_head (as tileq's).
TORCHAO_PEERS = {
    "torchao.FP8Row": "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()): fp8 e4m3 per token x "
                      "per channel (torch._scaled_mm)",
    "torchao.A8W8": "Int8DynamicActivationInt8WeightConfig(): int8 per token x per channel (torch._int_mm)",
    "torchao.W4A16": "Int4WeightOnlyConfig(group_size=128, int4_packing_format='tile_packed_to_4d'): int4 groups "
                     "of 128, bf16 activations (tinygemm)",
}


class PeerUnavailable(Exception):
    """A peer library that cannot run here (not importable, or too old for the config)."""


def torchao_config(name: str):
    """The torchao config object of peer ``name`` (TORCHAO_PEERS); PeerUnavailable without torchao."""
    try:
        import torchao  # noqa: F401
        from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Int4WeightOnlyConfig,
                                          Int8DynamicActivationInt8WeightConfig, PerRow)
    except Exception as e:  # noqa: BLE001 - ImportError, or a torchao built for another torch
        raise PeerUnavailable(f"torchao is not importable here ({type(e).__name__}: {e}); pip install torchao") from e
    if name == "torchao.FP8Row":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    if name == "torchao.A8W8":
        return Int8DynamicActivationInt8WeightConfig()
    return Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")


def quantize_torchao(model, name: str) -> str:
    """torchao.quantization.quantize_ with peer ``name``'s config on every nn.Linear but lm_head."""
    from torchao.quantization import quantize_ as ao_quantize_

    linears = [fqn for fqn, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and "lm_head" not in fqn]
    ao_quantize_(model, torchao_config(name),
                 filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and "lm_head" not in fqn)
    import torchao

    return f"torchao {torchao.__version__} {TORCHAO_PEERS[name]}; {len(linears)} layers quantized, lm_head kept"


def build_model(layers: int, device, seed: int, small: bool = False, model: str = "qwen3-14b"):
    """Qwen3ForCausalLM with QWEN3_14B's shapes (or a 1/8-width model with ``small``), random
    weights, bf16, on ``device``, sdpa attention. ``model="qwen3-moe"``: Qwen3MoeForCausalLM with
    QWEN3_MOE's shapes (``small``: 1/8 width, 8 experts, top-2), its experts run by transformers'
    "grouped_mm" (the bf16 baseline; ``tileq.quantize_`` switches quantized experts to "tileq")."""
    if model == "qwen3-moe":
        return _build_moe(layers, device, seed, small)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(QWEN3_14B, num_hidden_layers=layers)
    if small:
        shape.update(hidden_size=640, intermediate_size=2176, num_attention_heads=5,
                     num_key_value_heads=1, vocab_size=4096)
    cfg = Qwen3Config(**shape)
    cfg._attn_implementation = "sdpa"
    return _bf16_model(lambda: Qwen3ForCausalLM(cfg), device, seed)


def _build_moe(layers: int, device, seed: int, small: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(QWEN3_MOE, num_hidden_layers=layers)
    if small:
        shape.update(hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                     vocab_size=4096)
    cfg = Qwen3MoeConfig(**shape)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"  # torch._grouped_mm over the bf16 experts
    return _bf16_model(lambda: Qwen3MoeForCausalLM(cfg), device, seed)


def _bf16_model(make, device, seed: int):
    """``make()`` with bf16 parameters created on ``device`` (no fp32 copy first), eval mode."""
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = make()
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def split_config(name: str) -> tuple[str, dict]:
    """('A8W8:fused', {'TILEQ_QK_ROPE': '0'}) from 'A8W8:fused@TILEQ_QK_ROPE=0': a config measured with
    tileq switches set while it is built and timed (several: '@A=1@B=0'), so that one run (one bf16
    baseline) compares them. Only ``settings.SWITCHES`` names, never TRITON_INTERPRET."""
    base, *pairs = name.split("@")
    env = {}
    for pair in pairs:
        var, eq, value = pair.partition("=")
        if not eq or var not in settings.SWITCHES or var == "TRITON_INTERPRET":
            raise UnsupportedError(expect("--configs", f"NAME@SWITCH=VALUE with a tileq switch "
                                          f"({', '.join(v for v in settings.SWITCHES if v != 'TRITON_INTERPRET')})",
                                          repr(name)))
        env[var] = value
    return base, env


@contextlib.contextmanager
def switches(env: dict):
    """The environment with ``env`` set inside (each switch put back as it was after)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings.current()  # an unknown value is refused here, before any work
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def quantize_model(model, name: str, fuse: bool):
    """Apply config ``name`` ('A8W8', ...; 'A8W8:fused' adds the fused decoder path of
    integrations.hf, as ``fuse`` does for every config); returns a summary line."""
    base, _, variant = name.partition(":")
    if base == "bf16":
        return "bf16 (unquantized)"
    if base in TORCHAO_PEERS:
        return quantize_torchao(model, base)
    from ..nn import config_from_name, quantize_

    summary = quantize_(model, config_from_name(base))
    line = f"{len(summary.converted)} layers quantized, {len(summary.skipped)} kept"
    if summary.experts:
        line += f", {len(summary.experts)} experts modules quantized"
    if fuse or variant == "fused":
        from ..integrations.hf import fuse_decoder_

        fs = fuse_decoder_(model)
        line += f"; fused decoder layers: {len(fs.fused)}, kept: {len(fs.kept)}"
    return line


def load_checkpoint(path: str, device, fuse: bool):
    """A quantized checkpoint (compressed-tensors, DeepSeek fp8, tileq) through tileq.from_pretrained."""
    from ..formats import from_pretrained

    model = from_pretrained(path, device=device).eval()
    how = f"tileq.from_pretrained({path})"
    if fuse:
        from ..integrations.hf import fuse_decoder_

        fs = fuse_decoder_(model)
        how += f"; fused decoder layers: {len(fs.fused)}, kept: {len(fs.kept)}"
    return model, how


def dense_like(path: str, device, seed: int):
    """The bf16 model a checkpoint's config.json describes, with random weights (the baseline)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    cfg.quantization_config = None
    if hasattr(cfg, "_attn_implementation"):
        cfg._attn_implementation = "sdpa"
    return _bf16_model(lambda: AutoModelForCausalLM.from_config(cfg), device, seed)


def _cache(model, batch: int, length: int):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=length)


@torch.inference_mode()
def _prefill(forward, cache, prompt):
    logits = forward(input_ids=prompt, **compat.cache_kwargs(cache), use_cache=True).logits
    return logits[:, -1:].argmax(-1)


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


# How a decode step runs (``--modes``): transformers' eager forward; the forward compiled by
# torch.compile (default mode, fullgraph, no CUDA graph: the README's example); that compiled step
# captured once in a CUDA graph and replayed, as serving stacks run it.
MODES = ("eager", "compile", "graph")


def measures_compile_ttft(args, modes) -> bool:
    """Whether a config's compiled TTFT is measured: a mode compiles, and --no-compile-ttft is off."""
    return bool({"compile", "graph"} & set(modes)) and getattr(args, "compile_ttft", True)


def compiled_forward(model):
    """``model.forward`` compiled as the README shows it (fullgraph; static shapes: one graph per
    batch size and prompt length, no dynamic-shape guards in the step)."""
    return torch.compile(model.forward, fullgraph=True, dynamic=False)


@torch.inference_mode()
def measure_ttft(forward, prompt, cache, reps: int = 5) -> float:
    """Median ms from the prompt's forward to the first token (batch of ``prompt``); ``cache`` is
    reset before each rep (one cache object: a compiled forward guards on it)."""
    times = []
    for _ in range(reps + 1):
        cache.reset()
        torch.cuda.synchronize()
        start, end = _events()
        start.record()
        _prefill(forward, cache, prompt)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


@torch.inference_mode()
def _step(forward, cache, tok):
    return forward(input_ids=tok, **compat.cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)


WARM_STEPS = 4  # steps before each timing: kernels compiled, launch caches and runners built
# Busy GPU seconds before a config's timings: a first eager measurement in a fresh process once ran
# 2.4x slow, on a GPU at its idle clock when the call began (cause not established;
# bench/results/h100/40layers-static/).
GPU_WARM_S = 0.5


def warm_gpu(seconds: float = GPU_WARM_S) -> None:
    """Keep the GPU busy with bf16 matmuls for ``seconds`` (clocks up before timing)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            torch.matmul(a, a, out=out)
        torch.cuda.synchronize()
    del a, out
    torch.cuda.empty_cache()


@torch.inference_mode()
def _timed_steps(forward, cache, tok, tokens: int) -> tuple[float, float, torch.Tensor]:
    """(GPU ms per step, host ms per step, last token) of ``tokens`` steps: EAGER_ROUNDS rounds,
    each timed on the GPU timeline (host gaps count) and on the wall clock; the median round.
    Steps that are not captured in a graph are host-bound and the host is noisy."""
    rounds, hosts = [], []
    per_round = max(1, tokens // EAGER_ROUNDS)
    for _ in range(EAGER_ROUNDS):
        torch.cuda.synchronize()
        start, end = _events()
        t0 = time.perf_counter()
        start.record()
        for _ in range(per_round):
            tok = _step(forward, cache, tok)
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / per_round)
        hosts.append((time.perf_counter() - t0) * 1e3 / per_round)
    return statistics.median(rounds), statistics.median(hosts), tok


@torch.inference_mode()
def _graph_tpot(forward, cache, tok, tokens: int) -> float:
    """ms per step of one decode step captured in a CUDA graph and replayed ``tokens`` times (the
    KV cache's length lives on the device, so each replay decodes the next position)."""
    static_tok = tok.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        static_tok.copy_(_step(forward, cache, static_tok))  # a step on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_tok.copy_(_step(forward, cache, static_tok))
    graph.replay()
    torch.cuda.synchronize()
    start, end = _events()
    start.record()
    for _ in range(tokens):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / tokens


# The compiled step runs the eager step's kernels on the same inputs; inductor's own fusions of the
# rest (norms, rotary embedding, residual adds) round differently. In bf16 that stays far below 1%
# of the logits' direction; a quantized model's activation quantization amplifies any rounding
# difference (a last-bit change of an input moves an 8-bit code by a whole step), so its compiled
# step is judged against the eager step's own sensitivity: the same step with its input's last bit
# changed (``compiled_step_agreement``'s floor). MISMATCH: further from the eager step than
# COMPILED_AGREEMENT_MIN and than FLOOR_FACTOR times that floor.
COMPILED_AGREEMENT_MIN = 0.99
FLOOR_FACTOR = 4.0
LAST_BIT = 2.0 ** -8  # bf16 keeps 8 significant bits: x (1 + 2^-8) moves about half the values one step


def disagrees(cos: float, floor_cos: float) -> bool:
    """Whether a compiled step with logits cosine ``cos`` to the eager step computes something else,
    given the eager step's cosine ``floor_cos`` to itself with its input's last bit changed."""
    return 1.0 - cos > max(1.0 - COMPILED_AGREEMENT_MIN, FLOOR_FACTOR * (1.0 - floor_cos))


def cache_state(cache) -> list:
    """Copies of a static cache's tensors (keys, values, length per layer), for ``restore_cache``."""
    return [(layer.keys.clone(), layer.values.clone(), layer.cumulative_length.clone()) for layer in cache.layers]


def restore_cache(cache, saved) -> None:
    """Put ``cache_state``'s copies back into the cache's own tensors (a compiled graph's guards hold)."""
    for layer, (keys, values, length) in zip(cache.layers, saved):
        layer.keys.copy_(keys)
        layer.values.copy_(values)
        layer.cumulative_length.copy_(length)


@torch.inference_mode()
def step_logits(model, cache, tok, nudged: bool = False) -> torch.Tensor:
    """fp32 logits at the last position of one eager forward of ``tok`` (a decode step, or a prompt's
    prefill); ``nudged``: the tokens' embeddings times (1 + LAST_BIT)."""
    if not nudged:
        return model.forward(input_ids=tok, **compat.cache_kwargs(cache), use_cache=True).logits[:, -1].float()
    rows = model.get_input_embeddings()(tok)
    return model.forward(inputs_embeds=(rows.float() * (1 + LAST_BIT)).to(rows.dtype), **compat.cache_kwargs(cache),
                         use_cache=True).logits[:, -1].float()


def logits_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()


@torch.inference_mode()
def compiled_step_agreement(model, compiled, cache, tok) -> tuple[float, float, torch.Tensor, float]:
    """(cosine, top-1 agreement) of one compiled decode step's logits against the eager step's from
    the same cache state, the compiled step's token, and the rounding floor: the cosine of the
    eager step with the token's embedding times (1 + LAST_BIT) to the eager step. The eager steps
    run first and the static cache's tensors are put back in place after each (same tensors: the
    compiled graph's guards hold), so every step starts from one state; the cache is left one
    compiled step further. A compiled route that computes something else shows here, not in the
    eager logits column."""
    saved = cache_state(cache)
    want = step_logits(model, cache, tok)
    restore_cache(cache, saved)
    floor = logits_cos(step_logits(model, cache, tok, nudged=True), want)
    restore_cache(cache, saved)
    del saved
    got = compiled(input_ids=tok, **compat.cache_kwargs(cache), use_cache=True).logits[:, -1].float()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return logits_cos(got, want), top1, got.argmax(-1, keepdim=True), floor


def cache_steps(tokens: int, eager_tokens: int, modes) -> int:
    """Decode steps one ``measure_tpot`` call takes (the static cache must hold them all)."""
    steps = WARM_STEPS
    if "eager" in modes:
        steps += eager_tokens
    if "compile" in modes or "graph" in modes:
        steps += WARM_STEPS + 1  # (+1: the compiled step's agreement check)
    if "compile" in modes:
        steps += eager_tokens
    if "graph" in modes:
        steps += 2 + tokens
    return steps


@torch.inference_mode()
def measure_tpot(model, prompt, tokens: int, eager_tokens: int, modes, compiled=None) -> dict:
    """TPOT in ms per mode of ``modes`` (``tpot_<mode>_ms``), the compiled step's warm-up seconds
    (``compile_decode_s``: its compilation), and host ms per step where the host
    launches every kernel (``host_ms_<mode>``). ``compiled``: the model's compiled forward."""
    out = {}
    cache = _cache(model, prompt.shape[0], prompt.shape[1] + cache_steps(tokens, eager_tokens, modes) + 8)
    tok = _prefill(model.forward, cache, prompt)
    for _ in range(WARM_STEPS):
        tok = _step(model.forward, cache, tok)
    if "eager" in modes:
        out["tpot_eager_ms"], out["host_ms_eager"], tok = _timed_steps(model.forward, cache, tok, eager_tokens)
    if compiled is not None:
        t_compile = time.perf_counter()
        for _ in range(WARM_STEPS):  # the first compiles this batch size's graph
            tok = _step(compiled, cache, tok)
        torch.cuda.synchronize()
        out["compile_decode_s"] = time.perf_counter() - t_compile
        (out["compiled_step_cos"], out["compiled_step_top1"], tok,
         out["eager_step_floor_cos"]) = compiled_step_agreement(model, compiled, cache, tok)
        if "compile" in modes:
            out["tpot_compile_ms"], out["host_ms_compile"], tok = _timed_steps(compiled, cache, tok, eager_tokens)
        if "graph" in modes:
            out["tpot_graph_ms"] = _graph_tpot(compiled, cache, tok, tokens)
    return out


# Kernel categories of the profiler breakdown, by kernel-name fragment (first match wins).
KERNEL_CATEGORIES = (
    ("act_quant", ("quantize", "rmsnorm_quant")),
    ("tileq_gemm", ("_gemm_kernel", "_split_reduce", "ws_gemm", "gluon", "_i4p_kernel", "_i4p_prefill",
                    "_dequant_kernel")),
    ("other_matmul", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitk")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
)


def _category(name: str) -> str:
    low = name.lower()
    for cat, marks in KERNEL_CATEGORIES:
        if any(m in low for m in marks):
            return cat
    return "other"


@torch.inference_mode()
def kernel_breakdown(model, prompt, what: str, forward=None, names: dict | None = None) -> dict:
    """GPU kernel time (ms) by category over one prefill ('prefill') or decode step ('decode'),
    through ``forward`` (default: the eager ``model.forward``; the compiled step where one is
    measured, or the compiled forward for ``--profile-host``'s compiled prefill), from the torch
    profiler: where a step's device time goes. ``names`` (a dict) receives each kernel's
    (ms, count) by name."""
    eager = forward is None
    forward = forward or model.forward
    cache = _cache(model, prompt.shape[0], prompt.shape[1] + 8)
    if what == "decode":  # a prefill and two steps first: the profiled step is a steady one
        tok = _step(forward, cache, _step(forward, cache, _prefill(model.forward, cache, prompt)))
    elif not eager:  # a compiled prefill on this fresh cache once first: the profiled one is steady
        _prefill(forward, cache, prompt)
        cache.reset()
    if what == "decode":
        return profiled_kernels(lambda: _step(forward, cache, tok), names)
    return profiled_kernels(lambda: _prefill(forward, cache, prompt), names)


def profiled_kernels(run, names: dict | None = None) -> dict:
    """GPU kernel ms by category (``KERNEL_CATEGORIES``, else 'other') of one ``run()``, from the
    torch profiler, and the kernel count as 'launches'; ``names`` (a dict) receives each kernel's
    (ms, count) by name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out = {cat: 0.0 for cat, _ in KERNEL_CATEGORIES}
    out["other"] = 0.0
    kernels = 0
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = getattr(evt, "device_time_total", None)
        if t is None:
            t = getattr(evt, "cuda_time_total", 0.0)
        out[_category(evt.key)] += t / 1e3
        kernels += evt.count
        if names is not None:
            ms, count = names.get(evt.key, (0.0, 0))
            names[evt.key] = (ms + t / 1e3, count + evt.count)
    out["launches"] = kernels
    return out


def _breakdown_rows(base: dict, prefix: str, parts: dict) -> list[dict]:
    """Rows ``<prefix>_kernel_ms_<category>`` and ``<prefix>_kernels`` (its "launches") of a
    ``kernel_breakdown``'s ``parts``."""
    rows = [dict(base, metric=f"{prefix}_kernel_ms_{cat}", batch=1, value=ms)
            for cat, ms in parts.items() if cat != "launches"]
    rows.append(dict(base, metric=f"{prefix}_kernels", batch=1, value=parts["launches"]))
    return rows


HOST_PROFILE_STEPS = 8  # decode steps per --profile-host report (after HOST_PROFILE_WARM warm-up steps)
HOST_PROFILE_WARM = 3
HOST_PROFILE_PREFILLS = 3  # prefills per report


def _cuda_sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def write_host_profile(fn, path, label: str, calls: int = 1, sync=_cuda_sync) -> float:
    """Run ``fn`` (``calls`` calls of something, in one loop) twice: timed on the wall clock
    (``sync`` before and after), then under cProfile (``sync`` before the profiler stops). Writes
    ``path``: ``label``, the wall ms per call, pstats' top 35 functions by tottime and top 25 by
    cumulative time. Returns the wall ms per call (measured without the profiler)."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    wall = (time.perf_counter() - t0) * 1e3 / calls
    prof = cProfile.Profile()
    sync()
    prof.enable()
    try:
        fn()
        sync()
    finally:
        prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(25)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{label}\nwall ms per call (without the profiler): {wall:.3f} over {calls} calls\n\n"
                    f"cProfile, top 35 by tottime, then top 25 by cumulative:\n{text.getvalue()}")
    return wall


@torch.inference_mode()
def profile_host(model, prompt, compiled, folder, config: str) -> dict:
    """``--profile-host``: cProfile of HOST_PROFILE_STEPS decode steps (compiled: ``decode_compile``,
    eager: ``decode_eager``; each on its own static cache after a prefill and HOST_PROFILE_WARM
    steps) and of HOST_PROFILE_PREFILLS eager and compiled prefills of ``prompt`` (``prefill_eager``,
    ``prefill_compile``, the cache reset before each, after one warm prefill); without ``compiled``
    only the eager ones.
    One file per report, ``folder/<config>_<what>.txt`` (':' as '-'); returns {what: wall ms per call}."""
    out = {}
    stem = config.replace(":", "-").replace("@", "_").replace("=", "")
    length = prompt.shape[1] + HOST_PROFILE_WARM + 2 * HOST_PROFILE_STEPS + 8
    decodes = ([("decode_compile", compiled)] if compiled is not None else []) + [("decode_eager", model.forward)]
    for what, forward in decodes:
        cache = _cache(model, prompt.shape[0], length)
        state = [_prefill(model.forward, cache, prompt)]
        for _ in range(HOST_PROFILE_WARM):
            state[0] = _step(forward, cache, state[0])

        def steps(forward=forward, cache=cache, state=state):
            tok = state[0]
            for _ in range(HOST_PROFILE_STEPS):
                tok = _step(forward, cache, tok)
            state[0] = tok

        out[what] = write_host_profile(steps, Path(folder) / f"{stem}_{what}.txt",
                                       f"{config}: {what}, {HOST_PROFILE_STEPS} decode steps at batch "
                                       f"{prompt.shape[0]}", calls=HOST_PROFILE_STEPS)
    prefills = [("prefill_eager", model.forward)] + ([("prefill_compile", compiled)] if compiled is not None else [])
    for what, forward in prefills:
        cache = _cache(model, prompt.shape[0], prompt.shape[1] + 8)
        _prefill(forward, cache, prompt)  # a fresh cache object: the profiled prefills are steady ones

        def run(forward=forward, cache=cache):
            for _ in range(HOST_PROFILE_PREFILLS):
                cache.reset()
                _prefill(forward, cache, prompt)

        out[what] = write_host_profile(
            run, Path(folder) / f"{stem}_{what}.txt",
            f"{config}: {what}, {HOST_PROFILE_PREFILLS} prefills of a {prompt.shape[1]}-token "
            f"prompt at batch {prompt.shape[0]}", calls=HOST_PROFILE_PREFILLS)
    return out


@torch.inference_mode()
def first_logits(model, prompt, nudged: bool = False) -> torch.Tensor:
    """fp32 logits of the prompt's prefill at its last position (the first step), on a fresh cache."""
    return step_logits(model, _cache(model, prompt.shape[0], prompt.shape[1] + 8), prompt, nudged)


# ----------------------------------------------------------------------------- the gate


@dataclass(frozen=True)
class GateBound:
    """cos(logits, baseline's) >= min_cos and max |logits - baseline's| / max |baseline's| <= max_rel,
    each widened to ``widen`` times a yardstick's deviation (cos, rel) where that is larger."""

    min_cos: float
    max_rel: float
    widen: float
    yardstick: str  # the deviation that widens it ({counterpart}: the config it is read from)


GATE_BOUNDS = {
    # The same model through tileq's torch reference: only fp32 summation order and the roundings it
    # moves differ. Logits are bf16 (8 significant bits): 2^-5 of the largest is 4 of its last places,
    # cos 0.999 about as far in L2. A rounding difference can flip an activation's 8-bit code in the next
    # layer, which deep random-weight models amplify, so the bound widens to FLOOR_FACTOR times the
    # reference's own deviation when its input's last bit changes (as the compiled-step check does).
    "reference": GateBound(0.999, 2.0 ** -5, FLOOR_FACTOR,
                           "the reference's own deviation with its input's last bit changed"),
    # bf16, for peers (no tileq reference) or a config its reference cannot run: the scheme's quantization
    # error counts too (int4 weights round to steps of 1/15 of a group's range, e4m3 to 2^-4 relative), so
    # the fixed part only catches logits unlike bf16's; it widens to 2x the deviation from bf16 of the
    # tileq config of the same scheme that passed its reference gate in this run (same weights and scheme).
    "bf16": GateBound(0.9, 0.5, 2.0, "the deviation from bf16 of {counterpart}"),
}


@dataclass(frozen=True)
class Gate:
    """A config's gate: its first-step logits against ``baseline`` ('reference' or 'bf16')."""

    baseline: str
    cos: float
    rel: float  # max |logits - baseline's| / max |baseline's|
    min_cos: float
    max_rel: float
    basis: str  # how the bound was set: 'fixed', or widened by what
    note: str = ""  # why the baseline is bf16, or why nothing could be compared

    @property
    def passed(self) -> bool:
        return self.cos >= self.min_cos and self.rel <= self.max_rel  # NaN fails

    @property
    def bound(self) -> str:
        return f"cos >= {self.min_cos:.4f}, rel <= {self.max_rel:.4f} ({self.basis})"

    def describe(self) -> str:
        text = (f"gate vs {self.baseline}: cos {self.cos:.6f}, rel err {self.rel:.4f}; bound {self.bound}: "
                f"{'pass' if self.passed else 'FAILED'}")
        return text + (f"; {self.note}" if self.note else "")


def logits_gap(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(cosine, max |got - want| / max |want|) of fp32 logits; NaN for non-finite ones."""
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return math.nan, math.nan
    return logits_cos(got, want), ((got - want).abs().max() / want.abs().max()).item()


def judge(baseline: str, got, want, yardstick=None, what: str = "", note: str = "") -> Gate:
    """``got`` against ``want`` under GATE_BOUNDS[baseline], widened by ``yardstick`` ((cos, rel) of ``what``)."""
    b = GATE_BOUNDS[baseline]
    cos, rel = logits_gap(got, want)
    min_cos, max_rel, basis = b.min_cos, b.max_rel, "fixed"
    if yardstick is not None and not any(map(math.isnan, yardstick)):
        ycos, yrel = yardstick
        min_cos = max(0.0, min(min_cos, 1.0 - b.widen * (1.0 - ycos)))
        max_rel = max(max_rel, b.widen * yrel)
        basis = f"fixed, or {b.widen:g}x {what}: cos {ycos:.6f}, rel {yrel:.4f}"
    return Gate(baseline, cos, rel, min_cos, max_rel, basis, note)


def runs_tileq(model) -> bool:
    """Whether ``model`` has tileq layers (QuantLinear, QuantExperts), which tileq's reference runs."""
    from ..moe import QuantExperts
    from ..nn import QuantLinear

    return any(isinstance(m, (QuantLinear, QuantExperts)) for m in model.modules())


def reference_logits(model, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """``first_logits`` of the same model object through tileq's torch reference (TILEQ_BACKEND=reference:
    every tileq cache keys on the switch; no second copy of the weights), plain and with the prompt's
    embeddings nudged by LAST_BIT. Each QuantLinear's kept launches are set aside meanwhile and put back
    after: one kept on a prepacked int4 weight launches the kernel whatever the switch says."""
    from ..nn import QuantLinear

    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    kept = [m._runners for m in layers]
    out = []
    try:
        with switches({"TILEQ_BACKEND": "reference"}):
            for nudged in (False, True):
                for m in layers:
                    m._runners = {}
                out.append(first_logits(model, prompt, nudged))
    finally:
        for m, runners in zip(layers, kept):
            m._runners = runners
    return out[0], out[1]


def _scheme(label: str) -> str:
    """The scheme a config label names: 'A8W8' for 'A8W8:fused@TILEQ_PDL=0' and for 'torchao.A8W8'."""
    return split_config(label)[0].partition(":")[0].removeprefix("torchao.")


def gate_config(label: str, model, prompt, logits, bf16_logits, passed: dict, comparable: bool = True) -> Gate:
    """Config ``label``'s gate (``logits``: its first-step logits on ``prompt``): against its reference
    backend where it has tileq layers and the reference runs, else against ``bf16_logits`` (not
    ``comparable``: bf16 has other weights, as a checkpoint's baseline does), the bound widened by
    ``passed`` ({label: (cos, rel) against bf16} of the configs that passed a reference gate) of its scheme."""
    note = "no tileq layers: no reference backend"
    if runs_tileq(model):
        try:
            ref, nudged = reference_logits(model, prompt)
        except Exception as e:  # noqa: BLE001 - said in the report; then bf16 is the baseline
            note = f"its reference backend cannot run it ({type(e).__name__}: {e})"
        else:
            return judge("reference", logits, ref, logits_gap(nudged, ref), GATE_BOUNDS["reference"].yardstick)
    b = GATE_BOUNDS["bf16"]
    if bf16_logits is None or not comparable:
        why = "bf16's logits were not measured" if comparable else "bf16 has other weights here"
        return Gate("bf16", math.nan, math.nan, b.min_cos, b.max_rel, "fixed", f"{note}; {why}")
    same = next((c for c in passed if _scheme(c) == _scheme(label)), None)
    if same is None:
        note += f"; no tileq {_scheme(label)} passed its gate earlier in this run to widen the bound by"
        return judge("bf16", logits, bf16_logits, note=note)
    return judge("bf16", logits, bf16_logits, passed[same], b.yardstick.format(counterpart=same), note)


def gate_row(base: dict, gate: Gate, agree: dict) -> dict:
    """The CSV row of a config's gate (value 1 passed, 0 FAILED), with its agreement with bf16."""
    return dict(base, metric="gate", batch=1, value=float(gate.passed), gate_baseline=gate.baseline,
                gate_cos=gate.cos, gate_rel_err=gate.rel, gate_bound=gate.bound,
                gate="pass" if gate.passed else "FAILED", gate_note=gate.note, **agree)


def _empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def build_config(name: str, args, dev) -> tuple[object, str]:
    """(model, how it was made) of config ``name`` (no '@' switches) on ``dev``."""
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint and name.partition(":")[0] == "checkpoint":
        return load_checkpoint(checkpoint, dev, fuse=args.fuse or name.endswith(":fused"))
    if checkpoint:  # bf16 with the checkpoint's shapes (random weights), as the baseline
        return dense_like(checkpoint, dev, args.seed), "bf16 (unquantized), the checkpoint's shapes"
    if name in TORCHAO_PEERS:
        torchao_config(name)  # PeerUnavailable before any work
    model = build_model(args.layers, dev, args.seed, small=args.small, model=getattr(args, "model", "qwen3-14b"))
    return model, quantize_model(model, name, args.fuse)


def run_config(label: str, args, prompts: dict, ref_logits, passed: dict | None = None,
               dev=None) -> tuple[list[dict], torch.Tensor, Gate | None]:
    """Build config ``label``, gate it (not bf16, the baseline: ``ref_logits`` are its first-step
    logits) and time it if it passes (``time_config``): (its rows, its first-step logits, its gate).
    Its rows carry the label; switches after '@' are set by the caller."""
    name = split_config(label)[0]
    dev = torch.device("cuda") if dev is None else dev
    torch._dynamo.reset()  # transformers' forward wrapper is one code object: each config starts its own cache
    _empty_cache()
    t0 = time.time()
    model, how = build_config(name, args, dev)
    setup_s = time.time() - t0
    if label != name:
        how += f"; with {', '.join(label.split('@')[1:])}"
    base = dict(config=label, layers=args.layers, setup=how)
    if label == "bf16":  # once per run, on the baseline's own shapes: every config's bound divides by it
        args.bandwidth = measure_bandwidth(model, dev)
        print(f"[e2e] byte bound: {_bandwidth_words(args.bandwidth)}", flush=True)
    logits = first_logits(model, prompts[1])
    checkpoint = getattr(args, "checkpoint", None)
    agree = {}
    if ref_logits is not None and not checkpoint:  # a checkpoint's baseline has random weights
        rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        cos = torch.nn.functional.cosine_similarity(logits, ref_logits, dim=-1).mean().item()
        agree = dict(logits_rel_err=rel, logits_cos=cos,
                     top1_match=float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()))
    gate, rows = None, []
    if label == "bf16":
        if args.bandwidth[0] is not None:
            rows.append(dict(base, metric="gemv_bandwidth_tbps", batch=0, value=args.bandwidth[0] / 1e12))
        if not torch.isfinite(logits).all():
            raise RuntimeError(f"{label}: non-finite logits on the first step")
    else:
        gate = gate_config(label, model, prompts[1], logits, ref_logits, passed or {}, comparable=not checkpoint)
        _empty_cache()  # the reference's float64 operands are no part of the timed model
        rows.append(gate_row(base, gate, agree))
        print(f"[e2e] {label}: {gate.describe()}", flush=True)
    if gate is None or gate.passed:
        rows += with_bound(time_config(model, label, args, prompts, base, agree, setup_s), model, base, args)
    del model
    gc.collect()
    _empty_cache()
    return rows, logits, gate


def time_config(model, label: str, args, prompts: dict, base: dict, agree: dict, setup_s: float) -> list[dict]:
    """The timed rows of a built (and gated) config: TTFT, TPOT per mode and batch, kernel breakdowns,
    peak memory, setup time, and ``--profile-host``'s diagnostics."""
    rows = []
    warm_gpu()  # (before the peak-memory count starts: its matrices are not the model's)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    modes = args.modes
    ttft_cache = _cache(model, 1, prompts[1].shape[1] + 8)
    rows.append(dict(base, metric="ttft_eager_ms", batch=1, value=measure_ttft(model.forward, prompts[1], ttft_cache),
                     **agree))
    compiled = compiled_forward(model) if {"compile", "graph"} & set(modes) else None
    if compiled is not None and measures_compile_ttft(args, modes):
        t_compile = time.perf_counter()
        rows.append(dict(base, metric="ttft_compile_ms", batch=1,
                         value=measure_ttft(compiled, prompts[1], ttft_cache)))
        # the prefill graph's compilation and its 6 runs: what a user waits before the first token
        rows.append(dict(base, metric="compile_prefill_s", batch=1, value=time.perf_counter() - t_compile))
    del ttft_cache
    for b in args.batches:
        r = measure_tpot(model, prompts[b], args.tokens, args.eager_tokens, modes, compiled)
        if "compiled_step_cos" in r and disagrees(r["compiled_step_cos"], r["eager_step_floor_cos"]):
            print(f"{label}: MISMATCH: the compiled decode step at batch {b} disagrees with the eager one "
                  f"(logits cosine {r['compiled_step_cos']:.4f}, top-1 {r['compiled_step_top1']:.2f}; the eager "
                  f"step with its input's last bit changed: {r['eager_step_floor_cos']:.4f})", flush=True)
        for k, v in r.items():
            rows.append(dict(base, metric=k, batch=b, value=v))
    try:
        for what in ("decode", "prefill"):
            names = {}
            parts = kernel_breakdown(model, prompts[1], what, compiled if what == "decode" else None, names)
            write_kernel_table(names, Path(args.out) / "kernels" / f"{_file_name(label)}_{what}.csv")
            rows += _breakdown_rows(base, what, parts)
            parts.pop("launches")
            total = sum(parts.values())
            if what == "decode":
                rows.append(dict(base, metric="quant_share", batch=1,
                                 value=parts["act_quant"] / total if total else float("nan")))
    except Exception as e:  # noqa: BLE001 - the profiler is optional: say why it is missing
        print(f"  [{label}] profiler breakdown not measured: {e}")
    rows.append(dict(base, metric="peak_mem_gb", batch=max(args.batches),
                     value=torch.cuda.max_memory_allocated() / 1e9))
    rows.append(dict(base, metric="setup_s", batch=0, value=setup_s))
    if getattr(args, "profile_host", False):  # diagnostics, after the peak memory is read
        rows += _host_diagnostics(label, model, prompts[1], compiled, base, Path(args.out) / "host_profile")
    return rows


# ----------------------------------------------------------------------------- the byte bound


def measure_bandwidth(model, dev) -> tuple[float | None, str]:
    """(bytes per second, how it was measured) of bf16 cuBLAS decode GEMVs on ``model``'s own linear
    shapes (``bound.gemv_bandwidth``), measured once per run on the bf16 baseline; (None, why) without
    a GPU or where the measurement fails (the bound cells stay empty)."""
    shapes = bound.linear_shapes(model)
    try:
        bw = bound.gemv_bandwidth(shapes, dev)
    except Exception as e:  # noqa: BLE001 - the bound is an aid to reading the timings: say why it is missing
        return None, f"n/a: not measured ({type(e).__name__}: {e})"
    return (None, "n/a: needs a GPU") if bw is None else (bw, bound.bandwidth_method(shapes))


def _bandwidth_words(bandwidth) -> str:
    bw, how = bandwidth
    return how if bw is None else f"{bw / 1e12:.2f} TB/s, bf16 GEMV bandwidth: {how}"


def bound_context(args) -> int:
    """The cached positions a step's KV-cache bytes count: the prompt plus half the decode steps one
    batch's ``measure_tpot`` takes (the middle of its steps)."""
    return args.prompt + cache_steps(args.tokens, args.eager_tokens, args.modes) // 2


TPOT_METRICS = {f"tpot_{m}_ms" for m in MODES}


def with_bound(rows: list[dict], model, base: dict, args) -> list[dict]:
    """A config's timed ``rows`` with each TPOT row's ``step_bytes`` (``bound.step_bytes``' total at
    its batch, ``bound_context`` positions), ``bound_ms`` (those bytes at ``args.bandwidth``) and
    ``share_of_bound`` (bound_ms / TPOT; both empty without a bandwidth), then per batch the step's
    bytes by part (``step_bytes_<part>`` rows)."""
    bw = getattr(args, "bandwidth", (None, ""))[0]
    steps, out = {}, []
    try:
        for b in sorted({r["batch"] for r in rows if r["metric"] in TPOT_METRICS}):
            steps[b] = bound.step_bytes(model, batch=b, context_len=bound_context(args))
    except Exception as e:  # noqa: BLE001 - the bound is an aid to reading the timings: say why it is missing
        print(f"  [{base['config']}] step bytes not counted: {type(e).__name__}: {e}")
        return rows
    for r in rows:
        if r["metric"] in TPOT_METRICS:
            r = dict(r, step_bytes=steps[r["batch"]]["total"])
            if bw:
                r["bound_ms"] = r["step_bytes"] / bw * 1e3
                r["share_of_bound"] = r["bound_ms"] / r["value"]
        out.append(r)
    return out + [dict(base, metric=f"step_bytes_{part}", batch=b, value=v)
                  for b, parts in steps.items() for part, v in parts.items()]


def _file_name(label: str) -> str:
    """A config label as a file name ('A8W8:fused@TILEQ_X=1' -> 'A8W8-fused-TILEQ_X-1'): letters,
    digits and ``_.+-`` only, names any copying tool takes as they are."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", label).strip("-")


def write_kernel_table(names: dict, path: Path) -> None:
    """One profiled run's kernels, longest total first: category, ms, calls, us per call, name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["category", "ms", "calls", "us_per_call", "kernel"])
        for name, (ms, count) in sorted(names.items(), key=lambda kv: -kv[1][0]):
            w.writerow([_category(name), f"{ms:.4f}", count, f"{1e3 * ms / max(count, 1):.2f}", name[:200]])


def _host_diagnostics(name: str, model, prompt, compiled, base: dict, folder: Path) -> list[dict]:
    """``--profile-host``'s rows: the kernel breakdown of one compiled prefill (where a compiled
    forward exists) and the wall ms per call of each ``profile_host`` report; a failure is printed
    and leaves its rows out."""
    rows = []
    if compiled is not None:
        try:
            rows += _breakdown_rows(base, "prefill_compile", kernel_breakdown(model, prompt, "prefill", compiled))
        except Exception as e:  # noqa: BLE001 - a diagnostic: say why it is missing
            print(f"  [{name}] compiled prefill breakdown not measured: {e}")
    try:
        for what, ms in profile_host(model, prompt, compiled, folder, name).items():
            rows.append(dict(base, metric=f"host_profile_{what}_ms", batch=1, value=ms))
        print(f"  [{name}] host profiles in {folder}")
    except Exception as e:  # noqa: BLE001 - a diagnostic: say why it is missing
        print(f"  [{name}] host profile not measured: {e}")
    return rows


FIELDS = ["config", "layers", "metric", "batch", "value", "step_bytes", "bound_ms", "share_of_bound", "logits_rel_err",
          "logits_cos", "top1_match", "gate_baseline", "gate_cos", "gate_rel_err", "gate_bound", "gate", "gate_note",
          "setup"]


def write_outputs(rows: list[dict], out: Path, args, plots: bool = True) -> str:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "e2e.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    md = report(rows, args)
    (out / "e2e.md").write_text(md)
    if not plots:
        return md
    try:
        plot(rows, out / "e2e.png")
    except Exception as e:  # noqa: BLE001 - matplotlib is optional
        print(f"plot skipped: {e}")
    return md


def _row(rows, config, metric, batch) -> dict | None:
    return next((r for r in rows if r["config"] == config and r["metric"] == metric and r["batch"] == batch), None)


def _value(rows, config, metric, batch):
    r = _row(rows, config, metric, batch)
    return None if r is None else r["value"]


def _ratio_cells(rows, config, metric, batch) -> list[str]:
    v, ref = _value(rows, config, metric, batch), _value(rows, "bf16", metric, batch)
    return [_fmt(v), _fmt(v / ref if v and ref else None, 2)]


def report(rows: list[dict], args) -> str:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    modes = [m for m in MODES if m in args.modes]
    ttfts = ["eager"] + (["compile"] if measures_compile_ttft(args, modes) else [])
    head = ["config"]
    for m in ttfts:
        head += [f"TTFT {m} b1 ms", "x bf16"]
    for b in args.batches:
        for m in modes:
            head += [f"TPOT {m} b{b} ms", "x bf16"]
    head += [f"host ms/step {m} b1" for m in modes if m != "graph"]
    head += ["quant share", "decode kernels", "peak GB", "logits cos vs bf16", "top1 match"]
    agrees = {"compile", "graph"} & set(modes)
    if agrees:
        head += ["compiled step cos vs eager b1", "eager step cos, input's last bit changed b1"]
    head += ["gate"]
    lines = [
        (f"# tileq e2e: {args.checkpoint} against bf16 with its shapes (random weights)"
         if getattr(args, "checkpoint", None) else
         f"# tileq e2e: {MODELS[getattr(args, 'model', 'qwen3-14b')][0]}-shaped decode ({args.layers} layers"
         f"{', 1/8 width' if args.small else ''})"),
        "",
        f"- date: {time.strftime('%Y-%m-%d')}, GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"transformers {_tf_version()}, Triton {_triton_version()}",
        f"- prompt {args.prompt} tokens; modes: eager = transformers' forward; compile = torch.compile(model.forward, "
        f"fullgraph=True), no CUDA graph; graph = the compiled step captured in one CUDA graph and replayed "
        f"{args.tokens} times; eager and compile TPOT: {args.eager_tokens} steps in {EAGER_ROUNDS} rounds on the GPU "
        "timeline (host gaps count), the median round; TTFT median of 5; static KV cache; greedy",
        f"- command: `tileq e2e --model {getattr(args, 'model', 'qwen3-14b')} --layers {args.layers} --configs {','.join(args.configs)} "
        f"--batches {','.join(map(str, args.batches))} --modes {','.join(modes)} --prompt {args.prompt}"
        f"{' --fuse' if args.fuse else ''}{' --profile-host' if getattr(args, 'profile_host', False) else ''}"
        f"{'' if getattr(args, 'compile_ttft', True) else ' --no-compile-ttft'}`",
        f"- {_gate_words()}",
        *_bound_words(rows, args),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for c in configs:
        cells = [c]
        for m in ttfts:
            cells += _ratio_cells(rows, c, f"ttft_{m}_ms", 1)
        for b in args.batches:
            for m in modes:
                cells += _ratio_cells(rows, c, f"tpot_{m}_ms", b)
        cells += [_fmt(_value(rows, c, f"host_ms_{m}", 1)) for m in modes if m != "graph"]
        share = _value(rows, c, "quant_share", 1)
        kernels = _value(rows, c, "decode_kernels", 1)
        cells += [f"{share:.1%}" if share is not None and not math.isnan(share) else "-",
                  "-" if kernels is None else f"{kernels:.0f}",
                  _fmt(_value(rows, c, "peak_mem_gb", max(args.batches)), 1)]
        agree = next((r for r in rows if r["config"] == c and "logits_cos" in r), {})
        cells += [_fmt(agree.get("logits_cos"), 4), _fmt(agree.get("top1_match"), 2)]
        if agrees:
            cells += [_fmt(_value(rows, c, "compiled_step_cos", 1), 4), _fmt(_value(rows, c, "eager_step_floor_cos", 1), 4)]
        gate = _gate_of(rows, c)
        cells.append(gate["gate"] if gate else "baseline" if c == "bf16" else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += _bound_table(rows, configs, args, modes)
    gated = [(c, g) for c in configs if (g := _gate_of(rows, c))]
    if gated:
        lines += ["", "Gate (before timing; rel = max |logits - baseline's| / max |baseline's|):", "",
                  "| config | baseline | cos | rel | bound | result |", "|---|---|---|---|---|---|"]
        for c, g in gated:
            note = f" ({g['gate_note'].replace('|', '/')})" if g.get("gate_note") else ""
            lines.append(f"| {c} | {g['gate_baseline']} | {_fmt(g['gate_cos'], 6)} | {_fmt(g['gate_rel_err'], 4)} | "
                         f"{g['gate_bound']} | {g['gate']}{note} |")
    cats = [c for c, _ in KERNEL_CATEGORIES] + ["other"]
    tables = (("decode", "decode step (the compiled step where compile or graph is measured, else eager)"),
              ("prefill", f"eager prefill ({args.prompt}-token prompt)"),
              ("prefill_compile", f"compiled prefill ({args.prompt}-token prompt, --profile-host)"))
    for what, how in tables:
        if not any(r["metric"].startswith(f"{what}_kernel_ms_") for r in rows):
            continue
        lines += ["", f"GPU kernel time of one {how} at batch 1, ms (torch profiler):", "",
                  "| config | " + " | ".join(cats) + " | total |", "|---" * (len(cats) + 2) + "|"]
        for c in configs:
            vals = [_value(rows, c, f"{what}_kernel_ms_{cat}", 1) for cat in cats]
            if all(v is None for v in vals):
                continue
            total = sum(v or 0 for v in vals)
            lines.append(f"| {c} | " + " | ".join(_fmt(v) for v in vals) + f" | {total:.2f} |")
    setups = {r["config"]: r["setup"] for r in rows}
    lines += ["", "Setup per config:", ""] + [f"- {c}: {s}" for c, s in setups.items()]
    return "\n".join(lines) + "\n"


def _bound_words(rows, args) -> list[str]:
    """The report header's line on the byte bound (where a run counted step bytes or measured the
    bandwidth)."""
    bandwidth = getattr(args, "bandwidth", None)
    if bandwidth is None and not any("step_bytes" in r for r in rows):
        return []
    return [f"- byte bound of a decode step: the bytes it must read (bench/bound.py: every weight, scale and "
            f"norm once, a tied lm_head once, the batch's embedding rows, of each experts module the expected "
            f"distinct experts of batch x top-k uniform draws, the KV cache at {bound_context(args)} positions: "
            f"the prompt and half the decode steps of a batch's measurement) / the bandwidth bf16 cuBLAS reaches on "
            f"decode GEMVs in this run: {_bandwidth_words(bandwidth or (None, 'not measured'))}; share of bound = "
            "bound / TPOT (1.00: the step streams its bytes at that bandwidth)"]


def _bound_table(rows, configs, args, modes) -> list[str]:
    """The decode steps against their byte bound, per batch: step GB (by part), bound ms, and per
    mode the share of bound, bf16's beside each config's."""
    if not any("step_bytes" in r for r in rows):
        return []
    head = ["config"]
    for b in args.batches:
        head += [f"step GB b{b}", f"bound ms b{b}", *(f"share {m} b{b}" for m in modes)]
    lines = ["", "Decode step against its byte bound (header; share = bound ms / TPOT, bf16's in brackets):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in configs:
        if not any(_value(rows, c, f"step_bytes_{p}", b) is not None for p in bound.PARTS for b in args.batches):
            continue
        cells = [c]
        for b in args.batches:
            parts = {p: _value(rows, c, f"step_bytes_{p}", b) or 0.0 for p in (*bound.PARTS, "total")}
            words = " + ".join(f"{name} {parts[p] / 1e9:.2f}" for p, name in
                               (("weights", "w"), ("experts", "experts"), ("kv_cache", "KV")) if parts[p])
            timed = [r for m in modes if (r := _row(rows, c, f"tpot_{m}_ms", b))]
            cells += [f"{parts['total'] / 1e9:.2f} ({words})" if parts["total"] else "-",
                      _fmt(next((r["bound_ms"] for r in timed if "bound_ms" in r), None), 3)]
            for m in modes:
                share = (_row(rows, c, f"tpot_{m}_ms", b) or {}).get("share_of_bound")
                ref = (_row(rows, "bf16", f"tpot_{m}_ms", b) or {}).get("share_of_bound")
                cells.append("-" if share is None else f"{share:.0%}" + (
                    f" ({ref:.0%})" if ref is not None and c != "bf16" else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _gate_of(rows, config) -> dict | None:
    return next((r for r in rows if r["config"] == config and r["metric"] == "gate"), None)


def _gate_words() -> str:
    """The gate and its bounds in a sentence (the report's header)."""
    ref, bf = GATE_BOUNDS["reference"], GATE_BOUNDS["bf16"]
    return (f"gate, before a config is timed: its first-step logits (the prompt's prefill at batch 1, last "
            f"position) against its reference backend (the same model with TILEQ_BACKEND=reference): cos >= "
            f"{ref.min_cos}, max |diff| / max |reference| <= {ref.max_rel:.4f}, or {ref.widen:g}x {ref.yardstick}, "
            f"if larger; without a reference (peers) against bf16: cos >= {bf.min_cos}, rel <= {bf.max_rel}, or "
            f"{bf.widen:g}x {bf.yardstick.format(counterpart='the tileq config of the same scheme')}; a config "
            "that fails is FAILED and not timed")


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def _triton_version() -> str:
    import triton

    return triton.__version__


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    metrics = sorted({(r["metric"], r["batch"]) for r in rows if r["metric"].startswith("tpot_")})
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(configs)), 4))
    width = 0.8 / max(len(metrics), 1)
    for i, (metric, batch) in enumerate(metrics):
        vals = [_value(rows, c, metric, batch) or 0 for c in configs]
        ax.bar([j + i * width for j in range(len(configs))], vals, width,
               label=f"{metric.removeprefix('tpot_').removesuffix('_ms')} b{batch}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))], configs)
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("Qwen3-14B-shaped decode: time per output token")
    if metrics:  # (a run whose every config FAILED its gate has no TPOT)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


CHECKPOINT_CONFIGS = ("A8W8", "W4A16")  # --make-checkpoint's default --configs


def make_checkpoints(out: str, names: list[str], layers: int, *, small: bool = False, seed: int = 0,
                     device=None, max_shard_size="5GB", model: str = "qwen3-14b") -> list[Path]:
    """For each config name: the e2e model (``build_model``: same seed, so the same weights for
    every config) quantized with it and written by ``tileq.save_pretrained`` into OUT/<config>.
    Prints each folder, its format, files and sizes, and the time of each part."""
    from ..formats import save_pretrained
    from ..nn import config_from_name, quantize_
    from ..version import __version__

    bad = [c for c in names if c.partition(":")[0] == "bf16" or c.partition(":")[2]]
    if bad:
        raise UnsupportedError(expect("--configs", f"tileq config names without ':fused' ({', '.join(CONFIGS)})",
                                      ",".join(bad)))
    configs = [config_from_name(c) for c in names]  # (an unknown name fails before any work)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = ("1/8-width " if small else "") + MODELS[model][0]
    print(f"[make-checkpoint] {shape}-shaped, {layers} layers, on {device}; tileq {__version__}, "
          f"torch {torch.__version__}", flush=True)
    paths, t_all = [], time.time()
    for config in configs:
        t0 = time.time()
        net = build_model(layers, device, seed, small=small, model=model)
        _sync(device)
        t1 = time.time()
        summary = quantize_(net, config)
        _sync(device)
        t2 = time.time()
        path = Path(out) / config.name
        fmt = save_pretrained(net, path, max_shard_size=max_shard_size)
        t3 = time.time()
        files = sorted(f for f in path.iterdir() if f.is_file())
        size = sum(f.stat().st_size for f in files)
        print(f"[make-checkpoint] {config.name}: {path} ({fmt}, {size / 1e9:.2f} GB; {len(summary.converted)} layers "
              f"quantized, {len(summary.skipped)} kept); build {t1 - t0:.1f} s, quantize {t2 - t1:.1f} s, save "
              f"{t3 - t2:.1f} s", flush=True)
        for f in files:
            print(f"    {f.name:40s} {f.stat().st_size / 1e6:12.1f} MB")
        paths.append(path)
        del net, summary
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"[make-checkpoint] {len(paths)} checkpoint(s) in {time.time() - t_all:.1f} s", flush=True)
    return paths


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(args) -> int:
    args.model = getattr(args, "model", None) or "qwen3-14b"
    if getattr(args, "layers", None) is None:  # the model's own depth
        args.layers = MODELS[args.model][1]["num_hidden_layers"]
    if getattr(args, "make_checkpoint", None):
        make_checkpoints(args.make_checkpoint, args.configs or list(CHECKPOINT_CONFIGS), args.layers,
                         small=args.small, seed=args.seed, max_shard_size=args.max_shard_size, model=args.model)
        return 0
    if args.configs is None:
        args.configs = list(ALL_CONFIGS)
    if not torch.cuda.is_available():
        raise UnsupportedError(expect("tileq e2e", "a CUDA GPU", "no CUDA device"))
    if getattr(args, "checkpoint", None):
        args.configs = ["bf16", "checkpoint:fused" if args.fuse else "checkpoint"]
        from transformers import AutoConfig

        args.vocab = AutoConfig.from_pretrained(args.checkpoint).vocab_size
    bases = {c: split_config(c)[0] for c in args.configs}
    bad = [c for c, b in bases.items() if b not in TORCHAO_PEERS and (b.partition(":")[0] not in (*ALL_CONFIGS, "checkpoint")
           or b.partition(":")[2] not in ("", "fused"))]
    if bad:
        raise UnsupportedError(expect("--configs", f"names from {', '.join(ALL_CONFIGS)}, each optionally "
                                                   f"with ':fused' and '@SWITCH=VALUE', or peers "
                                                   f"{', '.join(TORCHAO_PEERS)}", ",".join(bad)))
    return measure(args, torch.device("cuda"))


def order_configs(configs: list[str]) -> list[str]:
    """bf16 first (every ratio and gate reads its logits), then the tileq configs, then the peers (a
    peer's bound reads the tileq config of its scheme), each in the order given."""
    peers = [c for c in configs if split_config(c)[0] in TORCHAO_PEERS]
    return ["bf16", *(c for c in configs if c != "bf16" and c not in peers), *peers]


def measure(args, dev) -> int:
    """Every config of ``args.configs`` on ``dev``: built, gated, timed if it passes; e2e.csv and e2e.md
    written after each (what is measured survives a cut-off run) and the report printed at the end.
    Returns 1 where a config FAILED its gate, else 0."""
    args.checkpoint = getattr(args, "checkpoint", None)
    args.configs = order_configs(args.configs)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    vocab = getattr(args, "vocab", None) or (4096 if args.small else QWEN3_14B["vocab_size"])
    prompts = {b: torch.randint(0, vocab, (b, args.prompt), generator=gen, device=dev)
               for b in sorted(set([1, *args.batches]))}
    rows, ref, passed, failed = [], None, {}, []
    for name in args.configs:
        t0 = time.time()
        print(f"[e2e] {name}: building and measuring ...", flush=True)
        try:
            with switches(split_config(name)[1]):
                got, logits, gate = run_config(name, args, prompts, ref, passed, dev)
        except PeerUnavailable as e:  # a peer is measured where importable: said, not failed
            print(f"[e2e] {name}: not measured: {e}", flush=True)
            rows.append(dict(config=name, layers=args.layers, metric="unavailable", batch=0, value=float("nan"),
                             setup=str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - one config failing must not hide the others
            print(f"[e2e] {name}: FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(config=name, layers=args.layers, metric="error", batch=0, value=float("nan"),
                             setup=f"{type(e).__name__}: {e}"))
            gc.collect()
            _empty_cache()
            continue
        rows.extend(got)
        if name == "bf16":
            ref = logits
        if gate is not None and not gate.passed:
            failed.append(name)
            print(f"[e2e] {name}: FAILED its gate: not timed", flush=True)
            write_outputs(rows, Path(args.out), args, plots=False)
            continue
        if gate is not None and gate.baseline == "reference" and ref is not None and not args.checkpoint:
            passed[name] = logits_gap(logits, ref)  # its scheme's deviation from bf16: a peer's yardstick
        summary = ", ".join(f"{r['metric']}[b{r['batch']}]={r['value']:.3f}" for r in got
                            if r["metric"].startswith(("tpot", "ttft")))
        print(f"[e2e] {name}: {summary} ({time.time() - t0:.0f} s)", flush=True)
        write_outputs(rows, Path(args.out), args, plots=False)  # what is measured survives a cut-off run
    md = write_outputs(rows, Path(args.out), args)
    print(md)
    if failed:
        print(f"[e2e] FAILED their gate, not timed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


def register_cli(sub) -> None:
    """``tileq e2e`` running ``run``; its options are tileq.bench.cli.add_e2e's (importable
    without torch, for ``--help``)."""
    from .cli import add_e2e

    add_e2e(sub).set_defaults(func=run)
