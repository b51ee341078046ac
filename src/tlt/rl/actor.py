"""The actor's pass over rollout samples: per-token log-probs of the responses (and the drafter's features).

Log-probs for the PPO ratio are always recomputed here, by the training-mode transformers forward, never taken
from the rollout engine: speculative decoding can then never change what the policy is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedSamples:
    """Prompt + response sequences right-padded into one batch.

    input_ids, attention_mask: [B, L]; response_mask: [B, L - 1] marks the positions whose *next* token is a
    response token, i.e. where log p(token_{t+1} | prefix) is a policy log-prob of the response.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_lengths: list[int]
    response_lengths: list[int]

    @classmethod
    def build(cls, prompts: list[list[int]], responses: list[list[int]], pad_id: int, device=None) -> "PackedSamples":
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        width = max(lengths)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention = torch.zeros(len(prompts), width, dtype=torch.long)
        response = torch.zeros(len(prompts), width - 1, dtype=torch.bool)
        for row, (prompt, reply) in enumerate(zip(prompts, responses)):
            ids[row, :lengths[row]] = torch.tensor(list(prompt) + list(reply))
            attention[row, :lengths[row]] = 1
            response[row, len(prompt) - 1:lengths[row] - 1] = True
        return cls(ids.to(device), attention.to(device), response.to(device), [len(p) for p in prompts],
                   [len(r) for r in responses])

    def select(self, rows: list[int]) -> "PackedSamples":
        index = torch.tensor(rows, device=self.input_ids.device)
        width = max(self.prompt_lengths[r] + self.response_lengths[r] for r in rows)
        return PackedSamples(self.input_ids[index, :width], self.attention_mask[index, :width],
                             self.response_mask[index, :width - 1], [self.prompt_lengths[r] for r in rows],
                             [self.response_lengths[r] for r in rows])


@dataclass
class ActorOutput:
    logprobs: torch.Tensor        # [B, L - 1] log p(token_{t+1}); meaningful where response_mask is set
    hidden: torch.Tensor | None   # [B, L, H] final normed hidden states (the drafter's features), detached


def token_logprobs(model, batch: PackedSamples, temperature: float = 1.0, *, want_hidden: bool = False
                   ) -> ActorOutput:
    """Per-token log-probs of every next token under the policy at the rollout temperature.

    Top-k/top-p of the rollout are not applied: the policy being optimized is the tempered softmax, as in verl
    and TRL. Gradients flow when called with grad enabled.
    """
    # The decoder then the head, rather than output_hidden_states: no per-layer activations are kept, and the
    # final normed state is exactly the drafter's feature.
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 use_cache=False).last_hidden_state
    logits = model.get_output_embeddings()(hidden[:, :-1]).float()
    if temperature not in (0, 1):
        logits = logits / temperature
    targets = batch.input_ids[:, 1:]
    # log_softmax(x)[y] = x[y] - logsumexp(x): avoids materializing a second [B, L, V] tensor.
    logprobs = logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
    return ActorOutput(logprobs, hidden.detach() if want_hidden else None)
