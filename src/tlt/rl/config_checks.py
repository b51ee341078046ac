"""The checks `load_config` runs on a `tlt train` config (rl/config.py): every choice and range, before anything
loads, each failure one ConfigError naming the key."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tlt.drafter.unroll import MAX_UNROLL
from tlt.errors import TltError
from tlt.files import is_utf8_text
from tlt.models.kernel_choice import KERNEL_CHOICES
from tlt.models.lean_forward import COMPILE_MODES
from tlt.rl.config_text import ConfigError
from tlt.rl.grpo import AGGREGATIONS, IMPORTANCE_LEVELS
from tlt.rl.optim import decay_steps
from tlt.sampling import MIN_TEMPERATURE
from tlt.speculative.strategy import SpecStrategy

if TYPE_CHECKING:
    from tlt.rl.config import GRPOConfig, OptimConfig, RolloutConfig, RunConfig, TaskConfig, TrainConfig

TASK_NAMES = ("arithmetic", "jsonl", "parquet", "hf")
SPECULATIVE_MODES = ("off", "static", "adaptive")
TAIL_TRAINING = ("auto", "on", "off")
BACKENDS = ("auto", "ray", "inprocess")
BUILTIN_REWARDS = ("auto", "integer", "math_verify")


ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")
ROLLOUT_COMPILE = ("off", *COMPILE_MODES)
SCHEDULES = ("constant", "cosine")
AUTOCAST_MODES = ("auto", "bf16", "off")
LOGGERS = ("jsonl", "tensorboard", "wandb")
ROLLOUT_IS_MODES = ("auto", "truncate", "off")


def filtered_sampling(rollout: RolloutConfig) -> bool:
    """Whether the rollout samples a top-k/top-p truncation of the tempered softmax the update trains."""
    return rollout.top_k > 0 or rollout.top_p < 1


def _check_device(device: str | None) -> None:
    """A device torch can parse (its availability is checked when the model loads): `gpu` was a traceback."""
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):  # `meta` or `mps` parse, then failed mid-rollout
        raise ConfigError(f"model.device must be cpu, cuda or cuda:N (or unset: CUDA when available), got "
                          f"{device!r}")


def validate(config: TrainConfig) -> TrainConfig:
    """Every choice and range, checked before anything loads; raises ConfigError naming the first bad key."""
    _check_values(config)
    _check_device(config.model.device)
    _check_task(config.task)
    _check_rollout(config.rollout)
    _check_grpo(config.grpo, config.rollout)
    _check_optim(config.optim, config.run.steps)
    _check_run(config.run, config.rollout)
    check_speculation(config.run)
    return config


def _check_values(config: TrainConfig) -> None:
    """Numbers finite: nan passes every range check (all its comparisons are false), inf many. Text UTF-8: a
    command line's undecodable bytes reach Python as lone surrogates, which trained a step in a run.out_dir
    that no save could then name in JSON (found by a trial), or failed in the chat template naming no key."""
    for section in dataclasses.fields(config):
        for item in dataclasses.fields(getattr(config, section.name)):
            value = getattr(getattr(config, section.name), item.name)
            key = f"{section.name}.{item.name}"
            _check(not isinstance(value, float) or math.isfinite(value), f"{key} must be a finite number, got {value}")
            for text in (value if isinstance(value, tuple) else (value,)):
                _check(not isinstance(text, str) or is_utf8_text(text), f"{key} is not UTF-8 text: {text!r}")


def _check_task(task: TaskConfig) -> None:
    check_choice("task.name", task.name, TASK_NAMES)
    _check(task.name == "arithmetic" or bool(task.path), f"task.name={task.name} needs task.path (a dataset file)")
    _check_task_keys_used(task)
    _check(task.reward in BUILTIN_REWARDS or ":" in task.reward or "." in task.reward,  # as the loader reads it
           f"task.reward must be one of {', '.join(BUILTIN_REWARDS)} or 'package.module:function', "
           f"got {task.reward!r}")
    # a negative bonus for an extractable answer would teach the policy not to answer
    _check(0 <= task.format_reward < math.inf, f"task.format_reward must be a finite number >= 0 (a bonus for an "
           f"extractable answer), got {task.format_reward}")
    _at_least("task.min_operations", task.min_operations, 1)
    _check(task.max_operations >= task.min_operations, f"task.max_operations must be >= task.min_operations, got "
           f"max {task.max_operations} < min {task.min_operations}")
    _at_least("task.eval_size", task.eval_size, 0)
    _at_least("task.eval_every", task.eval_every, 1)


def _check_rollout(rollout: RolloutConfig) -> None:
    _at_least("rollout.prompts_per_step", rollout.prompts_per_step, 1)
    _check(rollout.samples_per_prompt >= 2, f"rollout.samples_per_prompt must be >= 2, got "
           f"{rollout.samples_per_prompt}: GRPO compares the samples of one prompt (a group of 1 has no advantage)")
    _at_least("rollout.max_new_tokens", rollout.max_new_tokens, 1)
    _at_least("rollout.max_batch_size", rollout.max_batch_size, 1)
    _check(0 < rollout.temperature < float("inf"), f"rollout.temperature must be > 0, got {rollout.temperature}: "
           f"greedy samples of one prompt are identical, so every GRPO advantage would be 0")
    _check(rollout.temperature >= MIN_TEMPERATURE, f"rollout.temperature must be at least {MIN_TEMPERATURE}, got "
           f"{rollout.temperature}: logits divided by less overflow float32")
    _check(0 < rollout.top_p <= 1, f"rollout.top_p must be in (0, 1], got {rollout.top_p}")
    _at_least("rollout.top_k", rollout.top_k, 0)
    _check(rollout.top_k != 1, "rollout.top_k=1 samples greedily: the samples of one prompt are identical, so every "
           "GRPO advantage would be 0 (use 0 for no top-k, or at least 2)")
    check_choice("rollout.dtype", rollout.dtype, ROLLOUT_DTYPES)
    check_choice("rollout.compile", rollout.compile, ROLLOUT_COMPILE)
    check_choice("rollout.kernels", rollout.kernels, KERNEL_CHOICES)
    if rollout.compile != "off" and rollout.kernels == "triton":  # auto: torch's kernels under a compile
        raise ConfigError("rollout.compile and rollout.kernels=triton are alternatives (Inductor fuses its own "
                          "kernels): set one of them")
    if rollout.compile != "off" and not rollout.cuda_graphs:
        raise ConfigError("rollout.compile compiles the steps CUDA graphs capture: it needs rollout.cuda_graphs=true")


def _check_grpo(grpo: GRPOConfig, rollout: RolloutConfig) -> None:
    check_choice("grpo.loss", grpo.loss, tuple(AGGREGATIONS))
    check_choice("grpo.importance_level", grpo.importance_level, IMPORTANCE_LEVELS)
    _check(0 <= grpo.clip_low < 1, f"grpo.clip_low must be in [0, 1), got {grpo.clip_low}")
    _at_least("grpo.clip_high", grpo.clip_high, 0)
    _at_least("grpo.kl_coef", grpo.kl_coef, 0)
    _at_least("grpo.updates_per_step", grpo.updates_per_step, 1)
    _check(0 <= grpo.overlong_buffer <= rollout.max_new_tokens, f"grpo.overlong_buffer must be in [0, "
           f"rollout.max_new_tokens={rollout.max_new_tokens}], got {grpo.overlong_buffer}")
    _at_least("grpo.overlong_penalty", grpo.overlong_penalty, 0)
    check_choice("grpo.rollout_is", grpo.rollout_is, ROLLOUT_IS_MODES)
    _at_least("grpo.rollout_is_cap", grpo.rollout_is_cap, 1)
    _check(grpo.rollout_is != "truncate" or not filtered_sampling(rollout),
           f"grpo.rollout_is=truncate needs unfiltered sampling (rollout.top_k=0, rollout.top_p=1; got top_k="
           f"{rollout.top_k}, top_p={rollout.top_p}): the rollout's log-probs are then of the softmax the update "
           f"trains; with top-k/top-p they are of the truncated one")


def _check_optim(optim: OptimConfig, steps: int) -> None:
    _check(optim.lr > 0, f"optim.lr must be > 0, got {optim.lr}")
    _at_least("optim.weight_decay", optim.weight_decay, 0)
    _check(all(0 <= b < 1 for b in optim.betas), f"optim.betas must each be in [0, 1), got {list(optim.betas)}")
    _at_least("optim.micro_batch_size", optim.micro_batch_size, 1)
    _check(optim.micro_batch_tokens == "auto" or (isinstance(optim.micro_batch_tokens, int)
                                                  and not isinstance(optim.micro_batch_tokens, bool)
                                                  and optim.micro_batch_tokens >= 0),
           f"optim.micro_batch_tokens must be auto or an integer >= 0 (0 = off), got {optim.micro_batch_tokens!r}")
    _at_least("optim.grad_clip", optim.grad_clip, 0)
    check_choice("optim.schedule", optim.schedule, SCHEDULES)
    _at_least("optim.warmup_steps", optim.warmup_steps, 0)
    _at_least("optim.decay_steps", optim.decay_steps, 0)
    _check(0 <= optim.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
    horizon = decay_steps(optim, steps)
    _check(optim.schedule != "cosine" or optim.warmup_steps < max(horizon, 1),
           f"optim.warmup_steps={optim.warmup_steps} leaves no cosine decay within the {horizon} decay step(s) "
           f"({'optim.decay_steps' if optim.decay_steps else 'run.steps'}): lower it, or use optim.schedule=constant")
    check_choice("optim.autocast", optim.autocast, AUTOCAST_MODES)


def _check_run(run: RunConfig, rollout: RolloutConfig) -> None:
    _check(bool(run.out_dir.strip()), "run.out_dir must not be empty (it would be the current directory)")
    _check_not_a_shared_directory(run.out_dir)
    _check(-(2 ** 63) <= run.seed < 2 ** 63, f"run.seed must fit in 64 bits (what torch seeds with), got {run.seed}")
    check_choice("run.backend", run.backend, BACKENDS)
    _check(bool(run.logger), f"run.logger names no logger: use one or more of {', '.join(LOGGERS)}")
    for name in run.logger:
        check_choice("run.logger", name, LOGGERS)
    _check(bool(run.wandb_project.strip()), "run.wandb_project must not be empty")
    try:
        SpecStrategy.parse(run.strategy)
    except TltError as error:
        raise ConfigError(f"run.strategy: {error}") from None
    _check(run.gate == "auto" or (isinstance(run.gate, int) and run.gate >= 1),
           f"run.gate must be auto or an integer >= 1 (a batch size), got {run.gate!r}")
    _at_least("run.steps", run.steps, 1)  # 0 would train nothing and save the starting model as the final policy
    for key in ("checkpoint_every", "keep_checkpoints", "threads_per_worker"):
        _at_least(f"run.{key}", getattr(run, key), 0)
    _check(run.workers == "auto" or (isinstance(run.workers, int) and run.workers >= 1),
           f"run.workers must be an integer >= 1 (or auto), got {run.workers!r}")
    _check(0 < run.gpus_per_worker <= 1, f"run.gpus_per_worker must be in (0, 1] (0.5 puts two workers on each "
           f"GPU), got {run.gpus_per_worker}")
    for key in ("publish_every", "drafter_buffer_tokens"):
        _at_least(f"run.{key}", getattr(run, key), 1)
    # one sample's features (its response and the last prompt token) must fit: a longer one failed every drain,
    # and the drafter never trained
    _check(run.speculative == "off" or run.drafter_buffer_tokens > rollout.max_new_tokens,
           f"run.drafter_buffer_tokens={run.drafter_buffer_tokens} cannot hold one sample's features "
           f"(rollout.max_new_tokens={rollout.max_new_tokens} + 1 tokens): raise it")
    _at_least("run.swap_poll_s", run.swap_poll_s, 0)  # 0: check for a newer drafter before every decode step
    _check(run.drafter_lr > 0, f"run.drafter_lr must be > 0, got {run.drafter_lr}")
    _check(run.drafter_lr_ramp >= 0, f"run.drafter_lr_ramp must be >= 0, got {run.drafter_lr_ramp}")
    _check(isinstance(run.drafter_unroll, int) and 1 <= run.drafter_unroll <= MAX_UNROLL,
           f"run.drafter_unroll must be an integer from 1 to {MAX_UNROLL}, got {run.drafter_unroll!r}")
    _at_least("run.draft_vocab", run.draft_vocab, 0)
    if run.speculative != "off" and not run.drafter:  # a drafter from scratch drafts over it: every node's children
        widest = SpecStrategy.parse(run.strategy).branching
        if run.speculative == "adaptive":
            widest = max(widest, 3)  # its own arms branch up to 3
        _check(run.draft_vocab == 0 or run.draft_vocab >= widest, f"run.draft_vocab must be 0 (the whole "
               f"vocabulary) or at least {widest}, the most children a node drafts, got {run.draft_vocab}")
    _check(run.workers == "auto" or rollout.prompts_per_step >= run.workers, f"rollout.prompts_per_step="
           f"{rollout.prompts_per_step} is fewer than run.workers={run.workers}: every worker needs at least one "
           f"prompt")


def check_speculation(run: RunConfig) -> None:
    """A speculative mode needs a drafter: a warmed one, or one spot training teaches from scratch. Also called
    where the engine is built, for configs made in code without `validate`."""
    check_choice("run.speculative", run.speculative, SPECULATIVE_MODES)
    check_choice("run.tail_training", run.tail_training, TAIL_TRAINING)
    several = run.workers == "auto" or run.workers > 1  # auto: placement decides (distributed/placement.py)
    _check(run.speculative == "off" or bool(run.drafter) or
           (run.spot_training and (several or run.tail_training != "off")),
           f"run.speculative={run.speculative} needs run.drafter (make one with `tlt drafter warmup`) or spot "
           f"training to train one from scratch (run.spot_training=true, and with one worker run.tail_training "
           f"auto or on)")


def tail_training_active(run: RunConfig, workers: int) -> bool:
    """Whether a lone worker trains the drafter beside its own rollout's tail (drafter/tail_trainer.py). Only
    with one worker: with several, the workers idle in the tail train it (one trainer per step). "auto" and "on"
    agree on every device since 2026-11-25, when one worker became the CPU default too (its TLT-mode steps ran
    1.27x faster than two spot-training workers', mostly in the update: docs/benchmarks.md section 12); "auto"
    stays the default so that a device where it does not pay can be ruled out here."""
    if run.speculative == "off" or not run.spot_training or workers != 1:
        return False
    return run.tail_training != "off"


def _check_not_a_shared_directory(out_dir: str) -> None:
    """A run writes config.json, metrics.jsonl, step-*/, final/ and more at the top of run.out_dir, and
    --overwrite clears them: `/` and the home directory were accepted (found by QA), the run's files spread
    among the system's or the user's own."""
    path = Path(out_dir).expanduser().resolve()
    try:
        home = Path.home().resolve()
    except (RuntimeError, KeyError):  # no home directory known (no HOME, no passwd entry)
        home = None
    what = ("the filesystem root" if path == Path(path.anchor) else
            "your home directory" if path == home else None)
    _check(what is None, f"run.out_dir={out_dir} is {what}: a run writes its files at the top of its directory (and "
           f"--overwrite clears them); give it a directory of its own, e.g. {Path(out_dir) / 'runs' / 'my_run'}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_choice(key: str, value, choices: tuple) -> None:
    _check(value in choices, f"{key} must be one of {', '.join(choices)}, got {value!r}")


DATASET_KEYS = ("path", "split", "prompt_field", "answer_field")
ARITHMETIC_KEYS = ("min_operations", "max_operations")


def _check_task_keys_used(task: TaskConfig) -> None:
    """A key the chosen task ignores is a mistake that trains on the wrong data without a word (task.path with
    the default task.name=arithmetic ran the built-in task, and a missing file went unnoticed)."""
    defaults = type(task)()  # its section's defaults
    unused = DATASET_KEYS if task.name == "arithmetic" else ARITHMETIC_KEYS
    if task.name in ("jsonl", "parquet"):
        unused = unused + ("split",)  # a file is its own split
    given = [f"task.{key}" for key in unused if getattr(task, key) != getattr(defaults, key)]
    if given:
        hint = " (a dataset: task.name=jsonl, parquet or hf)" if task.name == "arithmetic" else ""
        raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set, but task.name="
                          f"{task.name} does not use {'it' if len(given) == 1 else 'them'}{hint}")


def _at_least(key: str, value, low) -> None:
    _check(value >= low, f"{key} must be >= {low}, got {value}")
