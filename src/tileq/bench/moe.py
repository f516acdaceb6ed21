"""``tileq moebench``: one MoE layer's routed experts at Qwen3-30B-A3B and DeepSeek-V3 shapes, tileq
configs against the bf16 and fp8 grouped GEMMs of torch and transformers' eager loop.

Per (model, tokens, routing) every implementation computes the same function (gate_up, SiLU·mul,
down, routing weights, combine) from the same hidden states and routing:

- ``tileq <config>``: ``tileq.moe.fused_moe`` on ``QuantExperts`` of that config (``--forms
  masked,contiguous``: each grouped-GEMM form forced, the data for ``choose_form``'s threshold);
- ``bf16 grouped_mm``: transformers' "grouped_mm" experts implementation (``torch._grouped_mm``);
- ``fp8 scaled_grouped_mm``: e4m3 row-wise activations x per-channel weights through
  ``torch._scaled_grouped_mm`` with the same glue (absent or failing in a torch build: the row says
  why);
- ``eager loop``: transformers' own per-expert loop, which synchronizes per expert (``nonzero``)
  and so cannot be captured: timed without a graph, up to ``EAGER_MAX_TOKENS`` tokens.

Everything else is timed as CUDA-graph replays with the L2 flushed (bench/timing.py). Each result
is checked against the bf16 one first (relative Frobenius error, reported). The touched expert
weight bytes (the experts the routing hits, gate_up + down + scales) over the time give TB/s,
the number that matters at small token counts where the weights dominate the traffic; against the
bandwidth bf16 cuBLAS reaches on decode GEMVs of one expert's shapes, measured once per run
(bench/bound.py), they give each row's share of its byte bound (``with_bound``: bound = touched bytes /
that bandwidth, share = bound / time; the router is not part of the timed function, nor of its bytes).

Routing: 'uniform' (every expert equally likely) or 'skewed' (expert e drawn with probability
~ 1 / (e + 1)^1.2, so a few experts take most tokens).
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UnsupportedError, expect
from . import bound


@dataclass(frozen=True)
class MoeShape:
    hidden: int
    inter: int
    experts: int
    top_k: int


MODELS = {"qwen3-30b-a3b": MoeShape(2048, 768, 128, 8), "deepseek-v3": MoeShape(7168, 2048, 256, 8)}
TOKENS = (1, 16, 128, 1024, 4096)
ROUTINGS = ("uniform", "skewed")
CONFIGS = ("FP8Block", "A8W8", "FP8Row", "W4A16", "W4A8")
BASELINES = ("bf16", "fp8", "eager")
FORMS = ("auto", "contiguous", "masked")  # tileq.moe.layer.FORMS: 'auto' is choose_form's pick
EAGER_MAX_TOKENS = 16  # the eager loop launches ~5 kernels per hit expert and syncs: slow beyond
SKEW = 1.2
TOLERANCE = {"int4": 0.25, "8bit": 0.12}  # relative error vs bf16 above which a row is marked failed
DRY_SHAPE = MoeShape(256, 128, 8, 2)


def make_routing(t: int, shape: MoeShape, kind: str, gen: torch.Generator, device):
    """(topk_ids int64 [T, k], topk_weights fp32 [T, k], normalized): k distinct experts per token."""
    e, k = shape.experts, shape.top_k
    g = -torch.log(-torch.log(torch.rand(t, e, generator=gen, device=device).clamp_min(1e-20)))  # Gumbel
    if kind == "skewed":
        g = g - SKEW * torch.log(torch.arange(1, e + 1, device=device, dtype=torch.float32))
    ids = g.topk(k, dim=-1).indices
    w = torch.rand(t, k, generator=gen, device=device) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def expert_bytes(experts) -> int:
    """Bytes of one expert's stored weights and scales (a QuantExperts, or bf16 [E, ...] weights)."""
    tensors = experts.values() if isinstance(experts, dict) else experts.state_dict().values()
    return sum(t.numel() * t.element_size() for t in tensors) // experts_count(experts)


def experts_count(experts) -> int:
    return next(iter(experts.values())).shape[0] if isinstance(experts, dict) else experts.num_experts


