"""Host cost of one quantized layer call on a GPU: microseconds per eager call (back-to-back
calls, no synchronization), the device time of the same loop, and the kernel time alone under
CUDA-graph replay, for nn.Linear in bf16 and a QuantLinear per config; then cProfile of the
slowest configs' eager calls. Usage: PYTHONPATH=src python3 scripts/host_cost.py [M ...]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

import torch

import tileq
from tileq.bench.overhead import _device_us_per_call, _graph_us_per_call, host_us_per_call
from tileq.nn import QuantLinear, config_from_name

CONFIGS = tuple(os.environ.get("HOST_COST_CONFIGS", "A8W8,FP8Row,FP8Block,W8A16,W4A16,W4A8").split(","))
PROFILES = int(os.environ.get("HOST_COST_PROFILES", "2"))


def main(ms) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lin = torch.nn.Linear(5120, 5120, bias=False, device=dev, dtype=torch.bfloat16)
    layers = {"nn.Linear bf16": lin}
    layers.update({c: QuantLinear.from_linear(lin, config_from_name(c)) for c in CONFIGS})
    print(f"{'layer':<16} {'M':>5} {'host us':>8} {'eager us':>9} {'graph us':>9}   parts (host us)")
    worst = []
    with torch.inference_mode():
        for m in ms:
            x = torch.randn(m, 5120, device=dev, dtype=torch.bfloat16)
            for name, layer in layers.items():
                fn = lambda layer=layer: layer(x)  # noqa: E731
                host = host_us_per_call(fn, 500)
                parts = ""
                if isinstance(layer, QuantLinear) and layer.config.act_dtype is not None:
                    c = layer.config
                    q, s = tileq.quantize_activation(x, c.act_dtype, granularity=c.act_granularity, group_k=c.group_k)
                    hq = host_us_per_call(lambda: tileq.quantize_activation(
                        x, c.act_dtype, granularity=c.act_granularity, group_k=c.group_k), 500)
                    hg = host_us_per_call(lambda: tileq.linear(
                        q, layer._weight_operand(), s, layer.weight_scale, scheme=c.scheme, group_k=c.group_k,
                        group_n=c.group_n), 500)
                    parts = f"quantize {hq:.1f}, linear {hg:.1f}"
                print(f"{name:<16} {m:>5} {host:>8.1f} {_device_us_per_call(fn, 300):>9.1f} "
                      f"{_graph_us_per_call(fn, 300):>9.1f}   {parts}", flush=True)
                worst.append((host, name, m, fn))
    worst.sort(key=lambda t: -t[0])
    for host, name, m, fn in worst[:PROFILES]:
        prof = cProfile.Profile()
        with torch.inference_mode():
            prof.enable()
            for _ in range(1000):
                fn()
            prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        print(f"\n== cProfile: {name} M={m}, 1000 calls ({host:.1f} us/call)\n" + buf.getvalue()[-3500:])


if __name__ == "__main__":
    main([int(v) for v in sys.argv[1:]] or [1, 512])
