"""Training the drafter on its own predicted features, as it drafts (EAGLE-3's "training-time test").

A speculative step drafts depth 1 from the target's features and every deeper token from the drafter's own
output at the depth before. Trained on the target's features only (teacher forcing), the drafter never sees its
own, slightly-off features as input, and its deeper drafts are accepted less often than its first. Unrolled
training feeds them back: level 1 is the teacher-forced pass; level l at pair i takes the token x_{i+1} (the
true one: a chain is only worth anything while its tokens are accepted) with the level l - 1 output at pair
i - 1 instead of the target's f_i, and attends to what the engine's drafter cache holds at that depth:
  - level-1 keys (the catch-up pass over the target's features) up to pair i - l + 1, the last committed one;
  - at each level m = 2 .. l, the one key of the same chain: pair i - l + m.
Each level targets f_{i+1} and the target's token distribution there, like level 1. A level-l pair is scored
only when its chain's pairs i - l + 1 .. i are all of its document.

The levels run as one forward per level over the concatenation of levels 1 .. l (the drafter is one layer; the
earlier levels' keys are recomputed, identical): no cache interface of the layer's family is needed, every shape
is fixed (a CUDA graph captures it), and gradients flow through the fed-back features, as serving chains them.
"""

from __future__ import annotations

from typing import Iterator

import torch

# Level l's forward runs over l copies of the packed rows, so a step costs ~l(l + 1)/2 level-1 passes: 8 levels
# (36x) is past any draft depth the engine's arms use (<= 6).
MAX_UNROLL = 8


def unrolled_levels(drafter, batch, features: torch.Tensor, levels: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(level, the drafter's output ĥ [R, L, H] at every pair) for levels 1 .. `levels` of packed rows `batch`
    (PackedPairs), level 1 fed `features` (the target's, or with training noise)."""
    mask = level_mask(batch.attention_mask, levels) if levels > 1 else batch.attention_mask
    length = batch.valid.shape[1]
    inputs = [features]
    for level in range(1, levels + 1):
        span = level * length
        hidden = drafter(batch.input_tokens.repeat(1, level), torch.cat(inputs, dim=1),
                         batch.positions.repeat(1, level), mask[:, :span, :span])[:, -length:]
        yield level, hidden
        inputs.append(fed_back(hidden))


def level_mask(attention: torch.Tensor, levels: int) -> torch.Tensor:
    """[R, levels * L, levels * L] bool: what each level's pairs attend to (the module docstring), from the
    packed rows' block-diagonal causal mask [R, L, L] (same document, causal; padding sees itself)."""
    rows, length, _ = attention.shape
    device = attention.device
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    mask = torch.zeros(rows, levels * length, levels * length, dtype=torch.bool, device=device)
    for level in range(1, levels + 1):
        block_rows = slice((level - 1) * length, level * length)
        mask[:, block_rows, :length] = attention & (key <= query - (level - 1))
        for earlier in range(2, level + 1):
            own = key == query - (level - earlier)  # this chain's key at level `earlier`
            mask[:, block_rows, (earlier - 1) * length:earlier * length] = attention & own
    return mask


def level_valid(attention: torch.Tensor, valid: torch.Tensor, level: int) -> torch.Tensor:
    """[R, L] bool: pairs whose level-`level` chain lies in their document (pairs i - level + 1 .. i)."""
    if level == 1:
        return valid
    back = level - 1
    same_document = torch.diagonal(attention, offset=-back, dim1=1, dim2=2)  # [R, L - back]: mask[i, i - back]
    return valid & torch.nn.functional.pad(same_document, (back, 0), value=False)


def fed_back(hidden: torch.Tensor) -> torch.Tensor:
    """The features the next level takes: pair i gets the output at pair i - 1 (zeros at a row's first pair,
    which no scored chain reads)."""
    return torch.nn.functional.pad(hidden[:, :-1], (0, 0, 1, 0))
