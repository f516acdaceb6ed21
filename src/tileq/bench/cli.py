"""``tileq bench``: run a suite, write results.csv / report.md / plots, optionally compare; and
the options of the other benchmark commands (replay, overhead, e2e, layerbench, moebench,
loadbench).

Exit status: 0 when every tileq result (the plan's, and those of --impls / --gluon-tilings /
--int4-variants) passed
its correctness gate (and no regression was found by --compare), 1 otherwise, 2 for a bad argument
or suite file.

Importing this module imports no torch (``tileq bench --help`` answers at once): the benchmark
modules are imported when a command runs, and the few values the options name are spelled out
here (tests/test_cli.py checks them against those modules).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from ..argtypes import (
    names_from,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    positive_ints,
)

FLUSH_MODES = ("read", "write", "none")  # tileq.bench.timing.FLUSH_MODES
NN_CONFIGS = ("A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A8")  # tileq.nn.configs.CONFIGS
E2E_CHECKPOINT_CONFIGS = ("A8W8", "W4A16")  # tileq.bench.e2e.CHECKPOINT_CONFIGS
E2E_MODES = ("eager", "compile", "graph")  # tileq.bench.e2e.MODES
E2E_MODELS = ("qwen3-14b", "qwen3-moe")  # tileq.bench.e2e.MODELS
E2E_PEERS = ("torchao.FP8Row", "torchao.A8W8", "torchao.W4A16")  # tileq.bench.e2e.TORCHAO_PEERS
LAYERBENCH_CONFIGS = ("A8W8", "FP8Row", "FP8Block", "W4A16", "W4A8")  # tileq.bench.layers.CONFIGS
REPLAY_RULES = ("gluon-tiles", "int4-decode", "int4-prefill", "int4-streamk", "int4-w4a8")  # replay.RULES
REPLAY_TOLERANCE = 0.03  # tileq.bench.replay.TOLERANCE


def _names(text: str) -> list[str]:
    """A comma-separated list of names (checked by the command)."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark tileq against torch baselines over a suite of shapes",
        description="Run a suite: each shape x case is gated for correctness against tileq's "
        "reference, then timed (CUDA only) with tileq and its baselines interleaved. Writes "
        "results.csv, report.md and PNG plots into --out.",
    )
    p.add_argument("--suite", action="append", default=None,
                   help="built-in suite name or path to a suite CSV; repeat or comma-separate "
                   "for several (default: smoke)")
    p.add_argument("--list", action="store_true", help="list suites, cases and baselines, then exit")
    p.add_argument("--render", metavar="DIR", default=None,
                   help="only re-write report.md and the plots of an earlier run's folder (its "
                   "results.csv and env.json), e.g. on a machine with matplotlib")
    p.add_argument("--cases", default="headline",
                   help="comma-separated cases (scheme:AxB:layout[:preshuffled|:fast]; B type i4p: a prepacked "
                   "int4 weight timed through tileq.linear, e.g. bquant:bf16xi4p:rcr) or sets (headline, "
                   "aquant28, gluon, int4); suite rows with their own cases keep them (default: headline)")
    p.add_argument("--schemes", default=None, help="comma-separated schemes to keep")
    p.add_argument("--baselines", default=None,
                   help="comma-separated baselines to run besides tileq (default: every default "
                   "entry of the registry; 'reference' times tileq's torch reference)")
    p.add_argument("--impls", default=None, metavar="gluon,triton,deep",
                   help="also time tileq forced onto one kernel, comma-separated: 'gluon' (the sm_90 "
                   "Gluon kernel switched on as by TILEQ_GLUON=1, with the plan's tiling; N/A where it "
                   "does not serve the problem), 'triton' (the plan forced onto the portable "
                   "Triton kernel) and/or 'deep' (that kernel with as many pipeline stages as shared "
                   "memory holds, at most 8); rows tileq_gluon / tileq_triton / tileq_deep beside tileq "
                   "(the plan's choice)")
    p.add_argument("--gluon-tilings", action="store_true",
                   help="also time every candidate tiling of the Gluon kernel's wave model "
                   "(dispatch.gluon.tile_costs: 128, 128+split, 64, 256) for each prefill problem the "
                   "kernel serves, one row each named tileq_gluon:<tiling>, the plan's choice marked in "
                   "its note (what 'tileq replay --rule gluon-tiles' checks the model against)")
    p.add_argument("--int4-variants", action="store_true",
                   help="for each prepacked int4 case (B type i4p), also time the call forced onto each path "
                   "the dispatch layer chooses between: decode configs (a sweep at M <= 32, the plan's config "
                   "below 256), Gluon prefill tilings (token tile x split over K, stream-K 128/256), W4A8's "
                   "routes (cast to bf16, the fused fp8 build, the fp8 GEMM) and dequantize + cuBLAS; one row "
                   "each named tileq_int4:<variant>, its kernel column the instance, the plan's choice marked "
                   "in its note (what 'tileq replay --rule int4-*' checks the rules against)")
    p.add_argument("--shapes", default=None, help="regular expression on shape names to keep")
    p.add_argument("--m-min", type=nonnegative_int, default=None, help="keep shapes with M >= this")
    p.add_argument("--m-max", type=nonnegative_int, default=None, help="keep shapes with M <= this")
    p.add_argument("--max-shapes", type=positive_int, default=None,
                   help="keep only the first N shapes (after the filters)")
    p.add_argument("--out", default=None, help="output folder (default: tileq-out/bench-<suite>)")
    p.add_argument("--warmup", type=nonnegative_int, default=50, help="warm-up runs per measurement (default: 50)")
    p.add_argument("--runs", type=positive_int, default=100,
                   help="timed runs per measurement; the median is reported (default: 100)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="split each measurement's --runs into this many rounds, every implementation "
                   "of a (shape, case) timed once per round in turn (a clock drift then weighs on all "
                   "alike); the time is the median of the rounds' medians (default: 1)")
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays instead of launches")
    p.add_argument("--flush", choices=FLUSH_MODES, default="read",
                   help="how the L2 is evicted before each timed run: by reading a buffer twice "
                        "its size (default; leaves it clean), by writing one (leaves it dirty, so "
                        "the timed kernel also pays for write-backs), or not at all")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random operands (default: 0)")
    p.add_argument("--device", default="auto", help="auto (default), cuda, cuda:N or cpu")
    p.add_argument("--time-budget", type=positive_float, default=None,
                   help="seconds: stop starting new shapes after this and mark the rest skipped")
    p.add_argument("--precompile-jobs", type=nonnegative_int, default=None,
                   help="CUDA: processes compiling tileq's kernels before the sweep (default: "
                   "CPUs - 1; 0 compiles inside the sweep)")
    p.add_argument("--no-ceilings", action="store_true",
                   help="do not measure copy bandwidth and peak rates (no ceiling lines in plots)")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--compare", default=None, metavar="OLD_CSV",
                   help="compare tileq's times with an earlier results.csv; exit 1 on regressions")
    p.add_argument("--threshold", type=nonnegative_float, default=0.05,
                   help="--compare: a regression is this much slower (default: 0.05 = 5%%)")
    p.add_argument("--compare-metric", choices=("relative", "absolute"), default="relative",
                   help="--compare: 'relative' (default) divides tileq's time by bf16 torch.matmul's "
                   "in the same run (robust to clocks); 'absolute' compares times directly")
    p.set_defaults(func=run_bench, bench_parser=p)


