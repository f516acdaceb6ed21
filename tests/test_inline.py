"""torch.compile traces tileq's launches into its graph (``tileq.ops``' inline twins).

The tracing itself runs on a CPU: fake CUDA tensors of a pretended H200 (the planner reads
shapes, strides and dtypes only) go through AOTAutograd in a subprocess without Triton's
interpreter (whose kernels torch cannot wrap). Each traced kernel node must be the launch tileq
itself makes for that signature (the same kernel, grid, integer arguments and constexprs), a
launch torch cannot carry (the Gluon prefill kernel) must leave the opaque op in the graph, and
``TILEQ_INLINE_LAUNCH=0`` keeps every op opaque. Inductor's code for these graphs and its
outputs against the eager path run on the GPU (tests/test_inline_gpu.py).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tileq import settings
from tileq.errors import UnsupportedError
from tileq.kernels import direct

ROOT = pathlib.Path(__file__).resolve().parents[1]

_TRACE = r'''
import json, os, sys, torch
from tileq import device as dev
sm90 = dev.get_arch("sm_90")
dev._cuda_facts = lambda index: dev.DeviceFacts(sm90, 132, sm90.smem_bytes, "NVIDIA H200")
from torch._functorch.aot_autograd import aot_function
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from tileq.integrations.hf import add_rmsnorm_quantize_op, silu_mul_quantize_op
from tileq.kernels import direct
from tileq.moe.layer import fused_moe_op
from tileq.nn import A8W8Config, FP8BlockConfig, FP8RowConfig, QuantLinear
from tileq.ops import linear_op, quant_linear_op

launched = []  # the KernelCalls the traced code went through, in order
_traced = direct.KernelCall._traced
def _record(self, fn, ptrs):
    if direct._MODE.tracing:
        names = [p.name for p in fn.params]
        n = len(ptrs)
        want = dict(zip(names[n:], self.ints))
        want.update({k: v for k, v in self.kwargs.items() if k not in direct._OPTIONS})
        if "PDL" in want:  # traced launches run without PDL (direct.without_pdl)
            assert want["PDL"] is ("launch_pdl" in self.kwargs)
            want["PDL"] = False
        launched.append(dict(name=self.name, grid=list(self.grid) + [1] * (3 - len(self.grid)), values=want,
                             tensors=sorted(names[i] for i, p in enumerate(ptrs) if p is not None)))
    return _traced(self, fn, ptrs)
direct.KernelCall._traced = _record

def graph_of(fn, *shapes):
    graphs = []
    def keep(gm, inputs):
        graphs.append(gm)
        return gm
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(s, dtype=d, device="cuda") for s, d in shapes]
        try:
            aot_function(fn, fw_compiler=keep)(*args)
        except RuntimeError:  # running the graph needs a GPU; tracing it does not
            pass
    nodes = []
    for node in graphs[0].graph.nodes:
        target = str(node.target)
        if "triton_kernel_wrapper" in target:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            values = dict(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
            tensors = []
            for k, v in node.kwargs["kwargs"].items():
                if isinstance(v, torch.fx.Node):
                    tensors.append(k)
                else:
                    values[k] = v
            values = {k: v for k, v in values.items() if v is not None}
            inputs = sorted(k for k in tensors if node.kwargs["kwargs"][k].op == "placeholder")
            nodes.append(dict(kind="kernel", name=kernel.fn.__name__, grid=list(node.kwargs["grid"][0]),
                              values=values, tensors=sorted(tensors), inputs=inputs,
                              num_warps=[c.num_warps for c in getattr(kernel, "configs", [])]))
        elif node.op == "call_function" and "tileq" in target:
            nodes.append(dict(kind="op", name=target))
        elif node.op == "call_function" and "auto_functionalized" in target:  # an op with a mutable argument
            nodes.append(dict(kind="op", name=str(node.args[0])))
        elif node.op == "call_function" and target in ("aten.zeros.default", "aten.full.default"):
            nodes.append(dict(kind="fill", name=target))
    return nodes

def case(name, fn, *shapes):
    launched.clear()
    nodes = graph_of(fn, *shapes)
    for want in launched:
        want["values"] = {k: v for k, v in want["values"].items() if v is not None}
    out[name] = dict(nodes=nodes, launched=list(launched))

out = {}
bf16 = torch.bfloat16

def shaped(cfg, n, k):
    """A QuantLinear's tensors as the trace needs them, shapes and dtypes only (quantizing a real
    weight of these sizes costs minutes on two cores): built on the meta device, W4A16's weight in
    the prepacked layout from_linear makes ([N, K / 8] int32)."""
    ql = QuantLinear(k, n, bias=False, config=cfg, device="meta")
    if ql.spec.weight_int4:
        ql.weight = torch.empty((n, k // 8), dtype=torch.int32, device="meta")
    return ql
for cfg, n, k in ((A8W8Config(), 1024, 5120), (A8W8Config(), 5120, 17408), (FP8BlockConfig(), 34816, 5120),
                  (FP8BlockConfig(), 7168, 5120)):
    ql = shaped(cfg, n, k)
    key = ql.spec.key
    ws = tuple(ql.weight_scale.shape)
    case(f"quant_linear {cfg.name} 1x{n}x{k}", lambda x, w, s: quant_linear_op(x, w, s, None, None, key),
         ((1, 1, k), bf16), (tuple(ql.weight.shape), ql.weight.dtype), (ws, torch.float32))
    # the same with the layer's tile counters (what QuantLinear passes under torch.compile)
    case(f"quant_linear {cfg.name} 1x{n}x{k} counters",
         lambda x, w, s, c: quant_linear_op(x, w, s, None, None, key, c),
         ((1, 1, k), bf16), (tuple(ql.weight.shape), ql.weight.dtype), (ws, torch.float32),
         (tuple(ql.tile_counters.shape), torch.int32))
ql = shaped(FP8RowConfig(), 5120, 5120)
key = ql.spec.key
case("quant_linear FP8Row 2048x5120x5120", lambda x, w, s: quant_linear_op(x, w, s, None, None, key),
     ((2048, 5120), bf16), (tuple(ql.weight.shape), ql.weight.dtype), (tuple(ql.weight_scale.shape), torch.float32))
# prepacked int4 at one token (Qwen3-14B's q/k/v, gate/up, down): the decode kernel's eager configs
# run under a register cap, which a traced launch cannot carry; traced, each runs its uncapped twin
from tileq.dispatch.int4 import config_for
from tileq.nn import W4A16Config
for n, k in ((7168, 5120), (34816, 5120), (5120, 17408)):
    ql = shaped(W4A16Config(), n, k)
    key = ql.spec.key
    name = f"quant_linear W4A16 1x{n}x{k} counters"
    case(name, lambda x, w, s, c: quant_linear_op(x, w, s, None, None, key, c),
         ((1, 1, k), bf16), (tuple(ql.weight.shape), ql.weight.dtype), (tuple(ql.weight_scale.shape), torch.float32),
         (tuple(ql.tile_counters.shape), torch.int32))
    out[name]["eager_config"] = config_for(1, n, k)[0].tag
# the fused decoder layer's steps: norm + quantization, the merged GEMM, SiLU·mul + quantization
case("add_rmsnorm_quantize A8W8", lambda x, r, w: add_rmsnorm_quantize_op(x, r, w, 1e-6, "int8", "row", 128, False),
     ((1, 1, 5120), bf16), ((1, 1, 5120), bf16), ((5120,), bf16))
case("silu_mul_quantize FP8Block", lambda g: silu_mul_quantize_op(g, "fp8", "group", 128, False),
     ((1, 1, 34816), bf16))
case("linear A8W8 prequantized", lambda q, s, w, ws: linear_op(q, w, s, ws, None, "rowcol", bf16, 128, 0, 0),
     ((1, 5120), torch.int8), ((1,), torch.float32), ((34816, 5120), torch.int8), ((34816,), torch.float32))
# its attention at decode (Qwen3-14B's heads over a 2112-position static cache with its bool mask)
from tileq.ops import decode_attention_op
attn_shapes = (((1, 40, 1, 128), bf16), ((1, 8, 2112, 128), bf16), ((1, 8, 2112, 128), bf16),
               ((1, 1, 1, 2112), torch.bool))
attn = lambda q, k, v, m: decode_attention_op(q, k, v, m, 128 ** -0.5)
case("decode_attention 1x40x8x128 L2112", attn, *attn_shapes)
# its q/k preparation writing the static cache (Qwen3-14B's heads, 64 positions) at decode, with what
# transformers reads of the cache's length around it: the positions made from it before the layers
# and the length itself after the layer
from tileq.ops import qk_norm_rope_cache_op
rope_shapes = (((1, 1, 7168), bf16), ((1, 1, 128), bf16), ((1, 1, 128), bf16), ((128,), bf16), ((128,), bf16),
               ((1, 8, 64, 128), bf16), ((1, 8, 64, 128), bf16), ((), torch.int64))
def rope(qkv, cos, sin, qw, kw, keys, values, length):
    positions = torch.arange(1, device=qkv.device) + length
    q = qk_norm_rope_cache_op(qkv, cos, sin, qw, kw, keys, values, length, 40, 8, 1e-6)
    return q * 2, keys.sum(2), values.sum(2), positions, length + 0
case("qk_norm_rope_cache 40x8x128 L64", rope, *rope_shapes)

# Inductor's code for two of them. It generates code without a GPU once told the device's properties
# and given a Triton driver for sm_90 (it does not compile or run what it generates here); torch's
# analysis of which arguments a user kernel writes then runs as on a GPU (it lowers the kernels to
# Triton IR), so a kernel it could not read shows as copies of the inputs.
import types
from unittest import mock
from triton.backends.compiler import GPUTarget
import torch._inductor.compile_fx as compile_fx
import torch._inductor.scheduler as scheduler
import torch.utils._triton as torch_triton
import triton.runtime.driver as triton_driver
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.graph import GraphLowering

props = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132, name="NVIDIA H200", warp_size=32,
                              max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
                              max_threads_per_block=1024, total_memory=141 << 30, L2_cache_size=60 << 20)
class Sm90Driver:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
triton_driver._active = triton_driver._default = Sm90Driver()
torch.cuda.get_device_properties = lambda *a, **k: props
from torch._dynamo.device_interface import CudaInterface
CudaInterface.get_device_properties = staticmethod(torch.cuda.get_device_properties)
# torch 2.14 checks the device through the compile workers' cache of its properties, which it fills
# from torch.cuda.device_count() (none here): given the pretended H200's
import torch._dynamo.device_interface as device_interface
device_interface.caching_worker_device_properties["cuda"] = [props]
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.current_device = lambda: 0
torch.cuda.set_device = lambda *a: None
compile_fx._check_triton_bf16_support = lambda graph: None
scheduler.has_triton = lambda: True
torch_triton.triton_hash_with_backend = lambda: "sm90"

def inductor_code(fn, *shapes):
    codes = []
    with FakeTensorMode(allow_non_fake_inputs=True), \
            mock.patch.object(GraphLowering, "save_output_code", staticmethod(codes.append)):
        args = [torch.empty(s, dtype=d, device="cuda") for s, d in shapes]
        try:
            aot_function(fn, fw_compiler=compile_fx.compile_fx_inner, decompositions=select_decomp_table())(*args)
        except Exception:  # loading the generated module needs CUDA
            pass
    return codes[0] if codes else ""

def inductor_code_writing(fn, mutated, *shapes):
    """inductor_code for ``fn`` writing its inputs ``mutated`` (their indices) in place, as in
    torch.compile's graphs: the new values copied into the inputs at the graph's end, which
    inductor makes writes in place (aot_function's own copy-back needs a CUDA build: added here)."""
    graphs, codes = [], []
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), \
            mock.patch.object(GraphLowering, "save_output_code", staticmethod(codes.append)):
        args = [torch.empty(s, dtype=d, device="cuda") for s, d in shapes]
        try:
            aot_function(fn, fw_compiler=lambda gm, inputs: graphs.append((gm, inputs)) or gm,
                         decompositions=select_decomp_table())(*args)
        except RuntimeError:  # running the graph needs a GPU
            pass
        gm, inputs = graphs[0]
        graph = gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        output = next(n for n in graph.nodes if n.op == "output")
        outs = list(output.args[0])  # the mutated inputs' new values first, in input order
        with graph.inserting_before(output):
            for i, new in zip(mutated, outs):
                graph.call_function(torch.ops.aten.copy_.default, (placeholders[i], new))
        output.args = (tuple(outs[len(mutated):]),)
        gm.recompile()
        try:
            compile_fx.compile_fx_inner(gm, inputs)
        except Exception:  # loading the generated module needs CUDA
            pass
    return codes[0] if codes else ""

