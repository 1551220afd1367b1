"""tokencache_routing's commands, each a module of tools/.

usage: python -m tokencache_routing COMMAND [--help | ARGS]

    bench         serving benchmark of routed decode on the GPU clock (tools/bench.py)
    demo          routed generation on the bundled SmolLM2, offline (tools/demo.py)
    labels        divergence labels from the large model's greedy answers (tools/labels.py)
    train-router  the neural router trained on labelled features (tools/train_router.py)
    quality       escalated share against agreement with the large model (tools/quality.py)
    clock-check   the GPU clock priced against a GPU run's rows (tools/clock_check.py)

A command's module is imported only when it runs, so every --help works without torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

PROG = "python -m tokencache_routing"
COMMANDS = {
    "bench": "bench",
    "demo": "demo",
    "labels": "labels",
    "train-router": "train_router",
    "quality": "quality",
    "clock-check": "clock_check",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if not args or args[0] not in COMMANDS:
        got = f"unknown command {args[0]!r}" if args else "a command is required"
        print(f"usage: {PROG} COMMAND [--help | ARGS]\n{PROG}: error: {got}; one of: "
              f"{', '.join(COMMANDS)}", file=sys.stderr)  # fmt: skip
        return 2
    # argparse names the program after sys.argv[0]: each command's usage shows this line.
    sys.argv[0] = f"{PROG} {args[0]}"
    command = importlib.import_module(f".tools.{COMMANDS[args[0]]}", __package__)
    command.main(args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