# The options of the commands whose code imports torch at import time: each ``add_*`` returns the
# parser, and the caller names the function that runs it (tileq.cli imports it when it runs).


def add_replay(subparsers) -> argparse.ArgumentParser:
    """``tileq replay``'s options (its code: tileq.bench.replay)."""
    p = subparsers.add_parser(
        "replay",
        help="replay a dispatch rule on a results CSV of timed variants (a threshold change checked "
             "against the data)",
        description="For each problem of a results CSV (tileq bench's results.csv, e.g. of --gluon-tilings "
        "or --int4-variants), ask the dispatch layer which of the timed variants it picks, and report per "
        "case and M range how far that is from the fastest variant and from the best baseline; --threshold "
        "replays it again with thresholds changed; with --rule int4-decode, --write-table writes the int4 "
        "decode kernel's tuned table from the data. No GPU needed. Exit status: 0, or 2 for a bad argument "
        "or CSV.",
    )
    p.add_argument("csv", nargs="*", help="results.csv files of tileq bench (or their folders)")
    p.add_argument("--rule", default=None,
                   help=f"the rule to replay: {', '.join(REPLAY_RULES)} (--list describes them)")
    p.add_argument("--list", action="store_true", help="list the rules and the thresholds they can change, then exit")
    p.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE",
                   help="replay again with this entry of tileq.dispatch.thresholds changed (repeat for "
                   "several), reporting both and the problems whose choice changed")
    p.add_argument("--sms", type=positive_int, default=None,
                   help="SM count to plan for (default: the 'multiprocessors' of the env.json beside each "
                   "CSV, else the rule's arch's typical count)")
    p.add_argument("--m-edges", default=None,
                   help="comma-separated M range edges of the report's groups (default: the rule's: 64,512 "
                   "(M <= 64, 65-512, > 512) for gluon-tiles, 16,64,255 for the int4 rules)")
    p.add_argument("--shapes", default=None, metavar="REGEX",
                   help="keep only problems whose shape name matches this regular expression (e.g. '^llm\\.' "
                   "for the int4 suite's llm set)")
    p.add_argument("--write-table", default=None, metavar="FILE",
                   help="with --rule int4-decode: also write the prepacked int4 decode kernel's tuned table "
                   "(the format of src/tileq/dispatch/data/tuned_int4_sm90.json) from the W4A16 "
                   "(bquant:bf16xi4p:rcr) decode configs timed at M <= INT4_TUNED_MAX_M, with the thresholds "
                   "--threshold gives; the shipped table was written from the llm set (--shapes '^llm\\.')")
    p.add_argument("--table-margin", type=nonnegative_float, default=0.03,
                   help="--write-table: a weight's entry is written where its best config beats the heuristic's "
                   "(decode_rule) by more than this (default: 0.03 = 3%%)")
    p.add_argument("--tolerance", type=nonnegative_float, default=REPLAY_TOLERANCE,
                   help=f"a choice more than this much slower than the fastest variant is counted and "
                   f"listed (default: {REPLAY_TOLERANCE} = {REPLAY_TOLERANCE * 100:.0f}%%)")
    p.add_argument("--per-problem", action="store_true",
                   help="list every problem (default: only those beyond --tolerance, at most 20)")
    p.add_argument("--out", default=None, help="also write the report (markdown) to this file")
    return p


