"""Every fitted routing number, named once, in one table per arch.

Each entry says what it decides and the results that back it (a path under ``bench/results/``).
The rules in ``dispatch/`` read them through ``for_arch(name)``; no other module holds a routing
number. Only sm_90 (an H200) has been measured: the other archs' tables are sm_90's values,
marked as not measured there, until someone measures them (``tileq tune`` / ``tileq bench``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    value: float
    decides: str
    evidence: str  # a results directory or file under bench/results/, or "device fact" / "kernel build"


class Table:
    """The thresholds of one arch: ``table.NAME`` is the value, ``table.entries`` the records."""

    def __init__(self, arch: str, entries: dict[str, Threshold], measured_on: str):
        self.arch, self.entries, self.measured_on = arch, dict(entries), measured_on
        for name, t in entries.items():
            setattr(self, name, t.value)

    def __repr__(self) -> str:
        return f"Table({self.arch}, {len(self.entries)} thresholds, measured on {self.measured_on})"


_H200 = "bench/results/h200/"
_H100 = "bench/results/h100/"  # an H100 (same SMs, 3.35 TB/s): where the H200 was not available

# ----------------------------------------------------------------------------- sm_90 (H200)
_TUNE_DECODE = _H200 + "tuned_decode_readflush_2026-11-29.candidates.csv"

SM90: dict[str, Threshold] = {
    # --- 8-bit and pk_int4 GEMMs: the pipeline and the portable kernel's decode config
    #     (dispatch/plan.py, dispatch/heuristic.py) ---
    "DECODE_MAX_M": Threshold(
        64, "the largest logical M planned with the decode pipeline (memory-bound tiles); above, prefill",
        _H200 + "decode/"),
    "DECODE_SPLIT_PROGRAMS_PER_SM": Threshold(
        2, "grouped unswapped decode: split over K until the grid has this many programs per SM",
        _H200 + "decode/"),
    "DECODE_SPLIT_MIN_K_TILES": Threshold(
        4, "decode split over K: each split keeps at least this many K tiles", _H200 + "decode/"),
    "DECODE_SPLIT_MAX": Threshold(16, "grouped unswapped decode: the largest split over K", _H200 + "decode/"),
    "DECODE_SWAP_MAX_M": Threshold(
        16, "8-bit weights run the swapped decode kernel (weight on the mma's 64-row side) up to this M",
        _TUNE_DECODE),
    "DECODE_SWAP_MIN_TILES_PER_SM": Threshold(
        0.6, "... when N gives at least this many 64-row tiles per SM", _TUNE_DECODE),
    "DECODE_SWAP_SPLIT_PROGRAMS_PER_SM": Threshold(
        2.5, "swapped grouped decode: split over K (summed in the kernel) until the grid has this many "
             "programs per SM", _H100 + "decode-split/"),
    "DECODE_SWAP_SPLIT_MAX": Threshold(8, "swapped grouped decode: the largest split over K", _H100 + "decode-split/"),
    "DECODE_SINGLE_PASS_PROGRAMS_PER_SM": Threshold(
        1.2, "non-grouped decode (one pass over K): the widest N tile giving this many programs per SM",
        _TUNE_DECODE),
    "DECODE_LONG_K": Threshold(
        16384, "non-grouped 8-bit decode: K tiles of 512 from this K (256 below)", _TUNE_DECODE),
    # --- the sm_90 Gluon prefill kernel (dispatch/gluon.py) ---
    "GLUON_INT8_MIN_M": Threshold(
        128, "int8 x int8 prefill runs the Gluon kernel from this M (below: not timed against the portable one)",
        _H200 + "gluon/preload/"),
    "GLUON_WIDE_TILE_GAIN": Threshold(
        1.2, "wave model: a 128 x 256 overlapped tile's throughput per column over a 128 x 128 tile's "
             "(group-scaled fp8, 16-bit output)", _H200 + "gluon/tiles/"),
    "GLUON_NARROW64_STEP": Threshold(
        0.6, "wave model: a 128 x 64 tile's K step, in K steps of a 128 x 128 tile", _H200 + "gluon/tiles/"),
    "GLUON_SPLIT_FIXED_STEPS": Threshold(
        12.0, "wave model: splitting the last wave over K costs this many K steps (partials + reduction)",
        _H200 + "gluon/tiles/"),
    "GLUON_MIN_SPLIT_STEPS": Threshold(
        4, "wave model: each K range of a split keeps at least this many K steps", _H200 + "gluon/tiles/"),
    "GLUON_MAX_SPLIT_K": Threshold(16, "wave model: the largest split of the last wave", _H200 + "gluon/tiles/"),
    "GLUON_SWAP_COLUMN_GROUPS": Threshold(
        1, "bquant with one-column b_scale groups runs swapped (1.69x the portable kernel)",
        _H200 + "gluon/bquant-swapped/"),
    # --- activation quantization (dispatch/act_quant.py) ---
    "ACT_QUANT_LARGE_M": Threshold(
        256, "row quantization from this many rows takes fewer warps per program (many programs stream "
             "at once; with 16 warps the kernel ran at 2.1-2.5x its byte floor at M = 4096)", _H200 + "act-quant/"),
    "ACT_QUANT_LARGE_M_ELEMS_PER_THREAD": Threshold(
        64, "... about this many elements per thread", _H200 + "act-quant/"),
    "ACT_QUANT_SCRATCH_MAX_M": Threshold(
        64, "a kept quantization launch (QuantLinear's eager runner) writes calls of up to this many rows into "
            "outputs it keeps (two allocations fewer per call); more rows allocate per call (kept outputs would "
            "cost M x K bytes per layer for every prefill length)", _H200 + "host-cost/"),
    "GLUON_EPI_PRELOAD": Threshold(
        1, "schemes without group scales load the epilogue's vectors at each tile's start (1.02-1.10x)",
        _H200 + "gluon/preload/"),
    # --- the grouped GEMM (dispatch/grouped.py); designed, not yet measured: the variants of
    #     tests/test_grouped_gpu.py's report decide them ---
    "GROUPED_SWAP_MAX_M": Threshold(
        32, "grouped decode: the swapped tile (16 or 32 tokens on the mma's narrow side) up to this many rows "
            "per expert (designed, not yet measured)", "docs/grouped.md"),
    "MOE_MASKED_MAX_ROWS": Threshold(
        4096, "fused_moe: the masked grouped form while E x T rows stay at most this (decode), the contiguous "
              "form above (designed, not yet measured; tileq moebench --forms measures both)", "docs/moe.md"),
    "GROUPED_PREFILL_FP8_BLOCK_M": Threshold(
        64, "grouped fp8 x fp8 prefill: the row tile (with 4 warps, 4 stages) instead of the arch's 128-row "
            "prefill tile (faster at all 4 prefill shapes measured: 1.12-1.36x the 128-row tile)",
        "bench/results/h200/moe/grouped_variants.md"),
    "GROUPED_PREFILL_GROUP_M": Threshold(
        8, "grouped prefill: row tiles per group of the launch order (L2 reuse of x rows and weight tiles) "
           "(designed, not yet measured)", "docs/grouped.md"),
}

# --- prepacked int4 (dispatch/int4.py) ---
_INT4 = _H200 + "int4/"

SM90_INT4: dict[str, Threshold] = {
    # the decode kernel (Triton, 16- or 32-token tiles); its occupancy bands are facts of the build
    # (kernels/int4p/config.py: PER_SM_*)
    "INT4_DECODE_TILE16_MAX_M": Threshold(
        16, "the decode kernel runs 16-token tiles up to this M, 32-token tiles above", _INT4 + "decode-rule/"),
    "INT4_DECODE_SPLIT_WAVES": Threshold(
        1.5, "decode: split over K (powers of two) while the programs are fewer than this x SMs",
        _INT4 + "decode-rule/"),
    "INT4_DECODE_SPLIT_STEP": Threshold(2, "decode: each step of the split over K multiplies it by this",
                                        _INT4 + "decode-rule/"),
    "INT4_DECODE_SPLIT_MIN_KTILES": Threshold(
        2, "decode: every K range of a split keeps at least this many 512-wide K tiles", _INT4 + "decode-rule/"),
    "INT4_DECODE_STREAMK_TAIL": Threshold(
        0.25, "decode, 16-bit activations: an unsplit config whose last wave (of its programs per SM) is at "
              "most this full takes stream-K", _INT4 + "streamk-decode/"),
    "INT4_TUNED_MAX_M": Threshold(
        16, "the decode tuned table serves M up to this (entries m=1: M = 1; m=16: M 2-16)",
        _INT4 + "scale-ahead/"),
    "INT4_W4A8_CAST_MAX_M": Threshold(
        32, "W4A8 on the decode kernel: above this M the fp8 activations are cast to bf16 first; up to it "
            "the weight's size decides", _INT4 + "fp16-routed/"),
    "INT4_W4A8_CAST_MIN_BYTES": Threshold(
        75_000_000, "... up to INT4_DECODE_TILE16_MAX_M tokens: cast from this many bytes of int4",
        _INT4 + "fp16-decode/"),
    "INT4_W4A8_CAST_MIN_BYTES_32": Threshold(
        40_000_000, "... above it (32-token tiles): cast from this many bytes of int4", _INT4 + "fp16-routed/"),
    # the Gluon prefill kernel (64-, 128- and 256-token tiles) and the prefill paths
    "INT4_PREFILL_MIN_M": Threshold(
        33, "the Gluon prefill kernel takes calls from this M where its plan gives it them (below: decode)",
        _INT4 + "small-m/"),
    "INT4_DEQUANT_MIN_M": Threshold(
        256, "from this M a prefill path takes every call: the Gluon kernel where it serves it, else W4A8 the "
             "fp8 GEMM on the values, W4A16 dequantize + cuBLAS", _INT4 + "prefill-gluon/"),
    "INT4_SMALL_M_FILL": Threshold(
        0.65, "below INT4_DEQUANT_MIN_M the Gluon kernel takes an unsplit call with at least this x SMs tiles "
              "of 64 tokens ...", _INT4 + "small-m/"),
    "INT4_SMALL_M_FILL_128": Threshold(0.5, "... this x SMs from INT4_SMALL_M_FILL_128_MIN_M tokens",
                                       _INT4 + "small-m/"),
    "INT4_SMALL_M_FILL_128_MIN_M": Threshold(128, "... where the decode kernel's cost has grown with M",
                                             _INT4 + "small-m/"),
    "INT4_T64_MAX_M": Threshold(64, "the Gluon kernel's 64-token tile up to this M (a 128-token one would be "
                                    "half padding)", _INT4 + "split-k/"),
    "INT4_TILE64_COST": Threshold(
        0.8, "wave cost of a 64-token tile, in 128-token tiles (below INT4_DEQUANT_MIN_M)", _INT4 + "small-m/"),
    "INT4_SPLIT_FILL": Threshold(
        0.65, "the Gluon kernel splits K where its tiling has at most this x SMs tiles", _INT4 + "split-k/"),
    "INT4_SPLIT_MIN_BLOCKS": Threshold(
        2, "each K range of the Gluon kernel's split keeps at least this many 512-wide K blocks ...",
        _INT4 + "split-k/"),
    "INT4_SPLIT_MIN_BLOCKS_WIDE": Threshold(4, "... and this many above INT4_SPLIT_MIN_BLOCKS_MAX_M tokens",
                                            _INT4 + "split-k/"),
    "INT4_SPLIT_MIN_BLOCKS_MAX_M": Threshold(128, "... (one 128-token tile)", _INT4 + "split-k/"),
    "INT4_MAX_SPLIT": Threshold(8, "the largest split over K the Gluon prefill plan tries", _INT4 + "split-cost/"),
    "INT4_T256_MIN_M": Threshold(
        256, "256-token tiles from this M where their waves cost less (W4A16)", _INT4 + "round6/"),
    "INT4_TILE256_COST": Threshold(1.7, "wave cost of a 256-token tile, in 128-token tiles", _INT4 + "t256/"),
    "INT4_T256_THIN_MAX_M": Threshold(
        512, "below this M no 256-token tiles whose last tile holds fewer than 128 tokens", _INT4 + "thin-t256/"),
    "INT4_STREAMK_MIN_M": Threshold(128, "W4A16 prefill may take stream-K from this M ...",
                                    _INT4 + "streamk-hybrid/"),
    "INT4_STREAMK_MAX_M": Threshold(1024, "... below this M", _INT4 + "streamk-hybrid/"),
    "INT4_STREAMK_OVERHEAD": Threshold(
        3, "stream-K cost: K blocks a program adds for its partial tiles' epilogues and the fix-up",
        _INT4 + "streamk-hybrid/"),
    "INT4_STREAMK_MARGIN": Threshold(
        1.1, "stream-K replaces the plan's tiling where its cost times this is lower", _INT4 + "streamk-hybrid/"),
    "INT4_STREAMK_T256_MIN_M": Threshold(129, "stream-K with 256-token tiles from this M", _INT4 + "fp16-decode/"),
    "INT4_GROUP_SCALE_MAX_M": Threshold(
        1024, "W4A16 with group scales: dequantize + cuBLAS from this M (the Gluon kernel below) ...",
        _INT4 + "fp8-prefill/"),
    "INT4_GROUP_T256_MAX_M": Threshold(2048, "... except 256-token tiles, below this M", _INT4 + "t256/"),
    "INT4_W4A8_MAX_M": Threshold(
        256, "W4A8 on the Gluon prefill kernel below this M; from it the fp8 GEMM on the values", _INT4 + "w4a8-swapped/"),
    "INT4_FUSED_WIDE_N": Threshold(
        16384, "W4A8 from INT4_W4A8_MAX_M: the fused fp8 build keeps weights of at least this N ...",
        _INT4 + "round7/"),
    "INT4_FUSED_WIDE_N_MAX_M": Threshold(288, "... up to this M", _INT4 + "fused-320/"),
    "INT4_FUSED_WIDE_K": Threshold(8192, "... and weights of at least this K ...", _INT4 + "round7/"),
    "INT4_FUSED_WIDE_MAX_M": Threshold(256, "... up to this M", _INT4 + "round7/"),
    "INT4_OVERLAP": Threshold(
        1, "the 16-bit prefill build converts the next slice while this one's wgmmas run, where it builds "
           "(1: on)", _INT4 + "overlap/"),
}

_TABLES: dict[str, Table] = {}


def for_arch(name: str | None) -> Table:
    """The table for arch ``name`` ('sm_90', ...); archs without measurements get sm_90's values
    (``measured_on`` says so). None: sm_90's."""
    name = name or "sm_90"
    t = _TABLES.get(name)
    if t is None:
        measured = "H200 (sm_90)" if name == "sm_90" else f"H200 (sm_90); not measured on {name}"
        t = _TABLES[name] = Table(name, {**SM90, **SM90_INT4}, measured)
    return t
