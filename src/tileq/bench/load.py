"""``tileq loadbench``: peak device memory and load time of three ways to get a quantized model
from a bf16 safetensors checkpoint:

- ``bf16``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=bf16, device_map=DEVICE)`` (the baseline);
- ``bf16+quantize_``: the same, then ``tileq.quantize_(model, config)`` and the bf16 leftovers freed
  (``gc.collect()``, ``torch.cuda.empty_cache()``), all inside the timing;
- ``on-load``: ``from_pretrained(..., quantization_config=config)`` (formats/hf_quantizer.py: each
  weight quantized as it is read; the bf16 model never exists).

Each (mode, config, repeat) runs in a fresh Python process (``python -m tileq.bench.load --one
JOB``), so that every peak, allocator cache and lazy import is its own; the child prints one result
line (``RESULT_PREFIX`` + JSON) and the parent collects them. In the child, before the clock
starts: imports (tileq, transformers, the model's class), the CUDA context, and for a quantized mode
the config's quantization code warmed on one small layer: the time is the load's, not the
process's first-call costs. Peak: ``torch.cuda.max_memory_allocated()`` after
``reset_peak_memory_stats()`` (CPU: n/a, times only). Resident: the bytes of every parameter and
buffer of the finished model, each storage counted once.

The checkpoint is written by this module (``write_checkpoint``): the e2e model's shapes
(``e2e.MODELS``: Qwen3-14B or Qwen3-30B-A3B, ``--layers`` deep; ``--small``: e2e's 1/8-width
model), random bf16 weights, in exactly the tensors and names ``save_pretrained`` writes (per-expert
MoE weights included), one safetensors shard per decoder layer. It is written layer by layer and
never builds the model: transformers' own save of the MoE model copies every experts tensor before
writing (measured: +0.8 GB a layer at Qwen3-30B-A3B's shapes, ~38 GB at 48 layers), and building a
40-layer Qwen3-14B takes 30 GB of memory first.
"""

from __future__ import annotations

import csv
import gc
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..errors import UnsupportedError, expect
from .e2e import MODELS, build_model

MODES = ("bf16", "bf16+quantize_", "on-load")
DEFAULT_CONFIGS = ("A8W8", "W4A16", "FP8Block")
# The targets the report marks: the on-load model's peak over its resident size (a GPU measure),
# and the on-load time over the bf16 load's.
PEAK_TARGET = 1.15
TIME_TARGET = 1.5
RESULT_PREFIX = "LOADBENCH "  # the child's result line on stdout (transformers may print there too)
STAMP = "loadbench.json"  # written last into a finished checkpoint: what it holds (reuse test)
# The random weights repeat with this period (each tensor from its own start in one pool of random
# values): torch's CPU normal_ makes ~0.4 GB/s, so drawing 30 GB would take over a minute, while a
# copy runs at memory speed, and a load's time does not depend on the values. Prime, so that the
# period lines up with no row.
FILL_BLOCK = 1_000_003
FIELDS = ["model", "layers", "config", "mode", "load_s", "peak_bytes", "resident_bytes", "peak_over_resident",
          "time_over_bf16", "device", "torch", "transformers", "tileq", "date",
          "load_s_runs", "allocated_bytes", "quantized_modules", "repeats", "error"]


# ----------------------------------------------------------------------------- the checkpoint


def checkpoint_name(model: str, layers: int, small: bool) -> str:
    return f"{model}-{layers}layers" + ("-small" if small else "")


def saved_tensors(model: str, layers: int, small: bool):
    """(transformers config, {name: (shape, dtype)}) of the checkpoint ``save_pretrained`` would
    write for e2e's model: built on the meta device (no memory), its state dict put in saved form
    by transformers' own reversal of its load-time conversions (Qwen3-MoE: stacked experts back to
    one tensor per expert and projection)."""
    from transformers.core_model_loading import revert_weight_conversion

    net = build_model(layers, torch.device("meta"), seed=0, small=small, model=model)
    state = revert_weight_conversion(net, net.state_dict())
    cfg = net.config
    cfg.architectures = [type(net).__name__]
    cfg.dtype = torch.bfloat16
    return cfg, {name: (tuple(t.shape), t.dtype) for name, t in state.items()}


