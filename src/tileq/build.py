"""Ahead-of-time builds: compile every catalog family for an arch, on any machine.

``triton.compile`` with an explicit ``GPUTarget`` produces real machine code without a GPU, so a
CPU-only CI proves every kernel compiles and uses the instructions we expect (wgmma on sm_90).
Each family is built at its canonical specialization (``families.family_spec``) with the config
the planner would choose for a representative shape of its pipeline. The manifest records name,
config, registers, shared memory, spills, instruction checks and the Triton version.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import triton

from .errors import UnsupportedError, expect
from .device import ArchInfo, check_types, get_arch
from .kernels.binary import resource_usage
from .kernels.config import TileConfig
from .catalog.families import catalog, family_spec
from .dispatch import thresholds
from .dispatch.gluon import GLUON_ARCH, gluon_config, gluon_serves
from .dispatch.heuristic import choose_pipeline, heuristic_config
from .dispatch.gemm import sums_in_kernel
from .catalog.names import KernelFamily, KernelInstance, parse_family

# Representative shapes: a Qwen3-14B projection (N = K = 5120) at prefill and decode sizes.
PREFILL_SHAPE = (4096, 5120, 5120)
DECODE_SHAPE = (1, 5120, 5120)


@dataclass
class BuildResult:
    name: str
    family: str
    config: str
    ok: bool
    seconds: float
    registers: int | None = None
    spills: int | None = None
    shared_bytes: int | None = None
    mma: str | None = None  # 'wgmma', 'mma' or None
    error: str | None = None
    binary: str | None = None


def instance_for(fam: KernelFamily, arch: ArchInfo, swap: bool = False) -> tuple[KernelInstance, object]:
    """The instance a build compiles: the planner's default config, or its swapped variant."""
    m, n, k = DECODE_SHAPE if fam.pipeline == "decode" else PREFILL_SHAPE
    spec = family_spec(fam, m, n, k)
    decode_max_m = thresholds.for_arch(arch.name).DECODE_MAX_M
    assert choose_pipeline(spec, decode_max_m) == fam.pipeline, (fam.name, choose_pipeline(spec, decode_max_m))
    check_types(arch, spec.a_type, spec.b_type)
    cfg = heuristic_config(spec, arch, fam.pipeline, arch.typical_sms)
    if swap:
        cfg = swapped_variant(cfg, fam.pipeline)
    return KernelInstance(fam, cfg, arch.name), spec


def swapped_variant(cfg: TileConfig, pipeline: str) -> TileConfig:
    """The C^T = B^T A^T counterpart of a config (a tuning candidate, built to prove it compiles)."""
    if pipeline == "decode":
        return TileConfig(64, cfg.block_m, min(cfg.block_k, 128), 4, 4, cfg.split_k, swap_ab=True)
    return TileConfig(128, 128, cfg.block_k, 8, 3, swap_ab=True)


def wants_swapped_build(fam: KernelFamily) -> bool:
    """Decode families and int4-weight families get their swapped variant built too."""
    return fam.pipeline == "decode" or fam.b.value == "i4"


def wants_gluon_build(fam: KernelFamily, arch: ArchInfo) -> bool:
    """Families the sm_90 Gluon kernel serves (dispatch/gluon.py) get it built too on sm_90."""
    if arch.name != GLUON_ARCH or fam.pipeline == "decode":
        return False
    return gluon_serves(family_spec(fam, *PREFILL_SHAPE), fam.pipeline, _decode_max_m(arch)) is None


def _decode_max_m(arch: ArchInfo) -> int:
    return thresholds.for_arch(arch.name).DECODE_MAX_M


def _gluon_spec(fam: KernelFamily, fast: bool):
    return replace(family_spec(fam, *PREFILL_SHAPE), fast_accum=fast)


def wants_gluon_fast_build(fam: KernelFamily, arch: ArchInfo) -> bool:
    """Families whose fast_accum calls run a different Gluon kernel (fp8 tensor/rowcol: the
    wgmma accumulates over all of K, ``_fa`` instances) get that one built too."""
    from .kernels.gluon.config import accumulation

    if not wants_gluon_build(fam, arch):
        return False
    spec = _gluon_spec(fam, True)
    return accumulation(spec) == "fast" and gluon_serves(spec, fam.pipeline, _decode_max_m(arch)) is None


