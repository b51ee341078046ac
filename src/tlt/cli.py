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
    _add_train(commands.add_parser("train", help="GRPO training (no arguments: the embedded default run)"))
    drafter = commands.add_parser("drafter", help="drafter warm-up").add_subparsers(dest="drafter_command",
                                                                                 required=True)
    _add_warmup(drafter.add_parser("warmup", help="train a drafter on the target's own responses"))
    export = drafter.add_parser("export", help="write a drafter as an EAGLE draft model for vLLM / SGLang")
    export.add_argument("directory", help="a tlt drafter directory")
    export.add_argument("--format", choices=["eagle"], default="eagle")
    export.add_argument("--target", choices=["vllm", "sglang"], default="vllm")
    export.add_argument("--model", default=None, help="the target model the drafter was trained for")
    export.add_argument("--out", required=True)
    report = commands.add_parser("report", help="an HTML page with curves, tables and timelines for a run")
    report.add_argument("run_dir", help="a `tlt train` run directory (holds metrics.jsonl)")
    report.add_argument("--out", default=None, help="directory for index.html and its PNGs (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        if args.command == "drafter":
            return _run_warmup(args) if args.drafter_command == "warmup" else _run_export(args)
        if args.command == "train":
            from tlt.rl.config import load_config
            from tlt.rl.run import train

            config_path, overrides = args.config, list(args.overrides)
            if config_path is not None and "=" in config_path:  # `tlt train key=value ...` without a file
                config_path, overrides = None, [config_path] + overrides
            train(load_config(config_path, overrides), resume=args.resume)
            return 0
        if args.command == "report":
            from tlt.report import write_report

            print(write_report(args.run_dir, args.out))
            return 0
        if args.command in ("generate", "demo"):
            from tlt.generate_cli import run_generate

            return run_generate(args, demo=args.command == "demo")
    except TltError as error:
        print(f"tlt: error: {error}", file=sys.stderr)
        return 2
    return 0


def _add_train(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="YAML file with [model], [task], [rollout], "
                        "[grpo], [optim], [run] sections (default: the embedded default)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. rollout.max_new_tokens=128")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run.out_dir")


def _add_warmup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory, .gguf file, or 'smollm2' (default)")
    parser.add_argument("--data", default="arithmetic", help="'arithmetic' (built-in) or a .jsonl/.parquet file")
    parser.add_argument("--out", required=True, help="directory for the drafter")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="0 = full vocabulary")
    parser.add_argument("--lr", type=float, default=1e-3)


def _run_warmup(args) -> int:
    from tlt.drafter.trainer import DrafterTrainConfig
    from tlt.drafter.warmup import WarmupConfig, warmup
    from tlt.models import load_model
    from tlt.tasks import ArithmeticTask, ChatTask, DatasetTask, load_examples

    loaded = load_model(args.model)
    source = ArithmeticTask() if args.data == "arithmetic" else DatasetTask(load_examples(args.data))
    config = WarmupConfig(prompts=args.prompts, steps=args.steps, max_new_tokens=args.max_new_tokens,
                          draft_vocab=args.draft_vocab)
    warmup(loaded, ChatTask(source, loaded.tokenizer), args.out, config, DrafterTrainConfig(lr=args.lr))
    return 0


def _run_export(args) -> int:
    from tlt.drafter.export import export_eagle
    from tlt.models import load_model
    from tlt.models.eagle import EagleDrafter

    loaded = load_model(args.model)
    out = export_eagle(EagleDrafter.load(args.directory, loaded.model), args.out, args.target)
    print(f"wrote {out} ({args.target}); embed_tokens and lm_head stay with the target")
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
