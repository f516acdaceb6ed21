"""The call cache of tileq.gemm / tileq.linear and the direct kernel launch (CPU).

A repeated call signature skips validation and planning (api.py) and reuses the launch's fixed
arguments (kernels/launch.py GemmLaunch). These tests check that a hit computes what a miss
computes, that anything validation reads changes the signature, that errors are unchanged after
a valid call, and that the cache is bounded. The direct launch itself needs a GPU
(tests/test_gpu.py); here its argument order is checked against a stand-in compiled kernel.
"""

import inspect

import pytest
import torch

import tileq
from tileq import api
from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.dtypes import PackedInt4
from tileq.errors import DTypeError, LayoutError, ShapeError, TileqError, UnsupportedError
from tileq.kernels import buffers, direct, launch, split_k
from tileq.quant import pack_int4
from tileq.testing import KernelRecorder, check_close, make_args


@pytest.fixture(autouse=True)
def _fresh_cache():
    api.clear_call_cache()
    yield
    api.clear_call_cache()


@pytest.fixture
def recorder(monkeypatch):
    rec = KernelRecorder()
    monkeypatch.setattr(launch, "_gemm_kernel", rec)
    monkeypatch.setattr(split_k, "_split_reduce_kernel", KernelRecorder())
    return rec


def _fp8_linear_args(m=3, n=40, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 32).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=g) * 32).to(torch.float8_e4m3fn)
    return x, w, torch.rand(m, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5


# ---- a hit computes what a miss computes -------------------------------------------------------

CASES = [
    # (family, m, n, k, extra make_args keywords)
    ("rowcol_fp8xfp8_rcr_decode", 3, 40, 64, dict(bias=True)),
    ("rowcol_i8xi8_rcr_decode", 5, 24, 48, dict(acc=True)),
    ("abquant_fp8xfp8_rcr_prefill", 70, 40, 200, dict(bias=True)),
    ("bquant_fp8xi4_rcr_decode", 4, 32, 256, dict()),
    ("aquant_i4xfp8_crr_preshufflequant", 6, 24, 128, dict()),
    ("tensor_fp8xfp8_rrr_decode", 2, 24, 40, dict(pad=16)),
]


@pytest.mark.parametrize("family,m,n,k,extra", CASES)
def test_hit_equals_miss_on_new_data(family, m, n, k, extra):
    spec = family_spec(parse_family(family), m, n, k)
    first = make_args(spec, seed=1, **extra)
    first.call(tileq.gemm, backend="triton")
    assert len(api._CALLS) == 1
    fresh = make_args(spec, seed=2, **extra)  # same signature, other values and buffers
    hit = fresh.call(tileq.gemm, backend="triton")
    assert len(api._CALLS) == 1
    api.clear_call_cache()
    miss = fresh.call(tileq.gemm, backend="triton")
    assert torch.equal(hit, miss)
    check_close(hit, fresh.call(tileq.gemm, backend="reference"), spec.out_dtype)


def test_hit_redoes_value_dependent_conversions():
    """bf16 scales and bias are upcast, Python-float scales made into tensors on every call."""
    spec = family_spec(parse_family("tensor_fp8xfp8_rcr_decode"), 3, 24, 32)
    args = make_args(spec, seed=3)
    bias = torch.randn(24).to(torch.bfloat16)
    for sa, sb in [(0.5, 2.0), (0.25, 3.0)]:
        got = tileq.gemm(args.a, args.b, sa, sb, scheme="tensor", bias=bias, backend="triton")
        want = tileq.gemm(args.a, args.b, sa, sb, scheme="tensor", bias=bias, backend="reference")
        check_close(got, want, torch.bfloat16)
    assert len(api._CALLS) == 1
    spec = family_spec(parse_family("rowcol_fp8xfp8_rcr_decode"), 3, 24, 32)
    for seed in (4, 5):
        args = make_args(spec, seed=seed)
        args.a_scale, args.b_scale = args.a_scale.to(torch.bfloat16), args.b_scale.to(torch.float16)
        check_close(args.call(tileq.gemm, backend="triton"), args.call(tileq.gemm, backend="reference"),
                    torch.bfloat16)
    assert len(api._CALLS) == 2


def test_linear_hit_equals_miss():
    x, w, sx, sw = _fp8_linear_args()
    x3, sx3 = x.reshape(1, 3, 64), sx.reshape(1, 3, 1)
    out = torch.full((1, 3, 40), float("nan"), dtype=torch.bfloat16)
    for _ in range(2):
        y = tileq.linear(x3, w, sx3, sw, scheme="rowcol", backend="triton")
        got = tileq.linear(x3, w, sx3, sw, scheme="rowcol", backend="triton", out=out)
        assert got is out and y.shape == (1, 3, 40) and torch.equal(y, out)
    assert len(api._CALLS) == 2
    x2, w2, sx2, sw2 = _fp8_linear_args(seed=9)
    hit = tileq.linear(x2.reshape(1, 3, 64), w2, sx2.reshape(1, 3, 1), sw2, scheme="rowcol", backend="triton")
    api.clear_call_cache()
    miss = tileq.linear(x2.reshape(1, 3, 64), w2, sx2.reshape(1, 3, 1), sw2, scheme="rowcol", backend="triton")
    assert torch.equal(hit, miss)
    want = tileq.linear(x2, w2, sx2, sw2, scheme="rowcol", backend="reference")
    check_close(hit.reshape(3, 40), want, torch.bfloat16)


def test_linear_packed_int4_weight_hit():
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 256, generator=g) * 32).to(torch.float8_e4m3fn)
    sw = torch.rand(2, 16, generator=g) + 0.5  # [Gk, Gn] for N = 16, group_n = 1
    for seed in (1, 2):
        w = pack_int4(torch.randint(-8, 8, (16, 256), generator=torch.Generator().manual_seed(seed),
                                    dtype=torch.int8), dim=1)
        got = tileq.linear(x, w, None, sw, scheme="bquant", group_n=1, backend="triton")
        want = tileq.linear(x, w, None, sw, scheme="bquant", group_n=1, backend="reference")
        check_close(got, want, torch.bfloat16)
    assert len(api._CALLS) == 1


