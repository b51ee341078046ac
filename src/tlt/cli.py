"""The `tlt` command line."""

from __future__ import annotations

import argparse
import sys

from tlt.errors import TltError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tlt", description="RL for reasoning LLMs with lossless speculative "
                                     "rollouts that tame the long tail.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="sample responses with the rollout engine"))
    _add_generate(commands.add_parser("demo", help="the default demo: a mixed-length rollout on SmolLM2"))
    args = parser.parse_args(argv)
    try:
        if args.command in ("generate", "demo"):
            from tlt.generate_cli import run_generate

            return run_generate(args, demo=args.command == "demo")
    except TltError as error:
        print(f"tlt: error: {error}", file=sys.stderr)
        return 2
    return 0


def _add_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="user messages (chat template applied); default: a mixed set")
    parser.add_argument("--model", default=None, help="HF model directory, .gguf file, or 'smollm2' (default)")
    parser.add_argument("-n", type=int, default=2, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=64)


if __name__ == "__main__":
    sys.exit(main())
