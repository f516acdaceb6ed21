"""The ``tileq`` command: list, build, explain, selftest, tune, bench, replay, overhead, e2e, layerbench, demo,
sass."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tileq", description="Quantized GEMMs with fused dequantization.")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import commands

    commands.register(sub)
    from .tune import register_cli as register_tune

    register_tune(sub)
    from .bench.cli import register_cli as register_bench
    from .bench.e2e import register_cli as register_e2e
    from .bench.layers import register_cli as register_layers
    from .bench.overhead import register_cli as register_overhead
    from .bench.replay import register_cli as register_replay
    from .demo import register_cli as register_demo
    from .sass import register_cli as register_sass

    register_demo(sub)
    register_bench(sub)
    register_replay(sub)
    register_overhead(sub)
    register_e2e(sub)
    register_layers(sub)
    register_sass(sub)
    args = parser.parse_args(argv)
    from .errors import TileqError

    try:
        return int(args.func(args) or 0)
    except TileqError as e:
        print(f"tileq {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