def test_empty_result_hit():
    x, w, sx, sw = _fp8_linear_args(m=0)
    for _ in range(2):
        y = tileq.gemm(x, w.t(), sx, sw, scheme="rowcol", backend="triton")
        assert y.shape == (0, 40) and y.dtype == torch.bfloat16
    out = torch.empty(0, 40, dtype=torch.bfloat16)
    for _ in range(2):
        assert tileq.gemm(x, w.t(), sx, sw, scheme="rowcol", backend="triton", out=out) is out
    assert len(api._CALLS) == 2


def test_int4_word_path_decided_per_call(monkeypatch):
    """The word path needs an even int4 address: a hit with the storage at an odd address (same
    shape and strides) must take the byte path."""
    real = launch._gemm_kernel
    seen = []

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append(kwargs["I4_WORDS"])
                return real[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(launch, "_gemm_kernel", Spy())
    spec = family_spec(parse_family("bquant_fp8xi4_rcr_decode"), 5, 40, 256, out_dtype=torch.float32)
    args = make_args(spec, seed=3)
    check_close(args.call(tileq.gemm, backend="triton"), args.call(tileq.gemm, backend="reference"),
                torch.float32)
    w = args.b
    rows = w.data.t()
    shifted = torch.empty(rows.numel() + 1, dtype=torch.uint8)[1:].view(rows.shape)
    shifted.copy_(rows)
    assert shifted.data_ptr() % 2 == 1 and shifted.t().stride() == w.data.stride()
    args.b = PackedInt4(shifted.t(), w.shape, w.packed_dim)
    check_close(args.call(tileq.gemm, backend="triton"), args.call(tileq.gemm, backend="reference"),
                torch.float32)
    assert len(api._CALLS) == 1  # the second call was a hit
    assert seen[0] != seen[1] and seen[1] is False


# ---- what changes the signature -----------------------------------------------------------------


def test_signature_changes_miss(recorder):
    x, w, sx, sw = _fp8_linear_args()
    b = w.t()

    def call(a=x, bb=b, sa=sx, sb=sw, **kw):
        kw.setdefault("backend", "triton")
        return tileq.gemm(a, bb, sa, sb, scheme=kw.pop("scheme", "rowcol"), **kw)

    call()
    padded = torch.zeros(3, 80, dtype=torch.float8_e4m3fn)[:, :64]
    padded.copy_(x)
    variants = [
        dict(a=padded),  # a stride
        dict(a=x[:2], sa=sx[:2]),  # shape
        dict(bb=w.t().contiguous()),  # b layout
        dict(sa=sx.reshape(3, 1)),  # scale shape
        dict(sa=sx.to(torch.bfloat16)),  # scale dtype
        dict(sb=1.5),  # scalar scale
        dict(out_dtype=torch.float32),
        dict(fast_accum=True),
        dict(pipeline="prefill"),
        dict(bias=torch.zeros(40)),
        dict(out=torch.empty(3, 40, dtype=torch.bfloat16)),
        dict(out=torch.empty(3, 48, dtype=torch.bfloat16)[:, :40]),  # out stride
    ]
    for i, v in enumerate(variants, 2):
        call(**v)
        assert len(api._CALLS) == i, v
        call(**v)
        assert len(api._CALLS) == i, v
    lda = [c[1][12] for c in recorder.calls]  # klda (after 9 pointers, M, N, K): the padded a has leading dim 80
    assert 80 in lda and 64 in lda


def test_environment_is_part_of_the_signature(recorder, monkeypatch):
    x, w, sx, sw = _fp8_linear_args()
    tileq.gemm(x, w.t(), sx, sw, scheme="rowcol")  # auto on CPU: the reference, not cached
    assert len(api._CALLS) == 0
    monkeypatch.setenv("TILEQ_BACKEND", "triton")
    tileq.gemm(x, w.t(), sx, sw, scheme="rowcol")
    assert len(api._CALLS) == 1 and len(recorder.calls) == 1
    monkeypatch.setenv("TILEQ_BACKEND", "fast")
    with pytest.raises(UnsupportedError, match="TILEQ_BACKEND"):
        tileq.gemm(x, w.t(), sx, sw, scheme="rowcol")
    monkeypatch.setenv("TILEQ_BACKEND", "reference")
    tileq.gemm(x, w.t(), sx, sw, scheme="rowcol")
    assert len(recorder.calls) == 1


def test_reference_executor_is_not_cached():
    x, w, sx, sw = _fp8_linear_args()
    for _ in range(2):
        tileq.gemm(x, w.t(), sx, sw, scheme="rowcol", backend="reference")
    assert len(api._CALLS) == 0


# ---- errors are unchanged after a valid call ----------------------------------------------------


def _error(fn):
    try:
        fn()
    except TileqError as e:
        return type(e), str(e)
    raise AssertionError("no error raised")


def test_errors_after_a_valid_call(recorder):
    x, w, sx, sw = _fp8_linear_args()
    b = w.t()
    bad = {
        "a_scale shape": lambda: tileq.gemm(x, b, torch.ones(3, 2), sw, scheme="rowcol", backend="triton"),
        "b_scale dtype": lambda: tileq.gemm(x, b, sx, sw.double(), scheme="rowcol", backend="triton"),
        "group_k float": lambda: tileq.gemm(x, b, sx, sw, scheme="rowcol", group_k=128.0, backend="triton"),
        "scheme": lambda: tileq.gemm(x, b, sx, sw, scheme="rowcolumn", backend="triton"),
        "out dtype": lambda: tileq.gemm(x, b, sx, sw, scheme="rowcol", backend="triton",
                                        out=torch.empty(3, 40, dtype=torch.float16)),
        "out layout": lambda: tileq.gemm(x, b, sx, sw, scheme="rowcol", backend="triton",
                                         out=torch.empty(40, 3, dtype=torch.bfloat16).t()),
        "a layout": lambda: tileq.gemm(torch.empty(3, 128, dtype=x.dtype)[:, ::2], b, sx, sw,
                                       scheme="rowcol", backend="triton"),
        "bias shape": lambda: tileq.gemm(x, b, sx, sw, scheme="rowcol", backend="triton",
                                         bias=torch.zeros(41)),
        "pipeline": lambda: tileq.gemm(x, b, sx, sw, scheme="rowcol", pipeline="fast", backend="triton"),
        "backend": lambda: tileq.gemm(x, b, sx, sw, scheme="rowcol", backend="cuda"),
        "scale type": lambda: tileq.gemm(x, b, [1.0], sw, scheme="rowcol", backend="triton"),
        "unhashable scheme": lambda: tileq.gemm(x, b, sx, sw, scheme=["rowcol"], backend="triton"),
        "linear w": lambda: tileq.linear(x, w[0], sx, sw, scheme="rowcol", backend="triton"),
        "linear x_scale": lambda: tileq.linear(x.reshape(1, 3, 64), w, torch.ones(1, 2, 1), sw,
                                               scheme="rowcol", backend="triton"),
    }
    before = {name: _error(fn) for name, fn in bad.items()}
    tileq.gemm(x, b, sx, sw, scheme="rowcol", backend="triton")
    tileq.gemm(x, b, sx, sw, scheme="rowcol", backend="triton", out=torch.empty(3, 40, dtype=torch.bfloat16))
    tileq.gemm(x, b, sx, sw, scheme="rowcol", backend="triton", bias=torch.zeros(40))
    tileq.linear(x, w, sx, sw, scheme="rowcol", backend="triton")
    tileq.linear(x.reshape(1, 3, 64), w, sx.reshape(1, 3, 1), sw, scheme="rowcol", backend="triton")
    assert len(api._CALLS) == 5
    after = {name: _error(fn) for name, fn in bad.items()}
    assert after == before
    assert before["a_scale shape"][0] is ShapeError and before["b_scale dtype"][0] is DTypeError
    assert before["out layout"][0] is LayoutError and before["group_k float"][0] is ShapeError
    assert len(api._CALLS) == 5  # failed calls remember nothing


# ---- bounded --------------------------------------------------------------------------------------


def test_cache_is_bounded(recorder, monkeypatch):
    from tileq.problem import build_problem

    validations = []

    def counting(*args, **kwargs):
        validations.append(1)
        return build_problem(*args, **kwargs)

    monkeypatch.setattr(api, "build_problem", counting)
    monkeypatch.setattr(api, "CALL_CACHE_SIZE", 4)
    x, w, sx, sw = _fp8_linear_args(m=9)
    for m in range(1, 10):
        tileq.gemm(x[:m], w.t(), sx[:m], sw, scheme="rowcol", backend="triton")
        assert len(api._CALLS) <= 4
    assert len(validations) == 9
    tileq.gemm(x[:9], w.t(), sx[:9], sw, scheme="rowcol", backend="triton")  # newest: a hit
    assert len(validations) == 9
    tileq.gemm(x[:1], w.t(), sx[:1], sw, scheme="rowcol", backend="triton")  # evicted: a miss
    assert len(validations) == 10
    assert len(api._CALLS) == 4 and len(recorder.calls) == 11


def test_launch_tables_are_bounded(monkeypatch):
    monkeypatch.setattr(direct, "_TABLE_CAP", 3)
    table = {}
    for i in range(10):
        direct._bounded_put(table, i, i)
    assert list(table) == [7, 8, 9]


# ---- the direct launch, against a stand-in compiled kernel ---------------------------------------


class _FakeCompiled:
    def __init__(self):
        self.function, self.packed_metadata, self.launches, self.metadata_calls = 7, (4, 1, 0), [], []

    def run(self, *args):
        self.launches.append(args)

    def launch_metadata(self, grid, stream, *args):
        self.metadata_calls.append((grid, stream, args))
        return {"name": "fake"}


class _FakeJIT:
    """A JITFunction stand-in with the real kernel's parameters: its launch returns one compiled
    kernel per specialization key it is given, as JITFunction.run returns its cache entry."""

    def __init__(self, real_fn):
        from triton.runtime.jit import JITFunction

        self.params = JITFunction(real_fn).params
        self.signature = inspect.signature(real_fn)
        self.pre_run_hooks, self.used_global_vals = [], {}
        self.jit_calls, self.compiled = [], _FakeCompiled()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled

        return run


@pytest.fixture
def fake_triton(monkeypatch):
    from triton import knobs
    from triton.knobs import HookChain

    fake = _FakeJIT(launch._gemm_kernel.fn)
    monkeypatch.setattr(launch, "_gemm_kernel", fake)
    monkeypatch.setattr(direct, "_TRITON", dict(
        knobs=knobs, CompiledKernel=_FakeCompiled, HookChain=HookChain, JITFunction=_FakeJIT,
        jit_types=(_FakeJIT,),
        device=lambda: 0, stream=lambda device: 1234,
    ))
    monkeypatch.setattr(direct, "_HANDLES", {})
    monkeypatch.delenv("TILEQ_DIRECT_LAUNCH", raising=False)
    return fake


def _gemm_launch(family="rowcol_fp8xfp8_rcr_decode", m=3, n=40, k=64, seed=0):
    from tileq.dispatch.plan import make_plan
    from tileq.problem import build_problem

    spec = family_spec(parse_family(family), m, n, k)
    args = make_args(spec, seed=seed, bias=True)
    problem = args.call(build_problem)
    gl = launch.GemmLaunch(problem, make_plan(problem.spec, problem.device, backend="triton"))
    assert gl.direct is False  # CPU tensors: never direct
    gl.direct = True  # what a CUDA problem would have
    out = torch.empty(m, n, dtype=spec.out_dtype)  # the same output object on every launch
    tensors = (problem.a, problem.b, problem.a_scale, problem.b_scale, problem.bias, None, out)
    return gl, tensors


def test_direct_launch_mirrors_jit_run(fake_triton):
    gl, tensors = _gemm_launch()
    gl(*tensors)
    assert len(fake_triton.jit_calls) == 1 and not fake_triton.compiled.launches
    grid, args, kwargs = fake_triton.jit_calls[0]
    gl(*tensors)
    assert len(fake_triton.jit_calls) == 1 and len(fake_triton.compiled.launches) == 1
    launched = fake_triton.compiled.launches[0]
    # JITFunction.run: run(grid0, grid1, grid2, stream, function, packed_metadata, launch_metadata,
    # enter_hook, exit_hook, *every bound argument in parameter order, constexprs included).
    assert launched[:9] == (grid[0], grid[1], 1, 1234, 7, (4, 1, 0), None, None, None)
    consts = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    bound = fake_triton.signature.bind(*args, **consts)
    bound.apply_defaults()
    assert len(launched[9:]) == len(bound.arguments)
    for got, want in zip(launched[9:], bound.arguments.values()):
        assert got is want or got == want


def test_direct_launch_keys_on_pointer_alignment(fake_triton):
    gl, tensors = _gemm_launch()
    gl(*tensors)
    gl(*tensors)
    a = tensors[0]
    shifted = torch.empty(a.numel() + 1, dtype=a.dtype)[1:].view(a.shape)  # 1-byte offset
    shifted.copy_(a)
    gl(shifted, *tensors[1:])  # another specialization: through the JIT launch again
    assert len(fake_triton.jit_calls) == 2 and len(fake_triton.compiled.launches) == 1
    gl(shifted, *tensors[1:])
    assert len(fake_triton.compiled.launches) == 2


def test_direct_launch_passes_hooks_and_metadata(fake_triton):
    from triton import knobs

    seen = []
    gl, tensors = _gemm_launch()
    gl(*tensors)
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        gl(*tensors)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    launched = fake_triton.compiled.launches[-1]
    assert launched[6] == {"name": "fake"}
    assert launched[7] is knobs.runtime.launch_enter_hook and launched[8] is knobs.runtime.launch_exit_hook
    grid, stream, args = fake_triton.compiled.metadata_calls[0]
    assert stream == 1234 and args == launched[9:]


def test_direct_launch_switched_off(fake_triton, monkeypatch):
    monkeypatch.setenv("TILEQ_DIRECT_LAUNCH", "0")
    gl, tensors = _gemm_launch()
    for _ in range(3):
        gl(*tensors)
    assert len(fake_triton.jit_calls) == 3 and not fake_triton.compiled.launches
    assert direct.direct_launch_enabled() is False
    monkeypatch.setenv("TILEQ_DIRECT_LAUNCH", "1")
    assert direct.direct_launch_enabled() is True


def test_direct_launch_split_k_and_swapped(fake_triton, monkeypatch):
    from dataclasses import replace

    from tileq.dispatch.plan import make_plan, with_config
    from tileq.problem import build_problem

    reduce_fake = _FakeJIT(split_k._split_reduce_kernel.fn)
    monkeypatch.setattr(split_k, "_split_reduce_kernel", reduce_fake)
    ws = torch.empty(1 << 16)
    monkeypatch.setattr(buffers, "_stream_workspace", lambda device, numel: ws)
    # (a prefill split: a decode split sums in the kernel, test_decode_split_sums_in_the_kernel)
    spec = family_spec(parse_family("bquant_fp8xi4_rcr_prefill"), 80, 64, 512)
    problem = make_args(spec, seed=5).call(build_problem)
    base = make_plan(problem.spec, problem.device, backend="triton")
    cfg = replace(base.config, swap_ab=True, split_k=2, block_m=64, block_n=16, num_warps=4)
    gl = launch.GemmLaunch(problem, with_config(base, cfg))
    gl.direct = True
    out = torch.empty(80, 64, dtype=spec.out_dtype)
    tensors = (problem.a, problem.b.data, problem.a_scale, problem.b_scale, None, None, out)
    gl(*tensors)
    gl(*tensors)
    assert len(fake_triton.jit_calls) == 1 and len(fake_triton.compiled.launches) == 1
    assert len(reduce_fake.jit_calls) == 1 and len(reduce_fake.compiled.launches) == 1
    _, args, _ = fake_triton.jit_calls[0]
    assert args[0] is tensors[1] and args[1] is tensors[0]  # swapped: B plays the kernel's A
    red = reduce_fake.compiled.launches[0]
    bound = reduce_fake.signature.bind(*reduce_fake.jit_calls[0][1], SPLIT_K=2, LAYOUT="flat",
                                       BLOCK=split_k.REDUCE_BLOCK, BM=1, BN=1, GROUP_M=1, TRANS=True, PDL=False)
    assert red[9:] == tuple(bound.arguments.values())


def test_static_ids_share_handles_and_separate_dtypes(fake_triton):
    """Two launches of the same statics share compiled-kernel handles (plan.execute prepares a
    GemmLaunch per call); an output dtype, which no constexpr carries, separates them."""
    gl, tensors = _gemm_launch()
    again, _ = _gemm_launch()
    assert again.main.sid == gl.main.sid
    gl(*tensors)
    again(*tensors)
    assert len(fake_triton.jit_calls) == 1 and len(fake_triton.compiled.launches) == 1

    from tileq.dispatch.plan import make_plan
    from tileq.problem import build_problem

    spec = family_spec(parse_family("rowcol_fp8xfp8_rcr_decode"), 3, 40, 64)
    sids = set()
    for out_dtype in (torch.bfloat16, torch.float16):
        problem = make_args(spec, seed=0, bias=True).call(build_problem, out_dtype=out_dtype)
        sids.add(launch.GemmLaunch(problem, make_plan(problem.spec, problem.device, backend="triton")).main.sid)
    assert len(sids) == 2


def test_forward_quantized_keeps_a_launch_for_any_leading_shape(monkeypatch):
    """The fused decoder hands QuantLinear.forward_quantized q in x's shape ([batch, seq, K]) with
    one scale per flattened row: its per-signature launch serves such calls too, bit for bit the
    public path's, in x's leading shape (the Triton executor, interpreted here)."""
    import tileq

    monkeypatch.setenv("TILEQ_BACKEND", "triton")
    from tileq.activation import add_rmsnorm_quantize

    lin = torch.nn.Linear(256, 64).to(torch.bfloat16)
    ql = tileq.nn.QuantLinear.from_linear(lin, tileq.nn.A8W8Config())
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    q, s, _ = add_rmsnorm_quantize(x, None, torch.ones(256, dtype=torch.bfloat16), 1e-6, "int8")
    assert q.dim() == 3 and s.dim() == 1
    want = tileq.linear(q, ql.weight, s, ql.weight_scale, scheme="rowcol", out_dtype=torch.bfloat16, bias=ql.bias)
    first = ql.forward_quantized(q, s, torch.bfloat16)  # the public path; keeps the launch
    assert len(ql._runners) == 1
    again = ql.forward_quantized(q, s, torch.bfloat16)  # the kept launch
    assert first.shape == again.shape == (2, 3, 64)
    assert torch.equal(first, want) and torch.equal(again, want)


def test_forward_quantized_honours_switches_changed_later(monkeypatch):
    """A kept launch of forward_quantized belongs to the switches it was planned under: after
    TILEQ_BACKEND changes, the next call plans again (here: the reference executor)."""
    import tileq
    import tileq.nn.linear as nl

    monkeypatch.setenv("TILEQ_BACKEND", "triton")
    lin = torch.nn.Linear(256, 64).to(torch.bfloat16)
    ql = tileq.nn.QuantLinear.from_linear(lin, tileq.nn.A8W8Config())
    q, s = tileq.quantize_activation(torch.randn(4, 256, dtype=torch.bfloat16), "int8")
    ql.forward_quantized(q, s, torch.bfloat16)
    ql.forward_quantized(q, s, torch.bfloat16)
    planned = []
    monkeypatch.setattr(nl, "linear", lambda *a, _f=nl.linear, **k: planned.append(k.get("scheme")) or _f(*a, **k))
    ql.forward_quantized(q, s, torch.bfloat16)  # the kept launch
    assert planned == []
    monkeypatch.setenv("TILEQ_BACKEND", "reference")
    ql.forward_quantized(q, s, torch.bfloat16)
    assert planned == ["rowcol"]