INT4P_ACTIVATIONS = ("bf16", "fp16", "fp8", "bf8")


def wants_int4p_build(fam: KernelFamily, arch: ArchInfo) -> bool:
    """Decode families of nn.Linear int4 weights (rcr, bquant) get the prepacked-int4 kernel
    (tileq.prepacked: sm_90 wgmma with inline PTX) built too on sm_90."""
    return (arch.name == "sm_90" and fam.pipeline == "decode" and fam.b.value == "i4" and fam.layout == "rcr"
            and fam.a.value in INT4P_ACTIVATIONS and fam.scheme.value == "bquant")


def wants_int4p_prefill_build(fam: KernelFamily, arch: ArchInfo) -> bool:
    """Prefill families of nn.Linear int4 weights with 16-bit or fp8 activations (rcr, bquant:
    W4A16, and W4A8 below 256 tokens: e4m3 on the kernel's fp8 build, e5m2 cast to bf16 on its
    16-bit build with the activations' scale) get the sm_90 Gluon prefill kernel on prepacked
    weights (tileq.kernels.int4p.prefill_launch) built too."""
    return (arch.name == "sm_90" and fam.pipeline == "prefill" and fam.b.value == "i4" and fam.layout == "rcr"
            and fam.a.value in ("bf16", "fp16", "fp8", "bf8") and fam.scheme.value == "bquant")


def int4p_prefill_impls(fam: KernelFamily) -> list[str]:
    """The prefill kernel's instances built for a family (``_INT4P_PREFILL_TILES``): W4A8's builds
    take no 256-token tiles (they refuse activation scales) and no stream-K (W4A16 only)."""
    return [impl for impl, (tokens, _, streamk) in _INT4P_PREFILL_TILES.items()
            if fam.a.value not in ("fp8", "bf8") or (tokens <= 128 and not streamk)]


def _attempt(name: str, family: str, config: str, t0: float, build) -> tuple[BuildResult, object]:
    """(result, compiled kernel or None) of ``build()``: a failure is a result with the last line
    of its error, not an exception."""
    try:
        compiled = build()
    except Exception as e:
        msg = str(e).strip().splitlines()
        return BuildResult(name, family, config, False, time.time() - t0,
                           error=f"{type(e).__name__}: {msg[-1] if msg else ''}"[:500]), None
    return BuildResult(name, family, config, True, time.time() - t0), compiled


def _compile_int4p_prefill(fam: KernelFamily, arch: ArchInfo, t0: float, tokens: int = 128, split: int = 1,
                           streamk: bool = False) -> tuple[BuildResult, object]:
    from .device import for_arch
    from .dispatch.int4 import overlap_for
    from .kernels.int4p.config import W_SCALE_OF_SCHEME
    from .kernels.int4p.prefill_launch import TMA_STORE_MAX_TOKENS, compile_sm90, config_tag, kernel_name

    w_kind = W_SCALE_OF_SCHEME[fam.scheme.value]
    # W4A8 always has its activations' per-token scale: e4m3 on the fp8 build, e5m2 cast to bf16
    # on the 16-bit build ('_xs')
    ct = "bf16" if fam.a.value == "bf8" else fam.a.value
    x_scale = "vector" if fam.a.value in ("fp8", "bf8") else "none"
    cast = fam.a.value == "bf8"
    return _attempt(kernel_name(ct, w_kind, tokens, split, streamk, cast), fam.name,
                    config_tag(tokens, split, streamk, cast), t0,
                    lambda: compile_sm90(ct, w_kind, tokens=tokens, split=split,
                                         tma_store=split == 1 and tokens <= TMA_STORE_MAX_TOKENS, x_scale=x_scale,
                                         streamk=streamk, overlap=overlap_for(ct, tokens, for_arch(arch.name))))