def shard_groups(names) -> list[list[str]]:
    """The tensor names per shard: the embeddings first, one shard per decoder layer, the rest
    (final norm, output head) last; each shard's tensors are made, written and freed together."""
    first, last, layers = [], [], {}
    for name in names:
        layer = re.search(r"\.layers\.(\d+)\.", name)
        if layer:
            layers.setdefault(int(layer.group(1)), []).append(name)
        else:
            (first if "embed" in name else last).append(name)
    return [g for g in (first, *(layers[i] for i in sorted(layers)), last) if g]


def random_pool(seed: int) -> tuple[torch.Tensor, torch.Generator]:
    """N(0, 0.02) bf16 values every random tensor of a checkpoint is cut from, and the generator
    that picks where (``random_tensor``)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(2 * FILL_BLOCK, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen), gen


def random_tensor(shape, dtype, pool: tuple[torch.Tensor, torch.Generator]) -> torch.Tensor:
    """A matrix of the pool's values from a random start, repeated every FILL_BLOCK values through
    it; ones for a vector (the RMSNorm weights)."""
    if len(shape) < 2:
        return torch.ones(shape, dtype=dtype)
    values, gen = pool
    t = torch.empty(shape, dtype=dtype)
    flat = t.view(-1)
    start = int(torch.randint(FILL_BLOCK, (), generator=gen))
    block = values[start:start + min(flat.numel(), FILL_BLOCK)]
    whole = flat.numel() // block.numel() * block.numel()
    flat[:whole].view(-1, block.numel()).copy_(block.expand(whole // block.numel(), -1))
    flat[whole:].copy_(block[: flat.numel() - whole])
    return t


def write_checkpoint(path: Path, model: str, layers: int, small: bool, seed: int = 0) -> int:
    """Write the bf16 checkpoint of e2e's ``model`` (``layers`` deep) into ``path``: config.json,
    generation_config.json, one safetensors shard per group of ``shard_groups`` and
    model.safetensors.index.json, then the STAMP. Peak host memory: one shard. Returns its bytes."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from .progress import end_status, status_line

    cfg, tensors = saved_tensors(model, layers, small)
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in tensors.values())
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    if total > free:
        raise UnsupportedError(expect("--workdir", f"{total / 1e9:.1f} GB free for the {path.name} checkpoint",
                                      f"{free / 1e9:.1f} GB free in {path.parent}"))
    groups = shard_groups(tensors)
    pool = random_pool(seed)
    weight_map, done, t0 = {}, 0, time.time()
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        shard = {n: random_tensor(*tensors[n], pool) for n in names}
        save_file(shard, str(path / file), metadata={"format": "pt"})
        done += sum(t.nbytes for t in shard.values())
        weight_map.update(dict.fromkeys(names, file))
        del shard
        status_line(f"[loadbench] writing {path.name}: shard {i}/{len(groups)}, {_gb(done)}/{_gb(total)} GB, "
                    f"{time.time() - t0:.0f} s")
    end_status()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    cfg.save_pretrained(path)
    GenerationConfig.from_model_config(cfg).save_pretrained(path)
    (path / STAMP).write_text(json.dumps(_stamp(model, layers, small, seed, total)) + "\n")
    return total


def _stamp(model: str, layers: int, small: bool, seed: int, total: int) -> dict:
    return {"model": model, "layers": layers, "small": small, "seed": seed, "bytes": total}


