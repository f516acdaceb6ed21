"""tileq.grouped_linear on a GPU: every scheme at MoE sizes against the reference, both forms,
uniform and skewed routing, a CUDA-graph capture replayed with new offsets / counts, and a
bandwidth report (``-s`` prints it): TB/s of the touched experts' weight bytes at decode sizes,
and fp8 block-scaled against bf16 ``torch._grouped_mm`` at prefill sizes; each shape's planned
config ('plan') and the variants around it ('variant'), so one run shows which tile wins:

    pytest -m gpu -s -q tests/test_grouped_gpu.py -k "report"
"""

import statistics
from functools import partial

import pytest
import torch

import tileq
from tileq import api_grouped
from tileq.dispatch.plan import make_plan
from tileq.kernels.grouped.launch import GroupedLaunch
from tileq.kernels.grouped.spec import GroupedConfig, config_problem
from tileq.reference_grouped import grouped_linear_ref
from tileq.testing import check_close

pytestmark = pytest.mark.gpu
F8 = torch.float8_e4m3fn
DEV = "cuda"

# (name, x dtype, w dtype ('i4': uint8 packed), scheme, x_scale kind, group_k)
CASES = [
    ("fp8_block", F8, F8, "abquant", "group", 128),
    ("fp8_rowcol", F8, F8, "rowcol", "row", 128),
    ("int8_rowcol", torch.int8, torch.int8, "rowcol", "row", 128),
    ("w4a16", torch.bfloat16, "i4", "bquant", None, 128),
    ("w4a8", F8, "i4", "bquant", "row", 128),
]
SHAPES = [(128, 1536, 2048), (8, 2048, 7168)]  # (E, N, K): Qwen3-30B-A3B gate_up; DeepSeek-V3-like


def _values(dtype, shape, gen):
    if dtype == "i4":
        return torch.randint(0, 256, shape, generator=gen, device=DEV, dtype=torch.uint8)
    if dtype == torch.int8:
        return torch.randint(-100, 101, shape, generator=gen, device=DEV, dtype=torch.int8)
    return (torch.randn(shape, generator=gen, device=DEV) * 2).to(dtype)