inductor = {}
ql = shaped(A8W8Config(), 1024, 5120)
key_plain = ql.spec.key
inductor["quant_linear A8W8 1x1024x5120"] = inductor_code(
    lambda x, w, s: quant_linear_op(x, w, s, None, None, key_plain),
    ((1, 5120), bf16), ((1024, 5120), torch.int8), ((1024,), torch.float32))
inductor["add_rmsnorm_quantize A8W8"] = inductor_code(
    lambda x, r, w: add_rmsnorm_quantize_op(x, r, w, 1e-6, "int8", "row", 128, False),
    ((1, 1, 5120), bf16), ((1, 1, 5120), bf16), ((5120,), bf16))
inductor["decode_attention 1x40x8x128 L2112"] = inductor_code(attn, *attn_shapes)
ql = shaped(W4A16Config(), 7168, 5120)
key_int4 = ql.spec.key
inductor["quant_linear W4A16 1x7168x5120"] = inductor_code(
    lambda x, w, s: quant_linear_op(x, w, s, None, None, key_int4),
    ((1, 1, 5120), bf16), (tuple(ql.weight.shape), ql.weight.dtype), (tuple(ql.weight_scale.shape), torch.float32))
inductor["qk_norm_rope_cache 40x8x128 L64"] = inductor_code_writing(rope, (5, 6, 7), *rope_shapes)
out["inductor"] = inductor
# ten layer calls of one signature: torch's analysis of which arguments a kernel writes runs once
# per distinct launch (kernels/direct.py keeps it), not once per traced launch
ql = shaped(A8W8Config(), 5120, 5120)
key_chain = ql.spec.key
def chain(x, w, s):
    for _ in range(10):
        x = quant_linear_op(x, w, s, None, None, key_chain)
    return x
