"""The ``tileq`` command: list, build, explain, selftest, tune, demo, bench, replay, overhead, e2e,
layerbench, moebench, tpbench, loadbench, sass.

Every parser is defined in a module that imports no torch, Triton or kernel module (tileq.commands,
tileq.bench.cli, tileq.demo, tileq.sass), so ``tileq --help`` and ``tileq COMMAND --help`` answer at
once; a command imports what it needs when it runs (tests/test_cli.py times it).

A refused argument or a tileq error ends the command with one line naming the problem, last on the
output, and exit status 2 (``tileq explain: error: argument --m: expected a positive integer, got
0``); other exceptions are bugs and keep their traceback.
"""

from __future__ import annotations

import argparse
import os
import sys


# The commands whose modules import torch at import time: their code, imported when they run.
def _tune(args) -> int:
    from .tune import run

    return run(args)


def _replay(args) -> int:
    from .bench.replay import run_replay

    return run_replay(args)


def _overhead(args) -> int:
    from .bench.overhead import run

    return run(args)


def _e2e(args) -> int:
    from .bench.e2e import run

    return run(args)


def _layerbench(args) -> int:
    from .bench.layers import run

    return run(args)


def _tpbench(args) -> int:
    from .bench.tp import run

    return run(args)


def _moebench(args) -> int:
    from .bench.moe import run

    return run(args)


def _loadbench(args) -> int:
    from .bench.load import run

    return run(args)


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        from .version import report

        print(report())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand and its options."""
    from . import commands, demo, sass
    from .bench import cli as bench_cli

    parser = argparse.ArgumentParser(prog="tileq", description="Quantized GEMMs with fused dequantization.")
    parser.add_argument("--version", action=_Version, help="tileq's version and its dependencies' against the "
                                                           "tested ranges, then exit")
    sub = parser.add_subparsers(dest="command", required=True)
    commands.register(sub)  # list, build, explain, selftest
    commands.add_tune(sub).set_defaults(func=_tune)
    demo.register_cli(sub)
    bench_cli.register_cli(sub)
    bench_cli.add_replay(sub).set_defaults(func=_replay)
    bench_cli.add_overhead(sub).set_defaults(func=_overhead)
    bench_cli.add_e2e(sub).set_defaults(func=_e2e)
    bench_cli.add_layerbench(sub).set_defaults(func=_layerbench)
    bench_cli.add_moebench(sub).set_defaults(func=_moebench)
    bench_cli.add_tpbench(sub).set_defaults(func=_tpbench)
    bench_cli.add_loadbench(sub).set_defaults(func=_loadbench)
    sass.register_cli(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0), or a refused argument: argparse printed it last (2)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    from .errors import TileqError

    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader went away (| head): no error of ours, and nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (TileqError, OSError) as e:  # user input (arguments, files, the environment), not a bug
        sys.stdout.flush()  # (what the command printed comes before the error, also in one log)
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"tileq {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