def add_overhead(subparsers) -> argparse.ArgumentParser:
    """``tileq overhead``'s options (its code: tileq.bench.overhead)."""
    p = subparsers.add_parser("overhead", help="host cost per call (eager) and kernel time (CUDA graph)")
    p.add_argument("--m", type=positive_int, default=1, help="rows of the activations (tokens; default: 1)")
    p.add_argument("--n", type=positive_int, default=4096, help="output features (default: 4096)")
    p.add_argument("--k", type=positive_int, default=4096, help="input features (default: 4096)")
    p.add_argument("--calls", type=positive_int, default=500,
                   help="back-to-back calls per measurement (default: 500)")
    p.add_argument("--configs", type=names_from(NN_CONFIGS, "configs"), default=["A8W8", "FP8Row", "W4A16"],
                   help=f"QuantLinear configs of the layer rows, from {','.join(NN_CONFIGS)} (default: A8W8,FP8Row,W4A16)")
    p.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    return p


def add_e2e(subparsers) -> argparse.ArgumentParser:
    """``tileq e2e``'s options (its code: tileq.bench.e2e)."""
    p = subparsers.add_parser("e2e", help="decode a Qwen3-14B-shaped transformers model: bf16 vs tileq configs (GPU)")
    p.add_argument("--model", choices=E2E_MODELS, default="qwen3-14b",
                   help="qwen3-14b (dense, default) or qwen3-moe (Qwen3-30B-A3B-shaped: 128 experts, top-8; bf16 "
                   "experts run by transformers' grouped_mm)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="decoder layers (default: the model's, 40 for qwen3-14b, 48 for qwen3-moe)")
    p.add_argument("--configs", type=_names, default=None,
                   help=f"comma list from {','.join(('bf16', *NN_CONFIGS))} (default: all); NAME:fused adds the "
                   f"fused decoder path; NAME@SWITCH=VALUE measures NAME with a TILEQ_* switch set (e.g. "
                   f"A8W8:fused@TILEQ_QK_ROPE=0; several: @A=1@B=0) against the same bf16; peers where "
                   f"importable: {','.join(E2E_PEERS)} (torchao's quantize_ on "
                   f"the same layers); with --make-checkpoint the configs to write (default: "
                   f"{','.join(E2E_CHECKPOINT_CONFIGS)})")
    p.add_argument("--batches", type=positive_ints, default=[1, 16],
                   help="batch sizes of the TPOT measurements (default: 1,16)")
    p.add_argument("--prompt", type=positive_int, default=512,
                   help="prompt tokens (TTFT, and the KV cache before decoding)")
    p.add_argument("--tokens", type=positive_int, default=128, help="replays per TPOT of the graph mode")
    p.add_argument("--eager-tokens", type=positive_int, default=32, help="steps per TPOT of the eager and compile modes")
    p.add_argument("--modes", type=names_from(E2E_MODES, "modes"), default=["eager", "graph"],
                   help="comma list of how decode steps run: eager (transformers' forward), compile "
                   "(torch.compile(model.forward, fullgraph=True), no CUDA graph), graph (that compiled step "
                   "captured in a CUDA graph and replayed); default: eager,graph")
    p.add_argument("--no-compile-ttft", dest="compile_ttft", action="store_false",
                   help="skip the compiled TTFT (its prefill graph's compilation takes 40-50 s at 40 layers); "
                   "the eager TTFT is still measured")
    p.add_argument("--fuse", action="store_true", help="also fuse the decoder layers (integrations.hf)")
    p.add_argument("--small", action="store_true", help="1/8-width model (quick checks)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="seed of the random weights and prompts (default: 0)")
    p.add_argument("--checkpoint", default=None,
                   help="a quantized checkpoint folder (tileq.from_pretrained) timed against bf16 with its shapes")
    p.add_argument("--make-checkpoint", default=None, metavar="DIR",
                   help="instead of timing: write checkpoints of the model (--layers, --small, --seed), one per "
                   "config of --configs, quantized and saved by tileq.save_pretrained into DIR/<config> (on the "
                   "GPU when there is one); time them with --checkpoint DIR/<config>")
    p.add_argument("--max-shard-size", default="5GB",
                   help="--make-checkpoint: the largest safetensors shard (save_pretrained's; default: 5GB)")
    p.add_argument("--profile-host", action="store_true",
                   help="diagnostic, per config after the timings: the kernel breakdown of one compiled prefill "
                   "(a third table), and cProfile of 8 compiled and 8 eager decode steps and 3 eager and 3 compiled prefills, "
                   "each written to OUT/host_profile/<config>_<what>.txt with its wall ms per call")
    p.add_argument("--out", default=os.environ.get("OUT", "tileq-out") + "/e2e",
                   help="folder for e2e.csv, e2e.md and e2e.png (default: $OUT/e2e, else tileq-out/e2e)")
    return p


TPBENCH_MODELS = ("qwen3-14b", "qwen3-32b")  # tileq.bench.tp.MODELS
TPBENCH_CONFIGS = ("bf16", "A8W8", "FP8Row", "W4A16")  # tileq.bench.tp.CONFIGS
TPBENCH_MODES = ("eager", "compile", "graph")  # tileq.bench.tp.MODES


def add_tpbench(subparsers) -> argparse.ArgumentParser:
    """``tileq tpbench``'s options (its code: tileq.bench.tp; run under torchrun)."""
    MODELS, CONFIGS, MODES, BATCHES = TPBENCH_MODELS, TPBENCH_CONFIGS, TPBENCH_MODES, (1, 16)
    p = subparsers.add_parser("tpbench", help="tensor-parallel decode TPOT, bf16 vs tileq configs "
                                              "(GPU; torchrun --nproc-per-node N -m tileq tpbench)")
    p.add_argument("--model", choices=list(MODELS), default="qwen3-14b", help="shapes (default: qwen3-14b)")
    p.add_argument("--layers", type=positive_int, default=8, help="decoder layers (default: 8)")
    p.add_argument("--configs", type=names_from(("bf16", *NN_CONFIGS), "configs"), default=list(CONFIGS),
                   help=f"comma list from bf16,{','.join(NN_CONFIGS)} (default: {','.join(CONFIGS)})")
    p.add_argument("--batches", type=positive_ints, default=list(BATCHES), help="comma list (default: 1,16)")
    p.add_argument("--modes", type=names_from(MODES, "modes"), default=list(MODES),
                   help=f"comma list from {','.join(MODES)} (default: all)")
    p.add_argument("--fuse", action="store_true", help="fuse_decoder_ after quantize_ (per rank)")
    p.add_argument("--prompt", type=positive_int, default=32, help="prompt tokens (default: 32)")
    p.add_argument("--tokens", type=positive_int, default=64, help="timed graph steps (default: 64)")
    p.add_argument("--eager-tokens", type=positive_int, default=16, help="timed eager/compile steps (default: 16)")
    p.add_argument("--out", default=os.environ.get("OUT", "tileq-out") + "/tp",
                   help="folder for tp.csv and tp.md (default: $OUT/tp, else tileq-out/tp)")
    return p


def add_layerbench(subparsers) -> argparse.ArgumentParser:
    """``tileq layerbench``'s options (its code: tileq.bench.layers)."""
    p = subparsers.add_parser("layerbench", help="one quantized layer piece by piece vs bf16 under CUDA graphs (GPU)")
    p.add_argument("--m", type=positive_ints, default=[1, 16, 4096],
                   help="comma list of M (tokens) per projection shape (default: 1,16,4096)")
    p.add_argument("--configs", type=names_from(NN_CONFIGS, "configs"), default=list(LAYERBENCH_CONFIGS),
                   help=f"comma list of tileq configs from {','.join(NN_CONFIGS)} (default: "
                   f"{','.join(LAYERBENCH_CONFIGS)})")
    p.add_argument("--runs", type=positive_int, default=50,
                   help="timed CUDA-graph replays per measurement (default: 50)")
    p.add_argument("--act-only", action="store_true", help="only the activation-quantization sweep")
    p.add_argument("--out", default=os.environ.get("OUT", "tileq-out") + "/layers",
                   help="folder for layers.csv and layers.md (default: $OUT/layers, else tileq-out/layers)")
    return p


LOADBENCH_CONFIGS = ("A8W8", "W4A16", "FP8Block")  # tileq.bench.load.DEFAULT_CONFIGS
LOADBENCH_TARGETS = (1.15, 1.5)  # tileq.bench.load.PEAK_TARGET, TIME_TARGET


def add_loadbench(subparsers) -> argparse.ArgumentParser:
    """``tileq loadbench``'s options (its code: tileq.bench.load)."""
    p = subparsers.add_parser(
        "loadbench", help="peak memory and time of loading a bf16 checkpoint quantized: bf16, bf16 + quantize_, "
        "quantize-on-load",
        description="Writes a bf16 safetensors checkpoint of a Qwen3-14B- or Qwen3-30B-A3B-shaped model (random "
        "weights) and loads it three ways, each in a fresh Python process: from_pretrained in bf16; the same, then "
        "tileq.quantize_; from_pretrained(quantization_config=config) (quantized as it is read). Reports the load "
        "time (median of --repeats), the peak device memory (CUDA only) and the loaded model's bytes, marking the "
        f"targets: on-load peak / resident <= {LOADBENCH_TARGETS[0]}, on-load time / bf16 time <= "
        f"{LOADBENCH_TARGETS[1]}. Writes results.csv and report.md into --out.")
    p.add_argument("--model", choices=E2E_MODELS, default="qwen3-14b",
                   help="qwen3-14b (dense, default) or qwen3-moe (Qwen3-30B-A3B-shaped: 128 experts, top-8)")
    p.add_argument("--layers", type=positive_ints, default=[8],
                   help="comma list of decoder layer counts, one checkpoint each (default: 8; the real models "
                   "have 40 and 48: a 40-layer qwen3-14b checkpoint is 29.5 GB)")
    p.add_argument("--configs", type=names_from(NN_CONFIGS, "configs"), default=list(LOADBENCH_CONFIGS),
                   help=f"comma list of tileq configs from {','.join(NN_CONFIGS)} (default: "
                   f"{','.join(LOADBENCH_CONFIGS)})")
    p.add_argument("--device", default=None,
                   help="where the model is loaded (device_map): cuda, cuda:N or cpu (default: cuda if there is a "
                   "GPU, else cpu: times only, no peak)")
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="loads per mode and config, each in a fresh process; the median time is reported (default: 2)")
    p.add_argument("--workdir", default=None,
                   help="folder for the checkpoints (default: a temporary folder, removed at the end); a finished "
                   "checkpoint of the same shape found there is reused")
    p.add_argument("--keep", action="store_true",
                   help="keep the checkpoints this run writes (and the temporary --workdir), for a later run")
    p.add_argument("--make-checkpoint", default=None, metavar="DIR",
                   help="instead of measuring: write the checkpoint of each --layers into DIR/<model>-<N>layers")
    p.add_argument("--small", action="store_true", help="tileq e2e's 1/8-width model (quick checks and tests)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument("--out", default=os.environ.get("OUT", "tileq-out") + "/load",
                   help="folder for results.csv and report.md (default: $OUT/load, else tileq-out/load)")
    p.set_defaults(loadbench_parser=p)
    return p


MOEBENCH_MODELS = ("qwen3-30b-a3b", "deepseek-v3")  # tileq.bench.moe.MODELS
MOEBENCH_TOKENS = (1, 16, 128, 1024, 4096)  # tileq.bench.moe.TOKENS
MOEBENCH_ROUTINGS = ("uniform", "skewed")  # tileq.bench.moe.ROUTINGS
MOEBENCH_CONFIGS = ("FP8Block", "A8W8", "FP8Row", "W4A16", "W4A8")  # tileq.bench.moe.CONFIGS
MOEBENCH_BASELINES = ("bf16", "fp8", "eager")  # tileq.bench.moe.BASELINES
MOEBENCH_FORMS = ("auto", "contiguous", "masked")  # tileq.bench.moe.FORMS


def add_moebench(subparsers) -> argparse.ArgumentParser:
    """``tileq moebench``'s options (its code: tileq.bench.moe)."""
    p = subparsers.add_parser("moebench", help="one MoE layer's experts: tileq configs vs torch's grouped GEMMs "
                              "and transformers' loop under CUDA graphs (GPU; --dry on a CPU)")
    p.add_argument("--models", type=names_from(MOEBENCH_MODELS, "models"), default=list(MOEBENCH_MODELS),
                   help=f"comma list from {','.join(MOEBENCH_MODELS)} (default: both)")
    p.add_argument("--tokens", type=positive_ints, default=list(MOEBENCH_TOKENS),
                   help=f"comma list of token counts (default: {','.join(map(str, MOEBENCH_TOKENS))})")
    p.add_argument("--routings", type=names_from(MOEBENCH_ROUTINGS, "routings"), default=list(MOEBENCH_ROUTINGS),
                   help="comma list from uniform,skewed (default: both)")
    p.add_argument("--configs", type=names_from(NN_CONFIGS, "configs"), default=list(MOEBENCH_CONFIGS),
                   help=f"comma list of tileq configs from {','.join(NN_CONFIGS)} (default: "
                   f"{','.join(MOEBENCH_CONFIGS)})")
    p.add_argument("--baselines", type=names_from(MOEBENCH_BASELINES, "baselines"), default=list(MOEBENCH_BASELINES),
                   help="comma list from bf16 (torch._grouped_mm), fp8 (torch._scaled_grouped_mm), eager "
                   "(transformers' loop) (default: all)")
    p.add_argument("--forms", type=names_from(MOEBENCH_FORMS, "forms"), default=["auto"],
                   help="comma list of the grouped GEMMs' forms for tileq rows: auto (tileq.moe.choose_form's "
                   "pick), masked, contiguous (default: auto)")
    p.add_argument("--runs", type=positive_int, default=20,
                   help="timed CUDA-graph replays per measurement (default: 20)")
    p.add_argument("--dry", action="store_true",
                   help="list the cases and run one tiny layer on the CPU through the reference (no timing)")
    p.add_argument("--out", default=os.environ.get("OUT", "tileq-out") + "/moe",
                   help="folder for moe.csv and moe.md (default: $OUT/moe, else tileq-out/moe)")
    return p


def _split(values) -> list[str]:
    out = []
    for v in values or []:
        out += [x.strip() for x in str(v).split(",") if x.strip()]
    return out


def command_line(args, name: str) -> str:
    """The options that differ from their defaults, as a command (for the report's header)."""
    parser = getattr(args, f"{name}_parser", None)
    words = ["tileq", name]
    for action in getattr(parser, "_actions", []):
        dest = action.dest
        if not action.option_strings or dest in ("help",):
            continue
        value = getattr(args, dest, None)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1]
        if value is True:
            words.append(flag)
        elif isinstance(value, list) and isinstance(action, argparse._AppendAction):
            words += [w for v in value for w in (flag, shlex.quote(str(v)))]
        elif isinstance(value, list):  # one comma list (positive_ints, names_from)
            words += [flag, shlex.quote(",".join(map(str, value)))]
        else:
            words += [flag, shlex.quote(str(value))]
    return " ".join(words)


def _list_everything() -> int:
    from .baselines import REGISTRY
    from .cases import CASE_SETS
    from .int4 import PREFIX as INT4_PREFIX
    from .suites import BUILTIN_SUITES
    from .variants import IMPLS, TILING_PREFIX

    print("suites:")
    for name, what in BUILTIN_SUITES.items():
        print(f"  {name:<12} {what}")
    print("case sets:")
    for name, fn in CASE_SETS.items():
        print(f"  {name:<12} {', '.join(c.name for c in fn())}")
    print("implementations (registry order):")
    for impl in REGISTRY:
        flags = [impl.kind] + ([] if impl.default else ["not default"]) + (
            ["CUDA"] if impl.cuda_only else []) + ([f"needs {impl.module}"] if impl.module else [])
        print(f"  {impl.name:<28} {impl.description}  [{', '.join(flags)}]")
    print("tileq forced (--impls NAME, --gluon-tilings, --int4-variants):")
    for name, impl in IMPLS.items():
        print(f"  {impl.name:<28} --impls {name}: {impl.description}")
    print(f"  {TILING_PREFIX + '<tiling>':<28} --gluon-tilings: the Gluon kernel with one tiling of its wave model")
    print(f"  {INT4_PREFIX + '<variant>':<28} --int4-variants: a prepacked int4 call forced onto one path, decode "
          "config or prefill tiling (decode:<config>[:cast], gluon:t<T>[:sk<S>|:stk][:fused], fp8-gemm, "
          "dequant+cublas)")
    return 0


def select_shapes(shapes, args):
    from ..errors import ShapeError, expect
    from ..problem import parse_scheme

    if args.shapes:
        try:
            pattern = re.compile(args.shapes)
        except re.error as e:
            raise ShapeError(expect("--shapes", "a regular expression", f"{args.shapes!r} ({e})")) from None
        shapes = [s for s in shapes if pattern.search(s.name)]
    if args.m_min is not None:
        shapes = [s for s in shapes if s.m >= args.m_min]
    if args.m_max is not None:
        shapes = [s for s in shapes if s.m <= args.m_max]
    if args.schemes:
        keep = {parse_scheme(s) for s in _split([args.schemes])}
        from dataclasses import replace

        shapes = [replace(s, schemes=tuple(x for x in (s.schemes or keep) if x in keep)) for s in shapes]
        shapes = [s for s in shapes if s.schemes]
    if args.max_shapes is not None:
        if args.max_shapes < 1:
            raise ShapeError(expect("--max-shapes", "a positive integer", args.max_shapes))
        shapes = shapes[: args.max_shapes]
    return shapes


def run_bench(args) -> int:
    from ..errors import TileqError

    if args.list:
        return _list_everything()
    if args.render:
        from .outputs import render_folder

        try:
            paths = render_folder(args.render, plots=not args.no_plots)
        except (OSError, ValueError) as e:
            print(f"tileq bench: error: --render: {e}", file=sys.stderr)
            return 2
        print(f"rewrote {paths['report']}" + (f" and {len(paths['plots'])} plots" if paths["plots"] else ""))
        return 0
    try:
        # First: the interpreter switch must precede any import of tileq's kernels.
        from .device import prepare_device

        device = prepare_device(args.device)
        from .baselines import select
        from .cases import parse_case_list
        from .suites import load_suite

        suite_names = _split(args.suite) or ["smoke"]
        shapes = []
        for name in suite_names:
            shapes += load_suite(name)
        shapes = select_shapes(shapes, args)
        cases = parse_case_list(args.cases)
        impls = select(_split([args.baselines]) if args.baselines else None)
        from .variants import select_impls

        variants = select_impls(_split([args.impls])) if args.impls else ()
    except (TileqError, ValueError, TypeError) as e:
        print(f"tileq bench: error: {e}", file=sys.stderr)
        return 2
    if not any(s.cases_to_run(cases) for s in shapes):
        print("tileq bench: error: no (shape, case) pairs left after the filters", file=sys.stderr)
        return 2

    from .harness import SweepConfig, run_sweep, tileq_failures
    from .outputs import console_summary, write_outputs
    from .timing import TimingConfig

    suite_label = "+".join(os.path.splitext(os.path.basename(s))[0] for s in suite_names)
    out_dir = args.out or os.path.join("tileq-out", f"bench-{suite_label}")
    cfg = SweepConfig(
        shapes=shapes, cases=cases, impls=impls, device=device,
        timing=TimingConfig(args.warmup, args.runs, args.flush, args.graphs),
        seed=args.seed, time_budget_s=args.time_budget, progress=not args.no_progress,
        ceilings=not args.no_ceilings, title=f"bench {suite_label}",
        precompile_jobs=args.precompile_jobs, variants=variants, gluon_tilings=args.gluon_tilings,
        int4_variants=args.int4_variants, rounds=args.rounds,
    )
    if device.type != "cuda":
        print("tileq bench: no CUDA device: checking correctness through Triton's interpreter; "
              "timings need a GPU (rows are marked 'not measured (no GPU)').", file=sys.stderr)
    sweep = run_sweep(cfg)
    command = command_line(args, "bench")
    paths = write_outputs(sweep, out_dir, title=f"tileq bench: {suite_label}", command=command,
                          plots=not args.no_plots)
    print(console_summary(sweep.rows))
    print(f"\n{len(sweep.rows)} rows in {sweep.elapsed_s:.0f} s -> {paths['csv']}, {paths['report']}"
          + (f", {len(paths['plots'])} plots" if paths["plots"] else ""))
    status = 0
    failures = tileq_failures(sweep.rows)
    if failures:
        print(f"\n{len(failures)} tileq results FAILED the correctness gate or raised:", file=sys.stderr)
        for r in failures[:20]:
            print(f"  {r.case} {r.shape} M={r.m} N={r.n} K={r.k}: {r.status}: {r.note}", file=sys.stderr)
        status = 1
    if args.compare:
        status = max(status, _compare(args, sweep.rows))
    return status


def _compare(args, rows) -> int:
    from . import results as R

    try:
        old = R.read_csv(args.compare)
    except (OSError, ValueError) as e:
        print(f"tileq bench: error: --compare: {e}", file=sys.stderr)
        return 2
    changes, notes = R.compare_runs(old, rows, threshold=args.threshold, metric=args.compare_metric)
    print(f"\ncompare with {args.compare}: " + "; ".join(notes))
    if not changes:
        print("no regressions")
        return 0
    print(f"{len(changes)} regressions (> {args.threshold:.0%} slower):")
    print(R.format_changes(changes))
    return 1