before = len(direct._ANALYSES)
case("ten quant_linear A8W8 1x5120x5120", chain, ((1, 5120), bf16), (tuple(ql.weight.shape), ql.weight.dtype),
     (tuple(ql.weight_scale.shape), torch.float32))
out["analyses"] = len(direct._ANALYSES) - before
# an MoE layer at one token (Qwen3-30B-A3B shapes): fused_moe's six launches
from tileq.moe.experts import QuantExperts
experts = QuantExperts(128, 2048, 768, config=FP8BlockConfig())
moe_shapes = [((1, 2048), bf16), ((1, 8), torch.int64), ((1, 8), torch.float32)] + [
    (tuple(b.shape), b.dtype) for b in (experts.gate_up_proj, experts.gate_up_proj_scale, experts.down_proj,
                                        experts.down_proj_scale)]
moe = lambda h, i, w, a, b, c, d: fused_moe_op(h, i, w, a, b, c, d, experts.spec.key, "auto", "")
case("fused_moe FP8Block 1 token", moe, *moe_shapes)
inductor["fused_moe FP8Block 1 token"] = inductor_code(moe, *moe_shapes)
import tileq.ops
out["reported"] = sorted(list(r) for r in tileq.ops._REPORTED)  # (op, why) of each op left opaque
print(json.dumps(out))
'''


def _trace(**env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT / "src"), **env_extra)
    proc = subprocess.run([sys.executable, "-c", _TRACE], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def traced():
    return _trace()


_DECODE = ("quant_linear A8W8 1x1024x5120", "quant_linear FP8Block 1x34816x5120",
           "add_rmsnorm_quantize A8W8", "silu_mul_quantize FP8Block", "linear A8W8 prequantized",
           "fused_moe FP8Block 1 token", "decode_attention 1x40x8x128 L2112", "qk_norm_rope_cache 40x8x128 L64")


@pytest.mark.parametrize("name", _DECODE)
def test_decode_launches_are_traced_as_tileq_makes_them(traced, name):
    got = traced[name]
    kernels = [n for n in got["nodes"] if n["kind"] == "kernel"]
    assert not [n for n in got["nodes"] if n["kind"] == "op"], got["nodes"]  # no opaque op left
    # (AOTAutograd may run the op's body more than once: the graph is the last run's launches)
    launched = got["launched"]
    assert kernels and len(launched) % len(kernels) == 0
    for node, want in zip(kernels, launched[-len(kernels):]):
        assert node["name"] == want["name"]
        assert node["grid"] == want["grid"]
        assert node["values"] == want["values"]  # integer arguments and constexprs
        assert node["tensors"] == want["tensors"]
        assert len(node["num_warps"]) == 1  # the launch's warps travel as its one config


def test_quant_linear_is_two_kernels(traced):
    plain = traced["quant_linear A8W8 1x1024x5120"]["nodes"]
    assert [n["name"] for n in plain] == ["_quantize_activation_kernel", "_gemm_kernel"]
    assert plain[1]["values"]["SPLIT_K"] == 1


_SPLITS = ("quant_linear A8W8 1x5120x17408", "quant_linear FP8Block 1x7168x5120")


@pytest.mark.parametrize("name", _SPLITS)
def test_a_split_summed_with_tile_counters_leaves_the_opaque_op(traced, name):
    # without the layer's counters the graph would zero fresh ones with a kernel of its own
    assert traced[name]["nodes"] == [dict(kind="op", name="tileq.quant_linear.default")]
    assert ["quant_linear", "tile counters: a split summed with tile counters the caller did not give"] \
        in traced["reported"]


@pytest.mark.parametrize("name", _SPLITS)
def test_a_split_with_the_layers_counters_is_traced(traced, name):
    got = traced[name + " counters"]
    nodes = got["nodes"]
    assert [n["name"] for n in nodes] == ["_quantize_activation_kernel", "_gemm_kernel"], nodes
    gemm = nodes[1]
    assert gemm["values"]["FIXUP"] is True and gemm["values"]["SPLIT_K"] > 1
    assert "sem_ptr" in gemm["tensors"]  # the counters: the op's input, written by the kernel
    assert not [n for n in nodes if n["kind"] == "fill"]
    launched = got["launched"][-2:]
    assert [(w["name"], w["grid"], w["values"]) for w in launched] == [
        (n["name"], n["grid"], n["values"]) for n in nodes]


def test_a_gluon_launch_leaves_the_opaque_op(traced):
    # 2048 tokens of FP8Row run the sm_90 Gluon prefill kernel: its TMA descriptors hold pointers
    from tileq.dispatch.gluon import gluon_unavailable

    got = traced["quant_linear FP8Row 2048x5120x5120"]["nodes"]
    gluon_why = ["quant_linear", "_ws_gemm_kernel: TMA descriptors hold data pointers"]
    if gluon_unavailable("sm_90", False, None) is None:
        assert got == [dict(kind="op", name="tileq.quant_linear.default")]
        assert gluon_why in traced["reported"]
    else:  # a Triton the Gluon kernels were not tested with: the portable kernel, traced like any other
        assert [(n["kind"], n["name"]) for n in got] == [("kernel", "_quantize_activation_kernel"),
                                                         ("kernel", "_gemm_kernel")], got
        assert gluon_why not in traced["reported"]


_INT4 = ("quant_linear W4A16 1x7168x5120 counters", "quant_linear W4A16 1x34816x5120 counters",
         "quant_linear W4A16 1x5120x17408 counters")


@pytest.mark.parametrize("name", _INT4)
def test_int4_decode_is_traced_with_its_uncapped_config(traced, name):
    # Eagerly the prepacked int4 decode kernel launches under a register cap (maxnreg), which a
    # traced launch cannot carry (torch passes num_warps and num_stages): traced, the plan runs the
    # config's uncapped twin (dispatch.int4.traced_config), launched from inductor's code.
    from tileq.dispatch.int4 import traced_config
    from tileq.kernels.int4p.config import Int4pConfig

    got = traced[name]
    eager = Int4pConfig.parse_tag(got["eager_config"])
    assert eager.maxnreg is not None  # (the case is worth testing: its eager launch is capped)
    twin = traced_config(eager)[0]
    assert twin.maxnreg is None
    nodes = got["nodes"]
    assert not [n for n in nodes if n["kind"] != "kernel"], nodes
    main = nodes[0]
    assert main["name"] == "_i4p_kernel" and "maxnreg" not in main["values"]
    assert (main["values"]["SPLIT_K"], main["values"]["SCALE_AHEAD"]) == (twin.split_k, twin.scale_ahead)
    assert len(nodes) == (2 if twin.split_k > 1 and not twin.in_kernel_sum else 1), nodes  # + the reduction
    if twin.in_kernel_sum:
        assert "sem_ptr" in main["tensors"]  # the layer's counters


def test_inductor_code_of_the_int4_decode_kernel_is_valid_python(traced):
    # inductor writes a traced kernel's source into the module a compile worker imports: each
    # kernel source there parses, and the call launches the int4 kernel itself
    import ast
    import re

    code = traced["inductor"]["quant_linear W4A16 1x7168x5120"]
    sources = re.findall(r"async_compile\.triton\('(\w+)', '''(.*?)'''", code, re.S)
    assert "_i4p_kernel" in [name for name, _ in sources], [name for name, _ in sources]
    for name, src in sources:
        ast.parse(src, filename=name)
    body = code.split("def call(")[1]
    assert "_i4p_kernel_0.run(" in body and "tileq" not in body


def test_kernel_string_constants_are_one_line():
    # torch 2.11's inductor writes a traced kernel's constexpr globals into its source as
    # single-quoted literals without escaping them (2.13 escapes them): a newline in one (the int4
    # conversion's inline assembly was written one instruction per line) ended the literal, and the
    # compile worker could not import the kernel
    import importlib
    import pkgutil

    import triton.language as tl

    import tileq.kernels

    found = []
    for info in pkgutil.walk_packages(tileq.kernels.__path__, "tileq.kernels."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, tl.constexpr) and isinstance(value.value, str):
                found.append(name)
                assert "\n" not in value.value, f"{info.name}.{name}"
    assert "_CVT_BF16" in found and "_CVT_FP16" in found


def test_a_register_cap_is_not_traceable():
    # a launch still asking for maxnreg (a config given to linear_prepacked) keeps the opaque op
    from triton.runtime.jit import JITFunction

    from tileq.kernels.int4p import kernel

    jit = JITFunction(kernel._i4p_kernel.fn)  # (the tests run Triton's interpreter: its own function type)
    assert direct.untraceable_because(jit, dict(num_warps=4, maxnreg=128)) == "launch option maxnreg"
    assert direct.untraceable_because(jit, dict(num_warps=4, num_stages=3)) is None


def test_traced_int4_configs_keep_their_tiling_without_a_cap():
    # every decode config the rule or the table picks at 1-16 tokens on a spread of weights: its
    # traced twin keeps the token tile, the split and how the split is summed, has no cap, and
    # takes three stages (two programs per SM by shared memory, whatever the registers) in place
    # of the four per SM only the 128-register cap gave
    from tileq.dispatch.int4 import config_for, traced_config

    for m in (1, 4, 16):
        for n, k in ((7168, 5120), (5120, 5120), (34816, 5120), (5120, 17408), (57344, 8192), (4096, 14336),
                     (12288, 4096), (1024, 4096)):
            cfg = config_for(m, n, k)[0]
            twin, how = traced_config(cfg)
            assert twin.maxnreg is None, (m, n, k, cfg.tag)
            assert (twin.bm, twin.split_k, twin.fixup, twin.streamk) == (cfg.bm, cfg.split_k, cfg.fixup, cfg.streamk)
            if cfg.maxnreg is None:
                assert twin == cfg and how == ""
            elif cfg.stages == 2 and cfg.maxnreg <= 128:
                assert twin.stages == 3 and twin.scale_ahead, (m, n, k, cfg.tag)
            elif cfg.stages == 2:
                assert twin.stages == 2 and not twin.scale_ahead, (m, n, k, cfg.tag)


def test_inductor_launches_the_kernels_without_copies(traced):
    code = traced["inductor"]["quant_linear A8W8 1x1024x5120"]
    assert code, "inductor generated no code"
    calls = [line.strip() for line in code.splitlines() if ".run(" in line]
    assert len(calls) == 2, calls  # the activation quantization, the GEMM
    assert calls[0].startswith("_quantize_activation_kernel") and calls[1].startswith("_gemm_kernel"), calls
    body = code.split("def call(")[1]  # what runs per call
    assert "clone" not in code and ".copy_(" not in body  # no input copied for the kernels
    assert "tileq" not in body  # no tileq op, no Python of tileq's
    norm = traced["inductor"]["add_rmsnorm_quantize A8W8"]
    assert [line.strip().split(".run(")[0] for line in norm.splitlines() if ".run(" in line] == [
        "_add_rmsnorm_quantize_kernel_0"]
    # torch passes a Python float (eps) as fp64: the kernel rounds it to fp32 as Triton's launcher does
    assert "'eps': 'fp64'" in norm and "tl.cast(eps, tl.float32)" in norm


def test_kernel_write_analysis_runs_once_per_distinct_launch(traced):
    nodes = traced["ten quant_linear A8W8 1x5120x5120"]["nodes"]
    assert [n["name"] for n in nodes] == ["_quantize_activation_kernel", "_gemm_kernel"] * 10
    # at most the quantization's launch and the GEMM's (the former may be known from a case before)
    assert 1 <= traced["analyses"] <= 2


def test_moe_layer_is_its_six_kernels(traced):
    nodes = traced["fused_moe FP8Block 1 token"]["nodes"]
    assert [n["name"] for n in nodes] == ["_quantize_activation_kernel", "_moe_align_kernel", "_grouped_kernel",
                                          "_silu_mul_quantize_kernel", "_grouped_kernel", "_moe_combine_kernel"]
    code = traced["inductor"]["fused_moe FP8Block 1 token"]
    body = code.split("def call(")[1]
    assert len([line for line in body.splitlines() if ".run(" in line]) == 6
    assert "clone" not in code and ".copy_(" not in body and "tileq" not in body


def test_decode_attention_is_its_two_kernels(traced):
    """The fused decoder's decode attention: the split kernel over (kv heads, key ranges) and the
    combine over the query heads, launched by inductor with no copy of the cache (torch's analysis
    sees that only the workspace and the output are written)."""
    name = "decode_attention 1x40x8x128 L2112"
    nodes = traced[name]["nodes"]
    assert [n["name"] for n in nodes] == ["_decode_attention_kernel", "_decode_attention_combine_kernel"]
    assert nodes[0]["grid"] == [8, 33, 1] and nodes[1]["grid"] == [40, 1, 1]  # 33 ranges of 64 keys
    code = traced["inductor"][name]
    assert code, "inductor generated no code"
    body = code.split("def call(")[1]
    assert [line.strip().split(".run(")[0] for line in body.splitlines() if ".run(" in line] == [
        "_decode_attention_kernel_0", "_decode_attention_combine_kernel_1"]
    assert "clone" not in code and ".copy_(" not in body and "tileq" not in body


def test_qk_rope_writes_the_cache_it_is_given(traced):
    """The q/k kernel writing a static cache: it reads the cache's length as the graph receives it
    (not a value the graph computed: the launcher's length increment, had the op's code run twice
    while traced, made the kernel read length + 1 and the cache advance by 2), the graph advances
    the length once, after the launch, and inductor writes the caches and the length in place with
    no copy of them."""
    name = "qk_norm_rope_cache 40x8x128 L64"
    nodes = traced[name]["nodes"]
    assert [n["name"] for n in nodes] == ["_qk_norm_rope_kernel"]
    assert nodes[0]["grid"] == [1, 56, 1] and nodes[0]["values"]["CACHE"] is True
    assert {"kc_ptr", "vc_ptr", "len_ptr"} <= set(nodes[0]["inputs"]), nodes[0]
    code = traced["inductor"][name]
    assert code, "inductor generated no code"
    body = code.split("def call(")[1]
    runs = [line.strip() for line in body.splitlines() if ".run(" in line]
    launch = [line for line in runs if line.startswith("_qk_norm_rope_kernel")]
    assert len(launch) == 1
    # the inputs keys, values and length (arg5_1 .. arg7_1) themselves, then eps: 1e-6 as fp64,
    # which the kernel rounds to fp32
    assert ", arg5_1, arg6_1, arg7_1, 1e-06," in launch[0], launch[0]
    assert "'eps': 'fp64'" in code and "tl.cast(eps, tl.float32)" in code
    # the first launch touching the length is the q/k kernel's (the increment and its readers after it)
    assert [line for line in runs if "arg7_1" in line][0] is launch[0], runs
    assert "clone" not in code and ".copy_(" not in body and "tileq" not in body


def test_switch_off_keeps_every_op_opaque():
    got = _trace(TILEQ_INLINE_LAUNCH="0")
    for name in _DECODE:
        nodes = got[name]["nodes"]
        assert nodes and all(n["kind"] == "op" for n in nodes), (name, nodes)


def test_switch_values(monkeypatch):
    monkeypatch.delenv("TILEQ_INLINE_LAUNCH", raising=False)
    assert settings.current().inline_launch is True
    monkeypatch.setenv("TILEQ_INLINE_LAUNCH", "0")
    assert settings.current().inline_launch is False
    monkeypatch.setenv("TILEQ_INLINE_LAUNCH", "on")
    with pytest.raises(UnsupportedError, match=r"TILEQ_INLINE_LAUNCH: expected 0 or 1, got 'on'"):
        settings.current()


def test_a_launch_states_whether_it_can_be_traced_and_tracing_refuses_one_that_cannot():
    """A KernelCall says, without launching, why torch cannot carry it (the interpreter's kernels
    here; a register cap), and traced it refuses such a launch instead of running it."""
    from tileq.kernels import act_quant

    call = direct.KernelCall(act_quant, "_quantize_activation_kernel", (1, 1), (), {}, ())
    # under the interpreter the kernel is its InterpretedFunction
    assert call.untraced == "_quantize_activation_kernel: InterpretedFunction, not a plain @triton.jit kernel"
    assert not direct.tracing()
    with direct.traced_launches(), pytest.raises(UnsupportedError, match="cannot be traced"):
        assert direct.tracing()
        call((None,), False)
    assert not direct.tracing()


def test_inline_twin_called_eagerly_is_the_op():
    """On real tensors the twin runs the op's implementation (the interpreter's kernels here)."""
    import tileq
    from tileq.ops import quant_linear_op

    lin = torch.nn.Linear(256, 64).to(torch.bfloat16)
    ql = tileq.nn.QuantLinear.from_linear(lin, tileq.nn.A8W8Config())
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    args = (x, ql.weight, ql.weight_scale, ql.bias, None, ql.spec.key)
    assert torch.equal(quant_linear_op.inline(*args), quant_linear_op.op(*args))


def test_a_traced_launch_runs_without_pdl():
    """A traced launch runs without PDL (direct.without_pdl): no launch option, the kernel's PDL
    constexpr off (the split-K reduction's too)."""
    from tileq.kernels import split_k

    on = split_k.flat_reduce_call(64, 16, 16, 2, torch.bfloat16, False, pdl=True)
    assert on.kwargs["PDL"] is True and on.kwargs["launch_pdl"] is True
    kwargs = direct.without_pdl(on.kwargs)
    assert kwargs["PDL"] is False and "launch_pdl" not in kwargs
    assert direct.without_pdl(dict(PDL=True, launch_pdl=True, num_warps=4)) == dict(PDL=False, num_warps=4)
    assert direct.without_pdl(dict(PDL=False)) == dict(PDL=False)


def test_given_tile_counters_serve_where_they_fit():
    """A layer's counters serve its split launches (traced) where they are on the launch's device
    and hold enough; otherwise the per-stream table serves, and a traced launch cannot: a call
    whose split needs counters it was not given is not traced (``tracing.untraced``)."""
    from types import SimpleNamespace

    from tileq import tracing
    from tileq.kernels import buffers

    cpu = torch.device("cpu")
    mine = tracing.layer_tile_counters(1024, cpu)
    assert mine.dtype == torch.int32 and mine.numel() == 128 and not mine.any()
    with buffers.given_tile_counters(mine):
        assert buffers.tile_counters(cpu, 128) is mine
        assert buffers.tile_counters(cpu, 129) is not mine  # too few: fresh zeroed ones
        with direct.traced_launches():
            assert buffers.tile_counters(cpu, 64) is mine
    assert buffers.tile_counters(cpu, 64) is not mine  # outside the block
    with direct.traced_launches(), pytest.raises(UnsupportedError, match="a traced split needs 64"):
        buffers.tile_counters(cpu, 64)
    split = SimpleNamespace(untraced=None, counters=128)
    assert tracing.untraced(split, cpu, mine) is None
    assert tracing.untraced(split, cpu) == tracing.NO_COUNTERS
    assert tracing.untraced(SimpleNamespace(untraced=None, counters=129), cpu, mine) == tracing.NO_COUNTERS
    assert tracing.untraced(SimpleNamespace(untraced="why", counters=0), cpu, mine) == "why"


def test_quant_linear_counters_follow_the_weight():
    """QuantLinear's tile counters: not in its state dict, on its weight's device (a layer built
    on the meta device gets them with its weight), what its compiled calls pass to the op."""
    import tileq

    lin = torch.nn.Linear(256, 64).to(torch.bfloat16)
    ql = tileq.nn.QuantLinear.from_linear(lin, tileq.nn.FP8BlockConfig())
    assert "tile_counters" not in ql.state_dict()
    assert ql._counters() is ql.tile_counters
    again = tileq.nn.QuantLinear.from_quantized(ql.weight, ql.weight_scale, config=ql.config, bias=ql.bias)
    assert again.tile_counters.device.type == "cpu" and not again.tile_counters.any()
    assert again._counters() is again.tile_counters