def ensure_checkpoint(workdir: Path, model: str, layers: int, small: bool, seed: int) -> tuple[Path, bool]:
    """(the checkpoint's folder, whether this call wrote it): one already finished in ``workdir``
    with the same model, layers, width and seed (its STAMP) is reused; anything else there is
    replaced."""
    path = workdir / checkpoint_name(model, layers, small)
    stamp = path / STAMP
    if stamp.is_file():
        found = json.loads(stamp.read_text())
        if {k: found.get(k) for k in ("model", "layers", "small", "seed")} == \
                {"model": model, "layers": layers, "small": small, "seed": seed}:
            print(f"[loadbench] reusing {path} ({_gb(found['bytes'])} GB)", file=sys.stderr, flush=True)
            return path, False
    if path.exists():
        shutil.rmtree(path)
    t0 = time.time()
    total = write_checkpoint(path, model, layers, small, seed)
    print(f"[loadbench] wrote {path} ({_gb(total)} GB, {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return path, True


def warm_page_cache(path: Path) -> int:
    """Read every file of the checkpoint once, so that every timed load reads from the page cache
    (not the disk, whose speed would make the first mode timed the slowest). Returns the bytes read."""
    total = 0
    for f in sorted(path.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while chunk := fh.read(64 << 20):
                    total += len(chunk)
    return total


# ----------------------------------------------------------------------------- one measurement (the child)


def resident_bytes(model) -> int:
    """The bytes of every parameter and buffer of ``model``, each storage counted once (tied or
    shared tensors, views of one buffer); meta tensors hold none."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def quantized_modules(model) -> int:
    """How many modules hold tileq's quantized weights (QuantLinear, QuantExperts)."""
    from ..moe import QuantExperts
    from ..nn import QuantLinear

    return sum(isinstance(m, (QuantLinear, QuantExperts)) for m in model.modules())


def prepare(job: dict, device: torch.device, config) -> None:
    """The one-time costs of a fresh process, paid before the clock starts: the imports of the
    model's code and of tileq's (its quantizer included), the CUDA context, and the config's
    quantization run once on one small layer (the first calls of its torch operations)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import tileq  # noqa: F401 - registers the "tileq" quantization method when transformers' quantizers load
    import transformers.quantizers.auto  # noqa: F401 - which is now (importing tileq's quantizer), not in the timing

    transformers.utils.logging.disable_progress_bar()  # (the parent shows which run is going on)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(job["checkpoint"]))]  # imports the model's code
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    if config is not None:
        from ..nn import quantize_

        quantize_(torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False, dtype=torch.bfloat16, device=device)),
                  config)
    _free(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load(mode: str, path: str, device: torch.device, config):
    """The model, the way ``mode`` gets it."""
    from transformers import AutoModelForCausalLM

    if mode == "on-load":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=str(device),
                                                    quantization_config=config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=str(device))
    if mode == "bf16+quantize_":
        from ..nn import quantize_

        quantize_(model, config)
        _free(device)  # the bf16 weights quantize_ replaced
    return model


def measure_one(job: dict) -> dict:
    """One load of ``job['mode']`` (a fresh process): its time, peak, resident bytes and versions."""
    import transformers

    from ..nn import config_from_name
    from ..version import __version__

    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    config = None if job["mode"] == "bf16" else config_from_name(job["config"])
    prepare(job, device, config)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = load(job["mode"], job["checkpoint"], device, config)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return dict(job, load_s=seconds,
                peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
                allocated_bytes=torch.cuda.memory_allocated(device) if cuda else None,
                resident_bytes=resident_bytes(model), quantized_modules=quantized_modules(model),
                device_name=torch.cuda.get_device_name(device) if cuda else "cpu",
                torch=torch.__version__, transformers=transformers.__version__, tileq=__version__)


def child_main(argv: list[str]) -> int:
    """``python -m tileq.bench.load --one JOB``: measure_one(JOB), printed as RESULT_PREFIX + JSON."""
    if len(argv) != 2 or argv[0] != "--one":
        print(f"usage: python -m tileq.bench.load --one JOB (JSON); got {argv}", file=sys.stderr)
        return 2
    job = json.loads(argv[1])
    try:
        result = measure_one(job)
    except Exception as e:  # noqa: BLE001 - reported to the parent as this run's error
        import traceback

        traceback.print_exc()
        result = dict(job, error=f"{type(e).__name__}: {e}")
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 1 if "error" in result else 0


# ----------------------------------------------------------------------------- the runs (the parent)


def run_child(job: dict) -> dict:
    """``job`` measured in a fresh Python process; its stderr goes to ours as it comes."""
    cmd = [sys.executable, "-m", "tileq.bench.load", "--one", json.dumps(job)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        return dict(job, error=f"the child exited with status {proc.returncode} and no result line")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def jobs_for(checkpoint: Path, args, layers: int) -> list[dict]:
    """Every run of one checkpoint: per repeat, bf16 then each config's two modes (round robin, so
    that a drift of the machine over the runs weighs on every mode alike)."""
    base = dict(model=args.model, layers=layers, checkpoint=str(checkpoint), device=args.device)
    runs = []
    for r in range(args.repeats):
        runs.append(dict(base, mode="bf16", config="bf16", repeat=r))
        for c in args.configs:
            runs += [dict(base, mode=m, config=c, repeat=r) for m in MODES[1:]]
    return runs


def measure_checkpoint(checkpoint: Path, args, layers: int) -> list[dict]:
    runs = []
    jobs = jobs_for(checkpoint, args, layers)
    for i, job in enumerate(jobs, 1):
        what = f"{job['mode']}" + ("" if job["mode"] == "bf16" else f" {job['config']}")
        print(f"[loadbench] {checkpoint.name}: run {i}/{len(jobs)}: {what} (repeat {job['repeat'] + 1}/"
              f"{args.repeats}) ...", file=sys.stderr, flush=True)
        got = run_child(job)
        runs.append(got)
        if "error" in got:
            print(f"[loadbench]   FAILED: {got['error']}", file=sys.stderr, flush=True)
        else:
            peak = "n/a" if got["peak_bytes"] is None else f"{_gb(got['peak_bytes'])} GB"
            print(f"[loadbench]   {got['load_s']:.2f} s, peak {peak}, resident {_gb(got['resident_bytes'])} GB",
                  file=sys.stderr, flush=True)
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (layers, config, mode): the median time over the repeats, the largest peak, and
    the ratios against the same layers' bf16 load."""
    groups = {}
    for r in runs:
        groups.setdefault((r["layers"], r["config"], r["mode"]), []).append(r)
    rows = []
    for (layers, config, mode), rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        row = dict(model=rs[0]["model"], layers=layers, config=config, mode=mode, repeats=len(ok),
                   error="; ".join(sorted({r["error"] for r in rs if "error" in r})))
        if ok:
            times = [r["load_s"] for r in ok]
            peaks = [r["peak_bytes"] for r in ok if r["peak_bytes"] is not None]
            allocated = [r["allocated_bytes"] for r in ok if r["allocated_bytes"] is not None]
            residents = {r["resident_bytes"] for r in ok}
            if len(residents) > 1:  # the same load must give the same model
                row["error"] = (row["error"] + "; " if row["error"] else "") + \
                    f"resident bytes differ between repeats: {sorted(residents)}"
            row.update(load_s=statistics.median(times), load_s_runs=";".join(f"{t:.3f}" for t in times),
                       peak_bytes=max(peaks) if peaks else None, allocated_bytes=max(allocated) if allocated else None,
                       resident_bytes=max(residents), quantized_modules=ok[0]["quantized_modules"],
                       device=ok[0]["device_name"], torch=ok[0]["torch"], transformers=ok[0]["transformers"],
                       tileq=ok[0]["tileq"])
        rows.append(row)
    for row in rows:
        base = next((b for b in rows if b["layers"] == row["layers"] and b["mode"] == "bf16"), {})
        if row.get("peak_bytes") is not None and row.get("resident_bytes"):
            row["peak_over_resident"] = row["peak_bytes"] / row["resident_bytes"]
        if row.get("load_s") is not None and base.get("load_s"):
            row["time_over_bf16"] = row["load_s"] / base["load_s"]
        row["date"] = time.strftime("%Y-%m-%d")
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_cell(r.get(k)) for k in FIELDS})