# The int4 prefill kernel's instances built per family: (token tile, split over K, stream-K) by
# impl name. 64 tokens: calls of 33-64 tokens; split two ways: narrow weights (dispatch.int4.prefill_tiling);
# 256 tokens: from 256 where their waves cost less (masked stores); stream-K with 128- and
# 256-token tiles: W4A16 at 128-1023 tokens where dispatch.int4.streamk_for picks it (neither for
# W4A8's builds, ``int4p_prefill_impls``). Other split counts differ in one constant (the K range of
# an item) and compile on first use.
_INT4P_PREFILL_TILES = {"int4p_prefill": (128, 1, False), "int4p_prefill64": (64, 1, False),
                        "int4p_prefill_split": (64, 2, False), "int4p_prefill_split128": (128, 2, False),
                        "int4p_prefill256": (256, 1, False), "int4p_prefill_stk": (128, 1, True),
                        "int4p_prefill256_stk": (256, 1, True)}


def wants_int4p_streamk_build(fam: KernelFamily, arch: ArchInfo) -> bool:
    """The decode kernel's stream-K instance (the decode rule's choice for wave tails, 16-bit
    activations only: ``dispatch.int4._streamk_tail``) built beside the default one."""
    return wants_int4p_build(fam, arch) and fam.a.value in ("bf16", "fp16")


def _compile_int4p(fam: KernelFamily, arch: ArchInfo, t0: float, streamk: bool = False
                   ) -> tuple[BuildResult, object]:
    from triton.backends.compiler import GPUTarget

    from .device import for_arch
    from .dispatch.int4 import STREAMK_CONFIG, default_config
    from .kernels.int4p.config import W_SCALE_OF_SCHEME, kernel_name
    from .kernels.int4p.launch import compile_options, compile_source

    cfg = STREAMK_CONFIG if streamk else default_config(*DECODE_SHAPE, fam.a.value, for_arch(arch.name))
    w_scale = W_SCALE_OF_SCHEME[fam.scheme.value]
    major, minor = arch.capability
    return _attempt(kernel_name(fam.a.value, w_scale, cfg), fam.name, f"int4p_{cfg.tag}", t0,
                    lambda: triton.compile(compile_source(fam.a.value, w_scale, cfg),
                                           target=GPUTarget("cuda", major * 10 + minor, 32),
                                           options=compile_options(cfg)))


def _compile_gluon(fam: KernelFamily, arch: ArchInfo, t0: float, fast: bool = False) -> tuple[BuildResult, object]:
    from .kernels.gluon.config import instance_name, instance_tag
    from .kernels.gluon.launch import compile_sm90

    spec = _gluon_spec(fam, fast)
    cfg = gluon_config(spec, arch.typical_sms)
    name = instance_name(fam.name, spec, cfg, arch.tag)
    return _attempt(name, fam.name, f"gluon_{instance_tag(spec, cfg)}", t0, lambda: compile_sm90(spec, cfg))


def _compile_gluon_fast(fam: KernelFamily, arch: ArchInfo, t0: float) -> tuple[BuildResult, object]:
    return _compile_gluon(fam, arch, t0, fast=True)


# The kernels built beside a family's portable Triton kernel, by ``compile_one``'s impl.
_SPECIAL = {"gluon": _compile_gluon, "gluon_fast": _compile_gluon_fast, "int4p": _compile_int4p,
            "int4p_stk": partial(_compile_int4p, streamk=True),
            **{impl: partial(_compile_int4p_prefill, tokens=tokens, split=split, streamk=streamk)
               for impl, (tokens, split, streamk) in _INT4P_PREFILL_TILES.items()}}


def compile_one(family_name: str, arch_name: str, out_dir: str | None, swap: bool = False,
                impl: str = "triton") -> BuildResult:
    """Compile one family (runs in a worker process): the portable Triton kernel, its swapped
    variant, the sm_90 Gluon kernel (``impl='gluon'``; 'gluon_fast': its fast_accum instance),
    the prepacked-int4 decode kernel
    ('int4p'; 'int4p_stk' its stream-K instance) or the prepacked-int4 Gluon prefill kernel (the impls of ``_INT4P_PREFILL_TILES``)."""
    from triton.backends.compiler import GPUTarget

    from .kernels.gemm_kernel import _gemm_kernel
    from .kernels.launch import signature

    fam = parse_family(family_name)
    arch = get_arch(arch_name)
    t0 = time.time()
    if impl in _SPECIAL:
        res, compiled = _SPECIAL[impl](fam, arch, t0)
        if compiled is not None:
            _finish(res, compiled, out_dir)
        return res
    try:
        inst, spec = instance_for(fam, arch, swap)
    except Exception as e:  # an illegal family for this arch is a build failure, said loudly
        return BuildResult(f"{family_name}__?_{arch.tag}", family_name, "?", False, 0.0,
                           error=f"{type(e).__name__}: {e}")
    sig, consts, attrs = signature(spec, inst.config, fixup=sums_in_kernel(fam.pipeline, inst.config))
    major, minor = arch.capability
    res, compiled = _attempt(
        inst.name, family_name, inst.config.tag, t0,
        lambda: triton.compile(triton.compiler.ASTSource(fn=_gemm_kernel, signature=sig, constexprs=consts,
                                                         attrs=attrs),
                               target=GPUTarget("cuda", major * 10 + minor, 32),
                               options={"num_warps": inst.config.num_warps, "num_stages": inst.config.num_stages}))
    if compiled is not None:
        _finish(res, compiled, out_dir)
    return res