def _counts(tokens: int, e: int, topk: int, skewed: bool, gen) -> torch.Tensor:
    """Rows per expert of ``tokens`` tokens routed to ``topk`` experts each (on the device)."""
    topk = min(topk, e)
    scores = torch.rand(tokens, e, generator=gen, device=DEV)
    if skewed:
        scores[:, : max(e // 8, 1)] += 1.0  # most tokens pick the first eighth of the experts
    ids = scores.topk(topk, dim=1).indices
    return torch.bincount(ids.flatten(), minlength=e).to(torch.int32)


def make(case, e, n, k, counts, masked, gen, row_scale=True, spare=3):
    _, x_dtype, w_dtype, scheme, xs_kind, group_k = case
    gk = -(-k // group_k)
    w = _values(w_dtype, (e, n, k // 2 if w_dtype == "i4" else k), gen)
    if scheme == "abquant":
        ws = torch.rand(e, -(-n // 128), gk, generator=gen, device=DEV) + 0.5
    elif scheme == "bquant":
        ws = torch.rand(e, n, gk, generator=gen, device=DEV) / 16 + 0.01
    else:
        ws = torch.rand(e, n, generator=gen, device=DEV) / 16 + 0.01
    if masked:
        cap = max(int(counts.max()), 1)
        lead, index = (e, cap), {"counts": counts}
    else:
        offs = torch.zeros(e + 1, dtype=torch.int32, device=DEV)
        offs[1:] = counts.cumsum(0)
        lead, index = (int(offs[-1]) + spare,), {"offsets": offs}
    x = _values(x_dtype, (*lead, k), gen)
    xs = None
    if xs_kind == "group":
        xs = torch.rand(*lead, gk, generator=gen, device=DEV) + 0.5
    elif xs_kind == "row":
        xs = torch.rand(*lead, generator=gen, device=DEV) / 16 + 0.01
    kw = dict(scheme=scheme, group_k=group_k, **index)
    if row_scale:
        kw["row_scale"] = torch.rand(*lead, generator=gen, device=DEV)
    return (x, w, xs, ws), kw


def _valid(kw, shape):
    mask = torch.zeros(shape, dtype=torch.bool, device=DEV)
    if "counts" in kw:
        c = kw["counts"].tolist()
        for e, n in enumerate(c):
            mask[e, :n] = True
    else:
        mask[: int(kw["offsets"][-1])] = True
    return mask


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("shape", SHAPES, ids=["E128", "E8"])
@pytest.mark.parametrize("tokens", [1, 16, 1024])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_matches_reference(case, shape, tokens, masked):
    e, n, k = shape
    gen = torch.Generator(DEV).manual_seed(tokens + e)
    counts = _counts(tokens, e, 8, skewed=tokens > 16, gen=gen)
    args, kw = make(case, e, n, k, counts, masked, gen)
    y = tileq.grouped_linear(*args, **kw)
    ref = grouped_linear_ref(*args, **kw)
    valid = _valid(kw, y.shape[:-1])
    check_close(y[valid], ref[valid])


@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_cuda_graph_replays_new_routing(masked):
    e, n, k, tokens = 16, 512, 1024, 8
    gen = torch.Generator(DEV).manual_seed(1)
    counts = _counts(tokens, e, 4, False, gen)
    args, kw = make(CASES[0], e, n, k, counts, masked, gen)
    if masked:  # a fixed capacity: every routing of 8 tokens fits
        x, w, xs, ws = args
        cap = tokens
        x = _values(F8, (e, cap, k), gen)
        xs = torch.rand(e, cap, -(-k // 128), generator=gen, device=DEV) + 0.5
        kw["row_scale"] = torch.rand(e, cap, generator=gen, device=DEV)
        args = (x, w, xs, ws)
    index = kw["counts"] if masked else kw["offsets"]
    out = torch.empty(*args[0].shape[:-1], n, dtype=torch.bfloat16, device=DEV)
    tileq.grouped_linear(*args, out=out, **kw)  # warm up (compile, cache) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tileq.grouped_linear(*args, out=out, **kw)
    for seed in range(3):
        g2 = torch.Generator(DEV).manual_seed(100 + seed)
        new = _counts(tokens, e, 4, seed == 1, g2)
        if masked:
            index.copy_(new)
        else:
            index[1:] = new.cumsum(0)  # T rows stay enough: tokens * 4 <= x's rows
        out.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        ref = grouped_linear_ref(*args, **kw)
        valid = _valid(kw, out.shape[:-1])
        check_close(out[valid], ref[valid])


def _validated(args, kw, out):
    x, w, xs, ws = args
    return api_grouped.validate(x, w, xs, ws, out_dtype=torch.bfloat16, group_n=None, row_scale=kw.get("row_scale"),
                                out=out, offsets=kw.get("offsets"), counts=kw.get("counts"), scheme=kw["scheme"],
                                group_k=kw["group_k"])


def _forced(args, kw, cfg, out):
    """A launch of ``cfg`` (not the planner's) on these arguments: () -> out."""
    spec, a = _validated(args, kw, out)
    launch = GroupedLaunch(spec, cfg, a, interpreted=False)
    return partial(launch, a.x, a.w, a.x_scale, a.w_scale, a.row_scale, a.index, a.out)


def _planned(args, kw, out):
    spec, _ = _validated(args, kw, out)
    return make_plan(spec, out.device)


# ---- bandwidth report ------------------------------------------------------------------------


def _time(fn, runs=50):
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=DEV)  # 4x the H200's L2
    for _ in range(5):
        fn()
    times = []
    for _ in range(runs):
        flush.sum()  # read-only flush (a write would leave dirty lines billed to the kernel)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def _launcher(args, out, kw):
    return partial(tileq.grouped_linear, *args, out=out, **kw)


def _graphed(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _decode_variants(spec, plan_cfg):
    """The planned decode tile's other swapped token width (16 or 32)."""
    out = []
    if plan_cfg.swap_ab:
        bm = 32 if plan_cfg.block_m == 16 else 16
        out.append(GroupedConfig(bm, 64, plan_cfg.block_k, plan_cfg.num_warps, plan_cfg.num_stages, True))
    return [c for c in out if c != plan_cfg and config_problem(spec, c) is None]


@pytest.mark.perf
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]], ids=["fp8_block", "int8_rowcol", "w4a16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["E128", "E8"])
def test_report_decode_bandwidth(case, shape):
    """TB/s of the touched experts' weight bytes (CUDA-graph replay, cold L2), 1-16 tokens top-8
    (T = tokens x 8 rows exactly in the contiguous form), the plan's config, then each variant's.
    Targets on an H200: >= 3.0 TB/s for 8-bit weights, >= 2.0 TB/s for int4."""
    e, n, k = shape
    for tokens in (1, 4, 16):
        for masked in (False, True):
            gen = torch.Generator(DEV).manual_seed(tokens)
            counts = _counts(tokens, e, 8, False, gen)
            args, kw = make(case, e, n, k, counts, masked, gen, spare=0)
            out = torch.empty(*args[0].shape[:-1], n, dtype=torch.bfloat16, device=DEV)
            ref = grouped_linear_ref(*args, **kw)
            valid = _valid(kw, out.shape[:-1])
            touched = int((counts > 0).sum())
            w_bytes = touched * args[1][0].numel() * args[1].element_size()
            plan = _planned(args, kw, out)
            runs = [("plan", plan.config, _launcher(args, out, kw))]
            spec = _validated(args, kw, out)[0]
            runs += [("variant", c, _forced(args, kw, c, out)) for c in _decode_variants(spec, plan.config)]
            for label, cfg, fn in runs:
                run = _graphed(fn)
                out.fill_(0)
                run()
                torch.cuda.synchronize()
                check_close(out[valid], ref[valid])
                s = _time(run)
                print(f"grouped {case[0]:12s} E={e} N={n} K={k} tokens={tokens:3d} "
                      f"{'masked' if masked else 'contig'} experts={touched:3d} {label:7s} {cfg.tag:28s} "
                      f"{s * 1e6:8.1f} us {w_bytes / s / 1e12:5.2f} TB/s of weights")


PREFILL_VARIANTS = [
    GroupedConfig(128, 128, 128, 8, 3, group_m=1 << 20),  # the launch order before row-tile groups
    GroupedConfig(128, 128, 128, 8, 3, group_m=16),
    GroupedConfig(128, 128, 128, 8, 4),
    GroupedConfig(128, 256, 128, 8, 3),
    GroupedConfig(64, 128, 128, 4, 4),
    GroupedConfig(64, 256, 128, 8, 3),
]


@pytest.mark.perf
@pytest.mark.parametrize("shape", SHAPES, ids=["E128", "E8"])
def test_report_prefill_vs_bf16_grouped_mm(shape):
    """fp8 1x128 x 128x128 against bf16 torch._grouped_mm (target on an H200: >= 1.3x at >= 1024
    tokens), the plan's config, then each variant's. Prints 'unavailable' where this torch has no
    _grouped_mm."""
    e, n, k = shape
    for tokens in (1024, 4096):
        gen = torch.Generator(DEV).manual_seed(tokens)
        counts = _counts(tokens, e, 8, False, gen)
        args, kw = make(CASES[0], e, n, k, counts, False, gen, row_scale=False)
        out = torch.empty(args[0].shape[0], n, dtype=torch.bfloat16, device=DEV)
        flops = 2 * int(counts.sum()) * n * k
        head = f"grouped fp8_block E={e} N={n} K={k} tokens={tokens} rows={int(counts.sum())}"
        base = None
        gmm = getattr(torch, "_grouped_mm", None)
        if gmm is None:
            print(head + "  bf16 _grouped_mm: unavailable")
        else:
            xb = args[0].to(torch.bfloat16)
            wb = args[1].to(torch.bfloat16).transpose(1, 2)  # [E, K, N] view of [E, N, K]
            ends = kw["offsets"][1:].contiguous()
            try:
                base = _time(_graphed(partial(gmm, xb, wb, offs=ends)), runs=20)
                print(head + f"  bf16 _grouped_mm {base * 1e6:8.1f} us")
            except RuntimeError as err:  # report, do not fail, a baseline that cannot run
                print(head + f"  bf16 _grouped_mm failed: {str(err)[:120]}")
        plan = _planned(args, kw, out)
        spec = _validated(args, kw, out)[0]
        runs = [("plan", plan.config, _launcher(args, out, kw))]
        runs += [("variant", c, _forced(args, kw, c, out)) for c in PREFILL_VARIANTS
                 if c != plan.config and config_problem(spec, c) is None]
        ref = grouped_linear_ref(*args, **kw)
        valid = _valid(kw, out.shape[:-1])
        for label, cfg, fn in runs:
            run = _graphed(fn)
            check_close(out[valid], ref[valid])
            ours = _time(run, runs=20)
            speed = f"  speed-up {base / ours:4.2f}x" if base else ""
            print(f"{head} {label:7s} {cfg.tag:28s} {ours * 1e6:8.1f} us {flops / ours / 1e12:6.1f} TFLOP/s{speed}")