class _Bf16Experts(torch.nn.Module):
    """What transformers' experts implementations read off an experts module (transformers.integrations.moe)."""

    def __init__(self, gate_up, down):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_up_proj, self.down_proj = gate_up, down
        self.num_experts = gate_up.shape[0]
        self.act_fn = ACT2FN["silu"]
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self.has_post_expert_norm, self._is_expert_parallel = False, False  # read from transformers 5.25 on

    def _apply_gate(self, gate_up_out):
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def bf16_fn(mod: _Bf16Experts):
    from transformers.integrations.moe import grouped_mm_experts_forward

    return lambda x, ids, w: grouped_mm_experts_forward(mod, x, ids, w)


def eager_fn(mod: _Bf16Experts):
    """transformers' eager experts loop (the body of e.g. Qwen3MoeExperts.forward)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    loop = getattr(Qwen3MoeExperts.forward, "__wrapped__", Qwen3MoeExperts.forward)
    return lambda x, ids, w: loop(mod, x, ids, w)


def fp8_fn(gate_up: torch.Tensor, down: torch.Tensor):
    """(fn, None) running the experts through ``torch._scaled_grouped_mm`` (e4m3 per-row x
    per-channel), or (None, why not)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return None, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    from ..quant import quantize_weight

    def quantized(w):
        qs, ss = zip(*(quantize_weight(w[e], "fp8", granularity="col") for e in range(w.shape[0])))
        return torch.stack(qs), torch.stack(ss)

    (wq1, s1), (wq2, s2) = quantized(gate_up), quantized(down)

    def rowq(x):
        s = (x.float().abs().amax(-1) / 448.0).clamp_min(1e-12)
        return (x.float() / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), s

    def fn(x, ids, w):
        t, k = ids.shape
        flat = ids.reshape(-1)
        sorted_ids, perm = torch.sort(flat, stable=True)
        ends = torch.searchsorted(sorted_ids, torch.arange(1, wq1.shape[0] + 1, device=x.device)).to(torch.int32)
        xq, xs = rowq(x[perm // k])
        gu = torch._scaled_grouped_mm(xq, wq1.transpose(1, 2), xs, s1, offs=ends, out_dtype=torch.bfloat16)
        gate, up = gu.chunk(2, dim=-1)
        hq, hs = rowq(torch.nn.functional.silu(gate) * up)
        y = torch._scaled_grouped_mm(hq, wq2.transpose(1, 2), hs, s2, offs=ends, out_dtype=torch.bfloat16)
        y = y.float() * w.reshape(-1)[perm, None]
        rank = torch.empty_like(perm)
        rank[perm] = torch.arange(perm.numel(), device=x.device)
        return y[rank].view(t, k, -1).sum(1).to(x.dtype)

    return fn, None


def _rel_err(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def _quantized(gate_up, down, name: str, cache: dict):
    """QuantExperts of config ``name``; configs storing identical weights share one quantization
    (W4A16 and W4A8 with the same groups)."""
    from ..moe import QuantExperts
    from ..nn import config_from_name

    cfg = config_from_name(name)
    key = (cfg.weight_dtype, cfg.weight_granularity, cfg.group_k, cfg.group_n)
    if key in cache:
        ex = QuantExperts(gate_up.shape[0], gate_up.shape[2], down.shape[2], config=cfg, device=gate_up.device)
        ex.load_state_dict(cache[key])
        return ex
    ex = QuantExperts.from_weights(gate_up, down, cfg)
    cache.clear()  # one stored copy at a time (DeepSeek-V3's experts are 11 GB in 8 bits)
    cache[key] = ex.state_dict()
    return ex


def measure_model(model: str, shape: MoeShape, tokens, routings, configs, baselines, timer, eager_timer,
                  device, gen, forms=("auto",)) -> list[dict]:
    from ..moe import fused_moe

    e, h, i = shape.experts, shape.hidden, shape.inter
    gate_up = (torch.randn(e, 2 * i, h, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    bf16_mod = _Bf16Experts(gate_up, down)
    impls = {}
    if "bf16" in baselines:
        impls["bf16 grouped_mm"] = (bf16_fn(bf16_mod), expert_bytes({"a": gate_up, "b": down}), "")
    if "fp8" in baselines:
        fn, why = fp8_fn(gate_up, down)
        impls["fp8 scaled_grouped_mm"] = (fn, expert_bytes({"a": gate_up, "b": down}) // 2, why or "")
    if "eager" in baselines:
        impls["eager loop"] = (eager_fn(bf16_mod), expert_bytes({"a": gate_up, "b": down}),
                               f"not graphed (syncs per expert); up to {EAGER_MAX_TOKENS} tokens")
    rows = []
    cache: dict = {}
    cases = [(t, r, make_routing(t, shape, r, gen, device)) for t in tokens for r in routings]
    xs = {t: torch.randn(t, h, generator=gen, device=device).to(torch.bfloat16) for t in tokens}

    def run_impl(label, fn, nbytes, note, exact_ref):
        for t, r, (ids, w) in cases:
            row = {"model": model, "tokens": t, "routing": r, "impl": label, "note": note}
            hit = int(torch.unique(ids).numel())
            row["experts_hit"], row["touched_gb"] = hit, hit * nbytes / 1e9
            if fn is None:
                rows.append(row)
                continue
            if label == "eager loop" and t > EAGER_MAX_TOKENS:
                continue
            x = xs[t]
            try:
                out = fn(x, ids, w)
            except Exception as err:  # noqa: BLE001 - a baseline this torch cannot run: say why
                row["note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                rows.append(row)
                continue
            ref = exact_ref.get((t, r))
            row["rel_err"] = 0.0 if ref is None else _rel_err(out, ref)
            if ref is None:
                exact_ref[(t, r)] = out
            tm = (eager_timer if label == "eager loop" else timer).measure(lambda fn=fn, x=x, ids=ids, w=w: fn(x, ids, w))
            row["us"] = tm.median_ms * 1e3
            row["tbps"] = row["touched_gb"] * 1e9 / (tm.median_ms * 1e-3) / 1e12
            rows.append(row)

    refs: dict = {}  # the first implementation's outputs (bf16 grouped_mm unless left out): the errors' reference
    for label in sorted(impls, key=lambda lb: lb != "bf16 grouped_mm"):
        run_impl(label, *impls[label], refs)
    for name in configs:
        ex = _quantized(gate_up, down, name, cache)
        tol = TOLERANCE["int4" if ex.spec.weight_dtype == "int4" else "8bit"]
        start = len(rows)
        for form in forms:
            label = f"tileq {name}" + ("" if form == "auto" else f" [{form}]")
            run_impl(label, lambda x, ids, w, ex=ex, form=form: fused_moe(x, (ids, w), ex, form=form),
                     expert_bytes(ex), "", refs)
        for row in rows[start:]:
            if row.get("rel_err", 0.0) > tol:
                row["note"] = f"FAILED: error {row['rel_err']:.3f} vs bf16 above {tol}"
        del ex
    del cache
    for row in rows:
        base = next((b for b in rows if b["impl"] == "bf16 grouped_mm" and b["tokens"] == row["tokens"]
                     and b["routing"] == row["routing"] and "us" in b), None)
        if base is not None and "us" in row:
            row["vs_bf16"] = row["us"] / base["us"]
    return rows


def bound_shapes(models) -> list[tuple[int, int]]:
    """One expert's GEMV weight shapes (N, K) of each of ``models``: gate_up [2I, H] and down [H, I]."""
    return [shape for s in (MODELS[m] for m in models) for shape in ((2 * s.inter, s.hidden), (s.hidden, s.inter))]


def with_bound(rows, bandwidth: float | None) -> None:
    """Each timed row's ``bound_us`` (its touched expert bytes at ``bandwidth``, bytes per second) and
    ``share_of_bound`` (bound_us / us), in place; nothing without a bandwidth."""
    for row in rows:
        if bandwidth and "us" in row:
            row["bound_us"] = row["touched_gb"] * 1e9 / bandwidth * 1e6
            row["share_of_bound"] = row["bound_us"] / row["us"]


FIELDS = ["model", "tokens", "routing", "impl", "us", "vs_bf16", "experts_hit", "touched_gb", "tbps", "bound_us",
          "share_of_bound", "rel_err", "note"]


def write(rows, out: Path, header: list[str]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "moe.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    def num(v, fmt):
        return "" if v is None else format(v, fmt)

    lines = header + ["", "| model | tokens | routing | impl | us | x bf16 | experts hit | TB/s touched (share of "
                      "bound) | rel err | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = "" if r.get("share_of_bound") is None else f" ({r['share_of_bound']:.0%})"
        lines.append(f"| {r['model']} | {r['tokens']} | {r['routing']} | {r['impl']} | {num(r.get('us'), '.1f')} | "
                     f"{num(r.get('vs_bf16'), '.2f')} | {r.get('experts_hit', '')} | "
                     f"{num(r.get('tbps'), '.2f')}{share} | {num(r.get('rel_err'), '.4f')} | {r.get('note', '')} |")
    md = "\n".join(lines) + "\n"
    (out / "moe.md").write_text(md)
    return md


def dry(args) -> int:
    """The cases the options select, then one tiny layer end to end on the CPU (tileq's reference
    executor against transformers' eager loop): the glue, not the speed."""
    from ..moe import fused_moe

    for model in args.models:
        s = MODELS[model]
        print(f"{model}: H={s.hidden} I={s.inter} E={s.experts} top-{s.top_k}; tokens {args.tokens}; "
              f"routings {args.routings}; tileq {args.configs}; baselines {args.baselines}")
    gen = torch.Generator().manual_seed(0)
    s = DRY_SHAPE
    gate_up = (torch.randn(s.experts, 2 * s.inter, s.hidden, generator=gen) * 0.05).to(torch.bfloat16)
    down = (torch.randn(s.experts, s.hidden, s.inter, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(5, s.hidden, generator=gen).to(torch.bfloat16)
    for routing in args.routings:
        ids, w = make_routing(5, s, routing, gen, "cpu")
        mod = _Bf16Experts(gate_up, down)
        ref = eager_fn(mod)(x, ids, w)
        try:
            print(f"dry {routing} bf16 grouped_mm: rel err vs eager bf16 {_rel_err(bf16_fn(mod)(x, ids, w), ref):.4f}")
        except Exception as err:  # noqa: BLE001 - a torch without a CPU grouped_mm: say so
            print(f"dry {routing} bf16 grouped_mm: not run on this CPU ({type(err).__name__}: {err})")
        cache: dict = {}
        for name in args.configs:
            ex = _quantized(gate_up, down, name, cache)
            err = _rel_err(fused_moe(x, (ids, w), ex, backend="reference"), ref)
            print(f"dry {routing} tileq {name}: rel err vs eager bf16 {err:.4f}")
    return 0


def run(args) -> int:
    if args.dry:
        return dry(args)
    if not torch.cuda.is_available():
        raise UnsupportedError(expect("tileq moebench", "a CUDA GPU (or --dry)", "no CUDA device"))
    from .timing import Timer, TimingConfig

    dev = torch.device("cuda")
    timer = Timer(dev, TimingConfig(warmup=5, runs=args.runs, flush="read", graphs=True))
    eager_timer = Timer(dev, TimingConfig(warmup=2, runs=max(3, args.runs // 4), flush="read", graphs=False))
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    t0 = time.time()
    shapes = bound_shapes(args.models)
    bandwidth = bound.gemv_bandwidth(shapes, dev)  # once per run: every row's byte bound divides by it
    for model in args.models:
        rows += measure_model(model, MODELS[model], args.tokens, args.routings, args.configs, args.baselines,
                              timer, eager_timer, dev, gen, args.forms)
        torch.cuda.empty_cache()
    with_bound(rows, bandwidth)
    title = (f"# tileq moebench ({time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, {time.time() - t0:.0f} s)")
    header = [title, "", timer.describe(),
              f"eager loop: {eager_timer.describe()}",
              f"share of bound: (the touched expert bytes / {bandwidth / 1e12:.2f} TB/s, the bf16 GEMV bandwidth: "
              f"{bound.bandwidth_method(shapes)}) / the time; the router is not timed here (tileq e2e --model "
              "qwen3-moe: a whole step's share)"]
    md = write(rows, Path(args.out), header)
    print(md)
    failed = [r for r in rows if str(r.get("note", "")).startswith("FAILED")]
    return 1 if failed else 0


def register_cli(sub) -> None:
    """``tileq moebench`` running ``run``; its options are tileq.bench.cli.add_moebench's."""
    from .cli import add_moebench

    add_moebench(sub).set_defaults(func=run)
