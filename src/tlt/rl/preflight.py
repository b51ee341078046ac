"""Checks of a run's input files before any worker starts: a missing model, task file or drafter (or a logger's
missing package) fails in a second with one line, instead of after a model load in every worker (or inside a Ray
actor)."""

from __future__ import annotations

import json
from pathlib import Path

from tlt.drafter.trainer import DrafterTrainer
from tlt.errors import RequestError
from tlt.metrics.logger import logger_names
from tlt.metrics.wandb_logger import check_wandb_installed
from tlt.models.drafter_layer import fits_target
from tlt.models.eagle import (CONFIG_FILE, WEIGHTS_FILE, DrafterError, drafter_inside, is_drafter_dir,
                              read_target_config)
from tlt.models.loading import ModelLoadError, check_model_path, is_default_source
from tlt.models.spec import context_note, context_positions
from tlt.rl.config_checks import BUILTIN_REWARDS
from tlt.rl.rewards import integer_text, load_reward_function
from tlt.tasks import DATASET_TASKS, DatasetError, dataset_fingerprint, load_task_examples

SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")


def preflight(config) -> dict | None:
    """Returns the dataset task's fingerprint (None for a generated task), which --resume compares."""
    model_path = None
    fingerprint = None
    if not is_default_source(config.model.path):
        model_path = check_model_path(config.model.path)
        _check_context(config, model_path)
    if config.task.name in DATASET_TASKS:
        examples = load_task_examples(config.task)
        needed = config.rollout.prompts_per_step + config.task.eval_size
        if len(examples) < needed:
            # the split may be what cut it down (task.split=train[:1]: QA)
            split = f" (task.split={config.task.split})" if config.task.name == "hf" else ""
            raise DatasetError(f"{config.task.path}{split} has {len(examples)} example(s), fewer than the "
                               f"{needed} one step needs (rollout.prompts_per_step + task.eval_size)")
        if config.task.reward == "integer":
            _check_integer_answers(examples)
        fingerprint = dataset_fingerprint(examples)
    if config.run.drafter:
        _check_drafter(Path(config.run.drafter), model_path)
    if "wandb" in logger_names(config.run):
        check_wandb_installed()
    if config.task.reward not in BUILTIN_REWARDS:
        load_reward_function(config.task.reward)  # a typo in the module path fails here, not in every worker
    return fingerprint


def _check_integer_answers(examples) -> None:
    """task.reward=integer compares integers (`integer_text`: 1,000 and 1000 are one): a record whose answer is not
    an integer could never be scored right (each of its correct-looking responses would raise in the reward and
    score 0)."""
    for example in examples:
        if integer_text(str(example.answer)) is None:  # as integer_match reads it
            where = ", ".join(f"{key} {value}" for key, value in example.meta.items() if key != "source")
            raise DatasetError(f"{example.meta.get('source', 'the dataset')}, {where}: answer {example.answer!r} is "
                               f"not an integer, which task.reward=integer needs (use task.reward=math_verify)")


def _check_context(config, model_path: Path) -> None:
    """A budget that fills the whole context leaves no room for any prompt (longer prompts are found by the
    engine, once the task has made them)."""
    if model_path.is_file():
        return  # a GGUF: its context is in the header, and the engine checks every request anyway
    settings = json.loads((model_path / "config.json").read_text())
    if not isinstance(settings.get("max_position_embeddings"), int):
        return
    context, budget = context_positions(settings), config.rollout.max_new_tokens
    if budget >= context:
        raise RequestError(f"rollout.max_new_tokens={budget} leaves no room for a prompt in the model's context "
                           f"of {context} tokens{context_note(settings)} ({model_path})")


def _head_dim(config: dict):
    """A config's head_dim, or hidden / heads where it does not say (transformers' default)."""
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if config.get("head_dim"):
        return config["head_dim"]
    return hidden // heads if isinstance(heads, int) and isinstance(hidden, int) and heads > 0 else None


def _check_drafter(directory: Path, model_path: Path | None) -> None:
    if not is_drafter_dir(directory):
        raise DrafterError(f"run.drafter={directory} is not a tlt drafter (needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
                           f"make one with `tlt drafter warmup`){drafter_inside(directory)}")
    if DrafterTrainer.has_saved_state(directory):
        DrafterTrainer.saved_state(directory)  # its optimizer state seeds spot training: damaged fails here
    if model_path is None or model_path.is_file():
        return  # the default model or a GGUF: its shapes are checked when the drafter attaches
    drafter = read_target_config(directory)  # a damaged drafter_config.json: its own DrafterFileError
    try:
        target = json.loads((model_path / "config.json").read_text())
    except (ValueError, KeyError, OSError) as error:
        raise ModelLoadError(f"cannot compare run.drafter with the model: {error}") from None
    different = [(k, drafter.get(k), target.get(k)) for k in SHAPE_KEYS if drafter.get(k) != target.get(k)]
    if not different and _head_dim(drafter) != _head_dim(target):  # Qwen3's is not hidden / heads
        different.append(("head_dim", _head_dim(drafter), _head_dim(target)))
    if not fits_target(drafter.get("model_type"), target.get("model_type")):  # its layer: the target's or Llama's
        different.append(("model_type", drafter.get("model_type"), target.get("model_type")))
    if different:
        raise DrafterError(f"run.drafter={directory} was made for another model: "
                           + ", ".join(f"{k} {ours} vs {theirs}" for k, ours, theirs in different))
