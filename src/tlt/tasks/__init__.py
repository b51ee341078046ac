"""Tasks: the built-in long-tail arithmetic task and JSONL/parquet/Hugging Face datasets, formatted with chat
templates."""

from __future__ import annotations

import hashlib

from tlt.errors import TltError
from tlt.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig
from tlt.tasks.chat import chat_prompt_ids
from tlt.tasks.example import TaskExample
from tlt.tasks.held_out import split_held_out
from tlt.tasks.hf import load_hf_examples
from tlt.tasks.loaders import DatasetError, DatasetTask, check_format, load_examples

DATASET_TASKS = ("jsonl", "parquet", "hf")


class ChatTask:
    """A task plus how its prompts become token ids (the chat template and optional system prompt)."""

    def __init__(self, source, tokenizer, system_prompt: str | None = None, eval_examples=()):
        self.source, self.tokenizer, self.system_prompt = source, tokenizer, system_prompt
        self.kind = "integer" if isinstance(source, ArithmeticTask) else "math"
        self.eval_examples = list(eval_examples)  # held out: never among `sample`'s draws

    def sample(self, count: int, seed: int) -> list[TaskExample]:
        return self.source.sample(count, seed)

    def prompt_ids(self, example: TaskExample) -> list[int]:
        return chat_prompt_ids(self.tokenizer, example.prompt, self.system_prompt)


def build_task(config, tokenizer) -> ChatTask:
    """From a `TaskConfig` (tlt.rl.config)."""
    if config.name == "arithmetic":
        source = ArithmeticTask(ArithmeticTaskConfig(min_operations=config.min_operations,
                                                     max_operations=config.max_operations))
    else:
        source = DatasetTask(load_task_examples(config))
    source, held_out = split_held_out(source, config.eval_size)
    return ChatTask(source, tokenizer, config.system_prompt, held_out)


def load_task_examples(config) -> list[TaskExample]:
    """The records of a dataset task (task.name jsonl, parquet or hf) from a `TaskConfig`."""
    if config.name not in DATASET_TASKS:
        raise TltError(f"unknown task.name {config.name!r}: use arithmetic, {', '.join(DATASET_TASKS)}")
    if not config.path:
        raise TltError(f"task.name={config.name} needs task.path")
    if config.name == "hf":
        return load_hf_examples(config.path, config.split, config.prompt_field, config.answer_field)
    check_format(config.name, config.path)
    return load_examples(config.path, config.prompt_field, config.answer_field)


def dataset_fingerprint(examples: list[TaskExample]) -> dict:
    """The records a dataset task read, as a count and a digest of their text: what `--resume` compares (the
    path alone misses records appended or edited in place)."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(example.prompt.encode() + b"\0" + example.answer.encode() + b"\0")
    return {"records": len(examples), "sha256": digest.hexdigest()}


__all__ = ["ArithmeticTask", "ArithmeticTaskConfig", "ChatTask", "DatasetError", "DatasetTask", "TaskExample",
           "build_task", "chat_prompt_ids", "dataset_fingerprint", "load_examples", "load_task_examples"]
