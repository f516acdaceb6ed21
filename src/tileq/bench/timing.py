"""GPU timing, the environment record and the measured ceilings (docs/schemes.md section 6).

Each timed run is bracketed by its own pair of CUDA events. Before each run the L2 is flushed by
reading a buffer twice its size (so every run reads its operands from HBM, as a layer in a model
does), then a short device-side sleep lets the host enqueue the run while the GPU is still
busy: without it, Python launch overhead (tens of microseconds for a decode GEMM) would land
between the start event and the kernel. The reported time is the median of the runs.

Why a read and not the usual ``buffer.zero_()``: a write leaves the whole L2 dirty, so the timed
kernel's own reads force up to 60 MB of write-backs to HBM. For a 26 MB decode weight that
roughly doubles the memory traffic charged to the kernel. In a model the L2 holds the previous
layers' (clean) weights and small activations, which a read flush reproduces. ``flush="write"``
keeps the old method for comparison (``tileq bench --flush write``).
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch

# A sleep of at least this long, in SM cycles per second of lead: 2e9 is at or above every
# NVIDIA boost clock we target (H200: 1980 MHz), so the real sleep is never shorter than asked.
_CYCLES_PER_SECOND = 2.0e9


FLUSH_MODES = ("read", "write", "none")


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 50
    runs: int = 100
    flush: str = "read"  # 'read' | 'write' | 'none' (module docstring)
    graphs: bool = False

    def __post_init__(self):
        if self.flush not in FLUSH_MODES:
            raise ValueError(f"flush: expected one of {', '.join(FLUSH_MODES)}, got {self.flush!r}")


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    runs: int
    note: str = ""


def combine_rounds(timings: list[Timing]) -> Timing:
    """One measurement from several rounds of the same callable: the median of the rounds'
    medians, the fastest run, every run counted."""
    if len(timings) == 1:
        return timings[0]
    note = "; ".join(dict.fromkeys(t.note for t in timings if t.note))
    return Timing(statistics.median(t.median_ms for t in timings), min(t.min_ms for t in timings),
                  sum(t.runs for t in timings), (note + "; " if note else "") + f"{len(timings)} rounds")


class Timer:
    """Times callables on one CUDA device with the method of the module docstring."""

    def __init__(self, device: torch.device, cfg: TimingConfig):
        self.device = device
        self.cfg = cfg
        props = torch.cuda.get_device_properties(device)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 0)
        self.flush_buf = None
        self.flush_sink = None
        if cfg.flush != "none":
            # 2x the L2 (docs/schemes.md: at least twice the 60 MB of an H200); 64 MiB floor when the
            # property is missing.
            nbytes = max(2 * self.l2_bytes, 64 << 20)
            self.flush_buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            self.flush_sink = torch.empty((), dtype=torch.float32, device=device)
        self.can_sleep = hasattr(torch.cuda, "_sleep")

    def describe(self) -> str:
        c = self.cfg
        verb = "reading" if c.flush == "read" else "writing"
        flush = (f"L2 flushed before every run by {verb} {self.flush_buf.numel() * 4 / 1e6:.0f} MB"
                 if self.flush_buf is not None else "L2 not flushed")
        lead = ("a device-side sleep before each run keeps host launch overhead out of the events"
                if self.can_sleep else "no torch.cuda._sleep in this torch: host launch overhead "
                "can reach the events for microsecond-scale kernels")
        mode = "CUDA-graph replays" if c.graphs else "eager launches"
        return (f"median of {c.runs} timed runs after {c.warmup} warm-ups, one CUDA-event pair per "
                f"run, {mode}; {flush}; {lead}")

    def measure(self, fn) -> Timing:
        cfg = self.cfg
        note = ""
        host = []
        for _ in range(cfg.warmup):
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize(self.device)
        run = fn
        graph = None
        if cfg.graphs:
            graph = _capture(fn, self.device)
            run = graph.replay
            for _ in range(3):
                run()
            torch.cuda.synchronize(self.device)
            note = "CUDA graph"
        # Lead: twice the median host time of one call, at least 20 us, at most 2 ms.
        lead_s = min(max(2 * statistics.median(host) if host else 0.0, 20e-6), 2e-3)
        cycles = int(lead_s * _CYCLES_PER_SECOND)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.runs)]
        for i in range(cfg.runs):
            self.flush()
            if self.can_sleep:
                torch.cuda._sleep(cycles)
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize(self.device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        del graph
        return Timing(statistics.median(times), min(times), len(times), note)


    def flush(self) -> None:
        """Evict the L2 (module docstring): a reduction over the buffer, or a write of it."""
        if self.flush_buf is None:
            return
        if self.cfg.flush == "read":
            torch.sum(self.flush_buf, dim=0, out=self.flush_sink)
        else:
            self.flush_buf.zero_()


def _capture(fn, device) -> "torch.cuda.CUDAGraph":
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # allocations made here are reused by the capture's private pool
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# ----------------------------------------------------------------------------- environment


def _nvidia_smi(index: int) -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"nvidia-smi": "not found"}
    fields = ["driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
              "power.limit", "temperature.gpu"]
    try:
        res = subprocess.run(
            [exe, f"--id={index}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return {"nvidia-smi": f"failed: {e}"}
    if res.returncode != 0:
        return {"nvidia-smi": f"failed (exit {res.returncode}): {res.stderr.strip()[:200]}"}
    values = [v.strip() for v in res.stdout.strip().split(",")]
    return dict(zip(fields, values)) if len(values) == len(fields) else {"nvidia-smi": res.stdout.strip()}


def environment(device: torch.device) -> dict:
    """What the numbers were measured on: GPU, clocks, versions, date."""
    import numpy
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": numpy.__version__,
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    try:
        from .. import __version__ as tileq_version

        env["tileq"] = tileq_version
    except ImportError:  # pragma: no cover - the package always has it
        pass
    if device.type != "cuda":
        env["device"] = "CPU (no CUDA device): correctness only, through Triton's interpreter"
        env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "")
        return env
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    env["device"] = props.name
    env["compute capability"] = f"sm_{props.major}{props.minor}"
    env["multiprocessors"] = str(props.multi_processor_count)
    env["memory"] = f"{props.total_memory / 2**30:.0f} GiB"
    l2 = getattr(props, "L2_cache_size", 0)
    env["L2"] = f"{l2 / 1e6:.0f} MB" if l2 else "unknown"
    env["CUDA (torch)"] = str(torch.version.cuda)
    env.update(_nvidia_smi(index))
    return env


# ----------------------------------------------------------------------------- ceilings


@dataclass
class Ceilings:
    """Measured ceilings (docs/schemes.md: work out FLOPs at the measured peak, bytes at the copy)."""

    copy_tbps: float | None = None
    peak_tflops: dict = field(default_factory=dict)  # 'bf16' | 'fp8' | 'int8' -> TFLOP/s (TOP/s)
    notes: list = field(default_factory=list)

    def peak_for(self, compute: str) -> float | None:
        return self.peak_tflops.get(compute)


def measure_ceilings(device: torch.device, size: int = 8192) -> Ceilings:
    """Device copy bandwidth and dense 8192^3 rates of torch's bf16, fp8 and int8 products."""
    timer = Timer(device, TimingConfig(warmup=5, runs=20, flush="none"))
    c = Ceilings()
    src = torch.randn(1 << 28, device=device)  # 1 GiB: far larger than any L2
    dst = torch.empty_like(src)
    t = timer.measure(lambda: dst.copy_(src))
    c.copy_tbps = 2 * src.numel() * 4 / (t.median_ms * 1e-3) / 1e12  # bytes read + written
    del src, dst
    flops = 2 * size**3
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    c.peak_tflops["bf16"] = flops / (timer.measure(lambda: a @ b).median_ms * 1e-3) / 1e12
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        t = timer.measure(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
        c.peak_tflops["fp8"] = flops / (t.median_ms * 1e-3) / 1e12
    except (RuntimeError, AttributeError) as e:
        c.notes.append(f"fp8 peak not measured: {type(e).__name__}: {str(e)[:160]}")
    try:
        ai = torch.randint(-127, 128, (size, size), device=device, dtype=torch.int8)
        bi = torch.randint(-127, 128, (size, size), device=device, dtype=torch.int8).t().contiguous().t()
        t = timer.measure(lambda: torch._int_mm(ai, bi))
        c.peak_tflops["int8"] = flops / (t.median_ms * 1e-3) / 1e12
    except (RuntimeError, AttributeError) as e:
        c.notes.append(f"int8 peak not measured: {type(e).__name__}: {str(e)[:160]}")
    return c
