"""Inductor's compilation of N A8W8 QuantLinear calls (M = 1, K = N = 5120) on a CPU, with and
without tileq's cache of torch's kernel-write analysis (kernels/direct.py), sm_90 code generated
without a GPU as tests/test_inline.py does (its tracing harness is reused from that file).

    PYTHONPATH=src python scripts/compile_time_cpu.py [calls] [repeats] > out.csv

Prints CSV rows: variant, calls, repeat, seconds, generated code characters.
"""
import pathlib
import sys
import time

src = (pathlib.Path(__file__).resolve().parents[1] / "tests" / "test_inline.py").read_text()
body = src.split("_TRACE = r'''")[1].split("'''")[0]
harness = body.split("out = {}")[0] + "import types" + body.split("import types", 1)[1].split("inductor = {}")[0]
exec(harness)  # noqa: S102 - the test's own harness: fake H200, sm_90 Triton driver, inductor_code()

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
bf16 = torch.bfloat16  # noqa: F821 (from the harness)
ql = QuantLinear.from_linear(torch.nn.Linear(5120, 5120, bias=False).to(bf16), A8W8Config())  # noqa: F821
key = ql.spec.key
shapes = [((1, 5120), bf16), (tuple(ql.weight.shape), ql.weight.dtype), (tuple(ql.weight_scale.shape), torch.float32)]


def chain(x, w, s):
    for _ in range(calls):
        x = quant_linear_op(x, w, s, None, None, key)  # noqa: F821
    return x


cached = direct._cache_kernel_analysis  # noqa: F821
direct._cache_kernel_analysis = lambda: None  # noqa: F821
inductor_code(chain, *shapes)  # noqa: F821 - warm-up (imports, first compilations), not timed
print("variant,calls,repeat,seconds,code_chars")
for variant in ("no_cache", "cache"):
    if variant == "no_cache":
        direct._cache_kernel_analysis = lambda: None  # noqa: F821
    else:
        direct._cache_kernel_analysis = cached  # noqa: F821
    for r in range(repeats):
        t0 = time.perf_counter()
        code = inductor_code(chain, *shapes)  # noqa: F821
        print(f"{variant},{calls},{r},{time.perf_counter() - t0:.2f},{len(code)}", flush=True)