def _finish(res: BuildResult, compiled, out_dir: str | None) -> None:
    """Shared memory, mma kind, and with an output folder the binary, registers and spills."""
    ptx = compiled.asm.get("ptx", "")
    res.mma = "wgmma" if "wgmma.mma_async" in ptx else ("mma" if re.search(r"\bmma\.sync", ptx) else None)
    res.shared_bytes = int(compiled.metadata.shared)
    if out_dir:
        path = Path(out_dir) / f"{res.name}.cubin"
        path.write_bytes(compiled.asm["cubin"])
        res.binary = path.name
        res.registers, res.spills = resource_usage(path)


def catalog_family(name: str, arg: str = "--family") -> KernelFamily:
    """The catalog family called ``name``; else an UnsupportedError naming the closest names (the
    catalog holds a few hundred: ``tileq list --names`` prints them all)."""
    import difflib

    names = [f.name for f in catalog()]
    if name in names:
        return parse_family(name)
    close = difflib.get_close_matches(str(name), names, n=6, cutoff=0.6)
    hint = f"; the closest: {', '.join(close)}" if close else f", e.g. {', '.join(names[:3])}"
    raise UnsupportedError(expect(arg, f"one of the {len(names)} families of the kernel catalog, named "
                                  f"{{scheme}}_{{a}}x{{b}}_{{layout}}_{{pipeline}} (`tileq list --names` lists "
                                  f"them){hint}", repr(name)))


def build_catalog(arch_name: str, out_dir: str | None, *, jobs: int | None = None,
                  families: list[str] | None = None, progress=None) -> list[BuildResult]:
    from ._runtime import interpreter_active

    # An unknown arch or family is refused before any work, naming the valid ones.
    arch = get_arch(arch_name)
    names = [catalog_family(n).name for n in families] if families else [f.name for f in catalog()]
    if interpreter_active():
        raise UnsupportedError("tileq build: TRITON_INTERPRET=1 is set; unset it to compile kernels")
    work = [(n, False, "triton") for n in names]
    work += [(n, True, "triton") for n in names if wants_swapped_build(parse_family(n))]
    work += [(n, False, "gluon") for n in names if wants_gluon_build(parse_family(n), arch)]
    work += [(n, False, "gluon_fast") for n in names if wants_gluon_fast_build(parse_family(n), arch)]
    work += [(n, False, "int4p") for n in names if wants_int4p_build(parse_family(n), arch)]
    work += [(n, False, "int4p_stk") for n in names if wants_int4p_streamk_build(parse_family(n), arch)]
    work += [(n, False, impl) for n in names if wants_int4p_prefill_build(parse_family(n), arch)
             for impl in int4p_prefill_impls(parse_family(n))]
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    jobs = jobs or max(1, os.cpu_count() or 1)
    results: list[BuildResult] = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(compile_one, n, arch.name, out_dir, swap, impl) for n, swap, impl in work]
        for i, fut in enumerate(futures, 1):
            r = fut.result()
            results.append(r)
            if progress:
                progress(i, len(work), r)
    if out_dir:
        write_manifest(Path(out_dir) / "manifest.json", arch, results)
    return results


def write_manifest(path: Path, arch: ArchInfo, results: list[BuildResult]) -> None:
    import torch

    doc = {
        "arch": arch.name,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kernels": [r.__dict__ for r in results],
    }
    path.write_text(json.dumps(doc, indent=1))
