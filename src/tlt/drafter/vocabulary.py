"""The draft vocabulary: the tokens a drafter can propose, a subset of the target's (EAGLE-3's reduced head).

The drafter's head is the target's lm_head restricted to these rows. Over SmolLM2's 49,152 tokens the full head
(28M multiply-adds per token) is ~7x the rest of the drafter. With 8,192 rows, measured side by side on 2 CPU threads
(benchmarks/draft_vocab.py): a spot-training step is 4.0x cheaper (the target's distribution and the drafter's are
both computed over the draft vocabulary), drafting 3.2x, a whole SD step at batch 1 1.65x.
The price is the target's probability mass outside it, which no rule can ever accept. Measured on 4,113 positions
of fresh T=1 responses of SmolLM2 on the built-in task (docs/architecture.md, "A drafter from scratch"): 8.0% for a
vocabulary made before any response exists (the task prompts' tokens, topped up with the lowest ids: byte-level
BPE numbers its merges in the order it learned them, the most frequent first), 8.1% for the lowest 8,192 ids
alone; the warm-up's vocabulary, the most frequent tokens of its own responses: 3.5% (docs/benchmarks.md).
"""

from __future__ import annotations

from collections import Counter

import torch

DEFAULT_DRAFT_VOCAB = 8192  # a new drafter's output vocabulary


def limits_vocab(draft_vocab: int, vocab_size: int) -> bool:
    """Whether a draft vocabulary of `draft_vocab` tokens restricts the drafter (0 or >= the vocabulary: the full
    one)."""
    return 0 < draft_vocab < vocab_size


def frequent_tokens(sequences: list[list[int]], count: int, vocab_size: int, always=()) -> torch.Tensor:
    """The `count` most frequent ids (ties: lower id first), topped up with the lowest unused ids, sorted.
    `always`: ids that are in it whatever their frequency (the stop tokens: a drafter that cannot propose the
    end of a response drafts past it every time)."""
    # ints: a 0-d tensor hashes by identity (every occurrence its own key); ids outside the vocabulary are the
    # engine's to refuse, naming the prompt, not a reason to fail here
    frequency = Counter(t for sequence in sequences for t in map(int, sequence) if 0 <= t < vocab_size)
    forced = list(dict.fromkeys(int(t) for t in always if 0 <= int(t) < vocab_size))[:count]
    by_frequency = [token for token, _ in sorted(frequency.items(), key=lambda kv: (-kv[1], kv[0]))]
    ranked = list(dict.fromkeys(forced + by_frequency))[:count]
    used = set(ranked)
    ranked += [t for t in range(vocab_size) if t not in used][:count - len(ranked)]
    return torch.tensor(sorted(ranked))
