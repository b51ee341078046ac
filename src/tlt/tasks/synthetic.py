"""A synthetic task for tiny random models: learning curves in seconds, with no text and no tokenizer files.

Prompts are random token ids; the reward is the share of a target token in the response, which a two-layer random
Llama learns within a few dozen GRPO steps. Tests and benchmarks/lossless_curves.py use it to show learning.
"""

from __future__ import annotations

import torch

from tlt.tasks.example import TaskExample


class IdTokenizer:
    """Decodes token ids to space-separated numbers: enough for rewards that read the ids back."""

    def __init__(self, pad_token_id: int = 0, eos_token_id: int = 3):
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(i) for i in ids)


class TargetTokenTask:
    """Prompts of `prompt_length` ids drawn from [low, vocab_size); the answer is the target token."""

    def __init__(self, target: int = 5, vocab_size: int = 16, prompt_length: int = 4, low: int = 6):
        self.target, self.vocab_size, self.prompt_length, self.low = target, vocab_size, prompt_length, low

    def sample(self, count: int, seed: int) -> list[TaskExample]:
        generator = torch.Generator().manual_seed(seed)
        return [TaskExample(f"p{i}", str(self.target), {"ids": torch.randint(
                    self.low, self.vocab_size, (self.prompt_length,), generator=generator).tolist()})
                for i in range(count)]

    def prompt_ids(self, example: TaskExample) -> list[int]:
        return example.meta["ids"]


def share_of_target(completion: str, example: TaskExample) -> float:
    """The reward: the fraction of response tokens equal to the example's answer token."""
    tokens = completion.split()
    return sum(t == example.answer for t in tokens) / max(1, len(tokens))
