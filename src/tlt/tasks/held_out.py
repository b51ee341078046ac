"""A held-out evaluation set carved out of a task, never sampled for training.

Datasets: the last `size` examples are held out and training samples the rest, less any repeat of a held-out
prompt (a file with duplicates would train on them). The built-in arithmetic task
generates problems: the held-out set is drawn from its own seed, and training draws skip any problem whose
prompt is in it (redrawn from a derived seed), so the two stay disjoint either way.
"""

from __future__ import annotations

from tlt.errors import TltError
from tlt.tasks.example import TaskExample
from tlt.tasks.loaders import DatasetTask

EVAL_SEED = 2**31 - 19  # the held-out stream's seed, far from any step seed


def split_held_out(source, size: int) -> tuple[object, list[TaskExample]]:
    """(training source, held-out examples)."""
    if size <= 0:
        return source, []
    if isinstance(source, DatasetTask):
        if len(source.examples) <= size:
            raise TltError(f"task.eval_size={size} leaves no training examples out of {len(source.examples)}")
        held_out = source.examples[-size:]
        # a prompt the file repeats before its held-out tail would be trained on: drop those copies
        prompts = {e.prompt for e in held_out}
        training = [e for e in source.examples[:-size] if e.prompt not in prompts]
        if not training:
            raise TltError(f"task.eval_size={size}: every training example repeats a held-out prompt")
        return DatasetTask(training), held_out
    held_out = source.sample(size, seed=EVAL_SEED)
    return ExcludingTask(source, {e.prompt for e in held_out}), held_out


class ExcludingTask:
    """A generated task whose samples never repeat a held-out prompt."""

    def __init__(self, source, excluded: set[str]):
        self.source, self.excluded = source, excluded

    def sample(self, count: int, seed: int) -> list[TaskExample]:
        kept = [e for e in self.source.sample(count, seed) if e.prompt not in self.excluded]
        retry = 1
        while len(kept) < count:
            if retry > 100:
                raise TltError("cannot draw training problems outside the held-out set: raise the task's variety "
                               "or lower task.eval_size")
            extra = self.source.sample(count, seed=seed * 1_000_003 + retry)
            kept += [e for e in extra if e.prompt not in self.excluded][:count - len(kept)]
            retry += 1
        return kept