def _csv_cell(v):
    if v is None:
        return ""
    return f"{v:.4f}" if isinstance(v, float) else v


# ----------------------------------------------------------------------------- the report


def _gb(v) -> str:
    return "n/a" if v is None else f"{v / 1e9:.3g}"  # (3 digits: 29.5 GB and a small model's 0.0157 alike)


def _target(v, bound: float) -> str:
    if v is None:
        return "n/a"
    return f"{v:.2f} ({'met' if v <= bound else 'NOT met'})"


def table(rows: list[dict]) -> str:
    """The markdown table: per (layers, config) the three loads side by side and the two targets."""
    head = ["layers", "config", "load s: bf16 / +quantize_ / on-load", f"on-load / bf16 time (<= {TIME_TARGET})",
            "peak GB: bf16 / +quantize_ / on-load", "resident GB: bf16 / quantized",
            f"on-load peak / resident (<= {PEAK_TARGET})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["layers"], r["config"], r["mode"]): r for r in rows}
    for layers, config in dict.fromkeys((r["layers"], r["config"]) for r in rows if r["mode"] != "bf16"):
        cells = [by.get((layers, "bf16", "bf16"), {}), by.get((layers, config, MODES[1]), {}),
                 by.get((layers, config, MODES[2]), {})]
        times = " / ".join("-" if c.get("load_s") is None else f"{c['load_s']:.2f}" for c in cells)
        peaks = " / ".join(_gb(c.get("peak_bytes")) for c in cells)
        resident = f"{_gb(cells[0].get('resident_bytes'))} / {_gb(cells[2].get('resident_bytes'))}"
        lines.append(f"| {layers} | {config} | {times} | {_target(cells[2].get('time_over_bf16'), TIME_TARGET)} | "
                     f"{peaks} | {resident} | {_target(cells[2].get('peak_over_resident'), PEAK_TARGET)} |")
    return "\n".join(lines)


def report(rows: list[dict], args, command: str) -> str:
    done = next((r for r in rows if r.get("device")), {})
    name, shape = MODELS[args.model][0], ("1/8-width " if args.small else "")
    lines = [
        f"# tileq loadbench: {shape}{name}-shaped bf16 checkpoint",
        "",
        f"- date: {time.strftime('%Y-%m-%d')}, device: {done.get('device', args.device)}, torch {done.get('torch', '-')}, "
        f"transformers {done.get('transformers', '-')}, tileq {done.get('tileq', '-')}",
        f"- command: `{command}`",
        "- checkpoint: random bf16 weights, safetensors, one shard per decoder layer, the tensors save_pretrained "
        "writes; its files read once before timing (page cache warm)",
        f"- each (mode, config) loaded in a fresh Python process, {args.repeats} time(s): load s is the median, peak "
        "the largest; before the clock: imports, the CUDA context, the config's quantization warmed on one "
        "512x512 layer",
        "- bf16: from_pretrained(dtype=bf16, device_map=DEVICE); bf16+quantize_: that, then tileq.quantize_ and "
        "gc.collect() + torch.cuda.empty_cache(); on-load: from_pretrained(..., quantization_config=config)",
        "- peak: torch.cuda.max_memory_allocated() (n/a on a CPU); resident: every parameter and buffer of the "
        f"loaded model, each storage once; targets: on-load peak / resident <= {PEAK_TARGET}, on-load time / bf16 "
        f"time <= {TIME_TARGET}",
        "",
        f"## {name}" + (" (1/8 width)" if args.small else ""),
        "",
        table(rows),
    ]
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["", "Failed runs:", ""] + [f"- {r['mode']} {r['config']} ({r['layers']} layers): {r['error']}"
                                             for r in failed]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the command


def resolve_device(name: str | None) -> str:
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UnsupportedError(expect("--device", "cpu, cuda or cuda:N", repr(name))) from None
    if dev.type not in ("cpu", "cuda"):
        raise UnsupportedError(expect("--device", "cpu, cuda or cuda:N", repr(name)))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(expect("--device", "cpu on a machine without a CUDA GPU", repr(name)))
    return name


def write_outputs(rows: list[dict], args, command: str) -> str:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "results.csv")
    md = report(rows, args, command)
    (out / "report.md").write_text(md)
    return md


