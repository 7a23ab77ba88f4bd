"""Runs vLLM's own serving benchmark client (what `vllm bench serve` runs) inside the peers' vLLM
environment, as a script of that environment's interpreter: it imports nothing of vmesh. The
CPU wheel's `vllm` console script fails on its distribution name, so the client's module is
called directly. Arguments are `vllm bench serve`'s."""

from __future__ import annotations

import sys


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as run
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    run(parser.parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
