"""W4A8 prefill on fp8 tensor cores: the prepacked int4 weight written once per call as fp8
values, then tileq's own fp8 GEMM with the weight's scales where the scheme applies them.

The weight's int4 values go to the activations' fp8 type alone (-8..7 are exact in e4m3 and in
e5m2: one byte per weight) and the scales stay in fp32 inside the GEMM, as the fused kernels
keep them:

- group scales ([K / group_k, N]): scheme bquant with b_scale groups of one column x group_k
  (``sa[m] * sum_g sb[g, n] * sum_{k in g} x * v``), which the sm_90 Gluon kernel runs swapped
  (the weight's rows on its 128-row side, their group scales per tile row);
- per-channel or per-tensor scales: scheme rowcol (``sa[m] * sb[n] * sum_k x * v``).

The activation scale is the per-token ([M]) or per-tensor one the call brought. The plan
(``tileq.dispatch.prepacked``, path ``fp8-gemm``) gives W4A8 prefill calls this path where the Gluon
prefill kernel does not take them, with the 8-bit GEMM's own plan (``dispatch.plan.make_plan``),
which this launcher runs as ``tileq.linear`` would: the same problem, plan and launch.
"""

from __future__ import annotations

import torch

from ..._runtime import bounded_put
from ...problem import build_problem
from ...reference import gemm_ref
from ..launch import launch_statement, make_launch
from .dequant import dequantize_prepacked

_LAUNCHES_PER_CALL = 16  # kept launches of the inner GEMM per launcher (one per tensor signature)


class Fp8PrefillLaunch:
    """The W4A8 prefill path for one call signature, called like ``launch.Int4pLaunch``:
    y = (x @ values(W)^T with the scales of the plan's scheme) + bias, cast, by the inner 8-bit
    GEMM's plan ``plan`` (its ``spec`` the problem of x [M, K], values(W)^T and the scales)."""

    name = "dequant-fp8+tileq"

    def __init__(self, n: int, k: int, w_kind: str, x_kind: str, group_k: int, out_dtype: torch.dtype,
                 x_dtype: torch.dtype, plan):
        if x_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or x_kind not in ("vector", "scalar"):
            raise ValueError(f"Fp8PrefillLaunch: fp8 activations with a per-token or per-tensor scale, "
                             f"not {x_dtype} / {x_kind}")
        self.n, self.k, self.w_kind, self.x_kind = n, k, w_kind, x_kind
        self.group_k, self.out_dtype, self.x_dtype = group_k, out_dtype, x_dtype
        self.plan = plan
        self.scheme = plan.spec.scheme.value  # bquant for group scales, rowcol for the others
        # ``direct``'s statements: the inner GEMM's launch, whose A (x) and B (the values) both
        # have rows of K elements
        self.untraced, self.counters = launch_statement(plan, k, k)
        # The inner GEMM's launch per signature of its tensors (as tileq.linear keeps one per call
        # signature): shapes, strides and dtypes, the bias's presence, the output's.
        self._launches: dict[tuple, object] = {}

    def __call__(self, x2, wdata, sx, sw, bias, out=None) -> torch.Tensor:
        values = dequantize_prepacked(wdata, self.n, self.k, None, "none", (0, 0), self.group_k, self.x_dtype)
        if self.scheme == "bquant":
            w_scale, group_n = sw, 1  # [K / group_k, N]: one column per group
        else:
            w_scale, group_n = sw.reshape(-1) if sw.numel() > 1 else sw.reshape(()), None
        x_scale = sx.reshape(-1) if self.x_kind == "vector" else sx.reshape(())
        b = values.t()
        key = (x2.shape, x2.stride(), x2.dtype, x_scale.shape, x_scale.stride(), w_scale.shape, w_scale.stride(),
               bias is None, None if out is None else (out.shape, out.stride()))
        launch = self._launches.get(key)
        if launch is not None:
            return launch(x2, b, x_scale, w_scale, bias, None, out)
        problem = build_problem(x2, b, x_scale, w_scale, scheme=self.scheme, out_dtype=self.out_dtype, bias=bias,
                                group_k=self.group_k, group_n=group_n, out=out)
        if problem.spec != self.plan.spec:
            raise RuntimeError(f"Fp8PrefillLaunch: the call's problem {problem.spec} is not the plan's {self.plan.spec}")
        if self.plan.executor == "reference":
            return gemm_ref(problem)
        launch = make_launch(problem, self.plan)
        bounded_put(self._launches, key, launch, _LAUNCHES_PER_CALL)
        return launch(problem.a, problem.b, problem.a_scale, problem.b_scale, problem.bias, problem.acc, problem.out)
