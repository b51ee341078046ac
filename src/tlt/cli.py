"""The `tlt` command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from tlt import __version__
from tlt.errors import TltError
from tlt.threads import add_threads
from tlt.verify_cli import add_verify, run_verify


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends an option's default to its help, unless the help already says it or there is none to say."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or "default" in text or _unstated(action.default):
            return text
        return f"{text} (default: %(default)s)".strip()


def _unstated(default) -> bool:
    """None, a store_true's False and SUPPRESS say nothing worth printing (0 does: `is`, not `==`)."""
    return default is None or default is False or default is argparse.SUPPRESS


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's --help shows the defaults, also for options declared without a help text. No
    abbreviated options: `--o` was --overwrite, which deletes a run (found by a trial)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if "help" not in kwargs and not _unstated(kwargs.get("default")):
            kwargs["help"] = "(default: %(default)s)"  # argparse prints nothing for an option without help
        return super().add_argument(*args, **kwargs)


def main(argv=None) -> int:
    parser = _Parser(prog="tlt", description="RL for reasoning LLMs with lossless speculative "
                     "rollouts that tame the long tail.")
    parser.add_argument("--version", action="version", version=f"tlt-rl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="sample responses with the rollout engine"))
    _add_generate(commands.add_parser("demo", help="the default demo: a mixed-length rollout on SmolLM2"))
    _add_train(commands.add_parser("train", help="GRPO training (no arguments: the embedded default run)"))
    drafter = commands.add_parser("drafter", help="drafter warm-up and export (EAGLE for vLLM / SGLang)")
    drafter = drafter.add_subparsers(dest="drafter_command", required=True)
    _add_warmup(drafter.add_parser("warmup", help="train a drafter on the target's own responses"))
    export = drafter.add_parser("export", help="write a drafter as an EAGLE draft model for vLLM / SGLang "
                                "(Llama, Qwen2 and Qwen3 targets: the engines' EAGLE loaders read Llama drafters)")
    export.add_argument("directory", help="a tlt drafter directory")
    export.add_argument("--format", choices=["eagle"], default="eagle")
    export.add_argument("--target", choices=["vllm", "sglang"], default="vllm")
    export.add_argument("--model", default=None, help="the target model the drafter was trained for: HF directory, "
                        ".gguf file, or 'smollm2' (default)")
    export.add_argument("--out", required=True)
    export.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                        help="of the written weights and config, and the printed serve command's (auto: what "
                        "--model's config.json names, bfloat16 where that is float32, as a training run's final "
                        "policy is, and for a .gguf and the default smollm2)")
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out (never a "
                        "model's files)")
    report = commands.add_parser("report", help="an HTML page with curves, tables and timelines for a run")
    report.add_argument("run_dir", help="a `tlt train` run directory (holds metrics.jsonl)")
    report.add_argument("--out", default=None, help="directory for index.html and its PNGs (default RUN_DIR/report)")
    add_verify(commands.add_parser("verify", help="statistical check that speculative decoding is lossless "
                                    "on your model and drafter"))
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":  # argparse stops collecting overrides at an option: `a=b --overwrite c=d`
        args.overrides += [item for item in extra if not item.startswith("-")]
        extra = [item for item in extra if item.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    signals = []  # the SIGTERMs received (a library on the way may turn the exception into a KeyboardInterrupt)
    try:
        with _signals_as_one_interrupt(signals):
            return _run_command(args)
    except TltError as error:
        print(f"tlt: error: {error}", file=sys.stderr)
        return 2
    except (OSError, _safetensors_error()) as error:
        # a full disk, a read-only mount or a missing permission met while a command writes its results (tlt
        # train says which checkpoint it kept; the other commands had only a traceback to say it)
        print(f"tlt: error: {_io_error_text(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was saved is said by the command; no traceback
        print("tlt: terminated (SIGTERM)" if signals else "tlt: interrupted", file=sys.stderr)
        return 143 if signals else 130


def _safetensors_error() -> type[Exception]:
    from safetensors import SafetensorError

    return SafetensorError


def _io_error_text(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{error.strerror}"
    return f"cannot write the results: {error}"


class Terminated(KeyboardInterrupt):
    """SIGTERM, what a scheduler (SLURM, Kubernetes) or `kill` sends: handled as Ctrl-C is, so a run says what it
    saved and an interrupted --overwrite puts the run it was replacing back, instead of dying without a word."""


@contextlib.contextmanager
def _signals_as_one_interrupt(received: list):
    """SIGTERM and Ctrl-C (SIGINT) raise one interrupt; the next one is ignored (said, with how to abort) while the
    command cleans up: saying what was saved, putting back a run --overwrite set aside (a second Ctrl-C used to
    cut that short, and the process died on an abort from a thread still running; found by QA). A third ends the
    process at once (exit 130): a clean-up can wait minutes for an in-process worker to finish its phase, and
    what it skips is safe (a checkpoint is renamed into place whole; a run set aside is put back by the next
    `tlt train` there). A signal the process inherited as ignored (`tlt train ... &` from a script) stays so."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    seen = []

    def interrupt(signum, frame):
        seen.append(signum)
        if len(seen) == 2:
            print("tlt: still stopping (saving what it has); interrupt once more to abort at once", file=sys.stderr,
                  flush=True)
        if len(seen) >= 3:
            print("tlt: aborted", file=sys.stderr, flush=True)
            os._exit(143 if signum == signal.SIGTERM else 130)
        if len(seen) > 1:
            return
        if signum == signal.SIGTERM:
            received.append(signum)
            raise Terminated()
        raise KeyboardInterrupt()

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGINT)
                if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _run_command(args) -> int:
    if args.command == "drafter":
        return _run_warmup(args) if args.drafter_command == "warmup" else _run_export(args)
    if args.command == "train":
        return _run_train(args)
    if args.command == "report":
        from tlt.report import write_report

        print(write_report(args.run_dir, args.out))
        return 0
    if args.command == "verify":
        return run_verify(args)
    if args.command in ("generate", "demo"):
        from tlt.generate_cli import run_generate

        return run_generate(args, demo=args.command == "demo")
    return 0


def _add_train(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="YAML file with [model], [task], [rollout], "
                        "[grpo], [optim], [run] sections (default: the embedded default; see examples/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. rollout.max_new_tokens=128")
    parser.add_argument("--config", dest="config_file", metavar="FILE", default=None, action="append",
                        help="the YAML file, as an option (then every positional argument is an override)")
    parser.add_argument("--print-config", action="store_true", help="print the full resolved config (defaults, "
                        "file, overrides) as YAML and exit, without loading a model")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run.out_dir")
    parser.add_argument("--overwrite", action="store_true", help="start a new run in run.out_dir even if it holds "
                        "one (deletes that run's checkpoints, metrics, timeline, TensorBoard and wandb logs, "
                        "final policy and tlt report's pages)")


def _run_train(args) -> int:
    from tlt.rl.config import ConfigError, config_yaml, load_config

    positional = ([args.config] if args.config is not None else []) + list(args.overrides)
    if args.config_file is not None:
        if len(args.config_file) > 1:  # the last one alone was read (found by a trial)
            raise ConfigError(f"--config given {len(args.config_file)} times ({', '.join(args.config_file)}): "
                              f"give one YAML file, and further settings as section.key=value overrides")
        config_path, overrides = args.config_file[0], positional
    elif positional and "=" not in positional[0]:
        config_path, overrides = positional[0], positional[1:]
    else:  # `tlt train key=value ...` without a file
        config_path, overrides = None, positional
    stray = [item for item in overrides if "=" not in item]
    if stray:
        where = f"the config file is {config_path}" if config_path else "a config file goes first, or after --config"
        raise ConfigError(f"{stray[0]!r} is not a section.key=value override ({where})")
    config = load_config(config_path, overrides)
    if args.print_config:
        print(config_yaml(config), end="")
        return 0
    from tlt.distributed.run import train

    train(config, resume=args.resume, overwrite=args.overwrite)
    return 0


def _add_warmup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory, .gguf file, or 'smollm2' (default)")
    parser.add_argument("--data", default="arithmetic", help="'arithmetic' (built-in) or a .jsonl/.parquet file "
                        "with a 'question' field (answers are not needed)")
    parser.add_argument("--config", default=None, metavar="FILE", help="a `tlt train` config: its task (dataset, "
                        "fields, split, system prompt) and model, so the drafter learns the very prompts the run "
                        "will see (instead of --data)")
    parser.add_argument("--out", required=True, help="directory for the drafter")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts on which the trained "
                        "drafter's τ is measured by speculative decoding at batch 1 (0: not measured, a quicker "
                        "warm-up)")
    parser.add_argument("--draft-vocab", type=int, default=None, help="the drafter's output vocabulary: the most "
                        "frequent tokens of the sampled responses (0, or at least the model's: the full vocabulary; "
                        "default: 8192 for a new drafter, the --init drafter's own)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ce-weight", type=float, default=0.1, help="weight of the soft cross-entropy to the "
                        "target's token distribution (beside the feature loss of weight 1)")
    parser.add_argument("--unroll", type=int, default=1, help="drafting levels trained per pair: 1 = teacher "
                        "forcing on the target's features; more also feeds the drafter its own, as its deeper drafts "
                        "are (each level costs about one more pass)")
    parser.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                        help="cosine: decay to 10%% of --lr over --steps")
    parser.add_argument("--init", default=None, metavar="DIR", help="go on training this drafter (its weights, "
                        "draft vocabulary and optimizer state) instead of a new one")
    parser.add_argument("--seed", type=int, default=0, help="which prompts are drawn (go on from --init with "
                        "another seed for new prompts)")
    parser.add_argument("--overwrite", action="store_true", help="replace a drafter already in --out")


def _run_warmup(args) -> int:
    from tlt.drafter.trainer import DrafterTrainConfig
    from tlt.drafter.unroll import MAX_UNROLL
    from tlt.drafter.warmup import WarmupConfig, check_enough_examples, check_warmup, warmup
    from tlt.models import load_model
    from tlt.tasks import ArithmeticTask, ChatTask, DatasetTask, load_examples

    config = WarmupConfig(prompts=args.prompts, steps=args.steps, max_new_tokens=args.max_new_tokens,
                          eval_prompts=args.eval_prompts, draft_vocab=args.draft_vocab, seed=args.seed,
                          init=args.init, lr_schedule=args.lr_schedule)
    if not 1 <= args.unroll <= MAX_UNROLL:
        raise TltError(f"--unroll must be from 1 to {MAX_UNROLL}, got {args.unroll}")
    train_config = DrafterTrainConfig(lr=args.lr, ce_weight=args.ce_weight, temperature=config.temperature,
                                      unroll=args.unroll)
    check_warmup(args.out, config, train_config, args.overwrite)  # before the model loads
    if args.config is not None:
        return _warmup_from_run_config(args, config, train_config)
    # prompts only: a warm-up samples responses and never scores them (a file without answers was refused: QA)
    source = ArithmeticTask() if args.data == "arithmetic" else DatasetTask(load_examples(args.data,
                                                                                          answer_field=None))
    check_enough_examples(source, config)
    loaded = load_model(args.model)
    warmup(loaded, ChatTask(source, loaded.tokenizer), args.out, config, train_config, overwrite=args.overwrite)
    return 0


def _warmup_from_run_config(args, config, train_config) -> int:
    """The warm-up's prompts as the run builds them: its dataset (or arithmetic task) with its fields, split,
    held-out set (never drawn) and system prompt, through the model's chat template."""
    from tlt.drafter.warmup import check_enough_examples, warmup
    from tlt.models import load_model
    from tlt.rl.config import load_config
    from tlt.tasks import DATASET_TASKS, DatasetTask, build_task, load_task_examples
    from tlt.tasks.held_out import split_held_out

    if args.data != "arithmetic":
        raise TltError("--data and --config both name the prompts: give one")
    run = load_config(args.config, [])
    if run.task.name in DATASET_TASKS:  # before the model loads: the run's training records, as it splits them
        training, _ = split_held_out(DatasetTask(load_task_examples(run.task)), run.task.eval_size)
        check_enough_examples(training, config)
    loaded = load_model(args.model or run.model.path)
    warmup(loaded, build_task(run.task, loaded.tokenizer), args.out, config, train_config, overwrite=args.overwrite)
    return 0


def _run_export(args) -> int:
    from tlt.drafter.export import (DTYPES, ExportError, auto_serving_dtype, check_export_out, check_exportable,
                                    export_eagle, export_notes, serve_command)
    from tlt.models import load_model
    from tlt.models.eagle import DrafterError, DrafterFileError, EagleDrafter, check_drafter_dir
    from tlt.models.default_model import default_model_dir
    from tlt.models.loading import is_default_source

    if Path(args.out).expanduser().resolve() == Path(args.directory).expanduser().resolve():
        raise ExportError(f"--out {args.out} is the drafter's own directory: the export would be mixed into it; "
                          f"choose another --out")
    check_export_out(args.out, args.overwrite)  # before the model loads
    check_drafter_dir(args.directory)
    check_exportable(args.directory)  # before the model loads
    loaded = load_model(args.model)
    try:
        drafter = EagleDrafter.load(args.directory, loaded.model)
    except DrafterError as error:
        if args.model is not None or isinstance(error, DrafterFileError):  # a damaged file: no model would help
            raise
        raise DrafterError(f"{error} (no --model: the default smollm2 was loaded; pass --model, the model the "
                           f"drafter was trained for)") from None
    default = is_default_source(args.model)
    dtype, lowered = auto_serving_dtype(None if default else loaded.source)
    if args.dtype != "auto":
        dtype, lowered = DTYPES[args.dtype], False
    out = export_eagle(drafter, args.out, args.target, args.overwrite, dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"wrote {out} ({args.target}, {dtype_name}); embed_tokens and lm_head stay with the target")
    for note in export_notes(drafter, args.target, default, lowered):
        print(f"note: {note}")
    # The default's served weights are the ones the drafter learned: tlt's dequantized GGUF, not the published
    # HuggingFaceTB/SmolLM2-135M-Instruct (quantization moved every weight; a drafter is accepted less there)
    model = default_model_dir() if default else args.model
    vocab = drafter.draft_to_target is not None
    print(f"serve: {serve_command(out, args.target, model, vocab, dtype_name)}")
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
    parser.add_argument("--drafter", default=None, help="a drafter directory (`tlt drafter warmup --out`): decode "
                        "with lossless speculative decoding, every token still a sample of the model")
    parser.add_argument("--strategy", default=None, help="with --drafter: depth S, branching K, tree size N "
                        "(target-only acceptance, e.g. S4K2N8), or S5K1q: q-sampling with the drafter's "
                        "probabilities (default with --drafter: S5K1q)")
    parser.add_argument("--gate", type=int, default=None, help="with --drafter: speculate only while at most "
                        "this many rows are running (the long tail, where it pays); a large number: at every step "
                        "(default with --drafter: 4)")
    parser.add_argument("--compile", default="off", choices=["off", "inductor", "max-autotune"],
                        help="on CUDA: Inductor-compile the steps the CUDA graphs replay (fewer, fused kernels; "
                        "the first steps pay the compile)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write every response in full (text, "
                        "token ids, log-probs, finish reason) and the run's numbers as JSON to OUT (the table shows "
                        "at most 300 characters of each)")
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"],
                        help="on CUDA: triton = fused Triton kernels (RoPE + KV write, attention, SiLU, sampling; "
                        "norms folded into the projections); an alternative to --compile. auto (default): triton "
                        "on CUDA unless --compile is set, torch's kernels on the CPU")
    add_threads(parser)




if __name__ == "__main__":
    sys.exit(main())