def run(args) -> int:
    from .cli import command_line

    command = command_line(args, "loadbench")  # (as given: before --device is resolved)
    args.device = resolve_device(args.device)
    if args.make_checkpoint:
        for layers in args.layers:
            path, _ = ensure_checkpoint(Path(args.make_checkpoint), args.model, layers, args.small, args.seed)
            print(path)
        return 0
    temporary = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="tileq-loadbench-") if temporary else args.workdir)
    runs = []
    try:
        for layers in args.layers:
            path, written = ensure_checkpoint(workdir, args.model, layers, args.small, args.seed)
            size = warm_page_cache(path)
            print(f"[loadbench] read {_gb(size)} GB of {path.name} (page cache warm)", file=sys.stderr, flush=True)
            runs += measure_checkpoint(path, args, layers)
            write_outputs(summarize(runs), args, command)  # what is measured survives a cut-off run
            if written and not args.keep:
                shutil.rmtree(path)  # (disk room for the next, deeper checkpoint)
    finally:
        if temporary and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif args.keep:
            print(f"[loadbench] checkpoints kept in {workdir}", file=sys.stderr, flush=True)
    rows = summarize(runs)
    write_outputs(rows, args, command)
    failed = [f"{r['mode']} {r['config']} ({r['layers']} layers)" for r in rows if r.get("error")]
    if failed:
        print(f"[loadbench] FAILED: {', '.join(failed)} (report.md says why)", file=sys.stderr, flush=True)
    print(f"wrote {Path(args.out) / 'results.csv'} and {Path(args.out) / 'report.md'}")
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
