"""The actor's pass over rollout samples: per-token log-probs of the responses (and the drafter's features).

Log-probs for the PPO ratio are always recomputed here, by the training-mode transformers forward, never taken
from the rollout engine: speculative decoding can then never change what the policy is trained on. (The
rollout's own log-probs only weight tokens where its numerics differ from this forward's: `grpo.rollout_is`.)

Only response positions get logits (a prompt or padding position's next-token distribution is never used), and
those go through the head in chunks of tokens (`ChunkedTokenLogprobs`): the [tokens, vocabulary] fp32 logits of a
micro-batch never exist at once, in the forward or in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_TOKENS = 256  # response tokens per head chunk: 256 x 49152 fp32 logits (SmolLM2) = 48 MiB at a time


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
    masked_rows: frozenset[int] = frozenset()  # rows none of whose response tokens is trained on (`mask_responses`)

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
                             [self.response_lengths[r] for r in rows],
                             frozenset(i for i, r in enumerate(rows) if r in self.masked_rows))

    def mask_responses(self, rows: list[int]) -> None:
        """Train on none of these rows' response tokens (grpo.mask_truncated): their response_mask rows are
        cleared, and `response_positions` leaves them out."""
        if rows:
            self.response_mask[torch.tensor(rows, device=self.response_mask.device)] = False
            self.masked_rows = self.masked_rows | frozenset(rows)

    def response_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) [N] of response_mask's set positions in its row-major order, made from the host
        lengths: indexing with a boolean mask reads its count back from the device (a sync on a GPU)."""
        counts = [0 if row in self.masked_rows else count for row, count in enumerate(self.response_lengths)]
        rows = [row for row, count in enumerate(counts) for _ in range(count)]
        columns = [column for prompt, count in zip(self.prompt_lengths, counts)
                   for column in range(prompt - 1, prompt - 1 + count)]
        device = self.response_mask.device
        return (torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True),
                torch.tensor(columns, dtype=torch.long).to(device, non_blocking=True))

    def feature_spans(self) -> tuple[list[int], list[int]]:
        """Per row, the [start, end) positions whose features the drafter trains on: the response plus the last
        prompt token, whose feature drafts the first response token."""
        starts = [p - 1 for p in self.prompt_lengths]
        ends = [p + r for p, r in zip(self.prompt_lengths, self.response_lengths)]
        return starts, ends


@dataclass
class ActorOutput:
    logprobs: torch.Tensor        # [B, L - 1] log p(token_{t+1}) where response_mask is set, 0 elsewhere
    hidden: torch.Tensor | None   # [B, L, H] final normed hidden states (the drafter's features), detached
    entropy: torch.Tensor | None = None  # [B, L - 1] the tempered softmax's entropy there (want_entropy), detached


def actor_hidden(model, batch: PackedSamples) -> torch.Tensor:
    """[B, L, H] final normed hidden states: the decoder alone, rather than output_hidden_states, so no
    per-layer activations are kept, and the final normed state is exactly the drafter's feature."""
    return model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               use_cache=False).last_hidden_state


def token_logprobs(model, batch: PackedSamples, temperature: float = 1.0, *, want_hidden: bool = False,
                   want_entropy: bool = False, chunk_tokens: int = CHUNK_TOKENS) -> ActorOutput:
    """Per-token log-probs of the response tokens under the policy at the rollout temperature.

    Top-k/top-p of the rollout are not applied: the policy being optimized is the tempered softmax, as in verl
    and TRL. Gradients flow when called with grad enabled.
    """
    hidden = actor_hidden(model, batch)
    mask = batch.response_mask
    # Pack the response positions: [N, H] states and the [N] tokens that follow them (indices from the host
    # lengths, so neither this nor the backward's scatter reads anything back from the device).
    rows, columns = batch.response_positions()
    states = hidden[rows, columns]
    targets = batch.input_ids[rows, columns + 1]
    head = model.get_output_embeddings()
    picked, entropy = ChunkedTokenLogprobs.apply(states, head.weight, getattr(head, "bias", None), targets,
                                                 float(temperature), chunk_tokens, want_entropy)
    logprobs = torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device).index_put((rows, columns), picked)
    if want_entropy:
        entropy = torch.zeros(mask.shape, dtype=entropy.dtype, device=entropy.device).index_put((rows, columns),
                                                                                                 entropy)
    return ActorOutput(logprobs, hidden.detach() if want_hidden else None, entropy if want_entropy else None)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(head(states) / T)[targets] for [N, H] states, `chunk` tokens at a time.

    Equal to the plain expression, but only one chunk's [chunk, V] fp32 logits exist at any time: the forward
    keeps just each token's logsumexp, and the backward recomputes a chunk's logits to form its gradient
    (d logp / d logits = (onehot(target) - softmax) / T) — one extra head matmul instead of keeping every
    token's logits from the forward to the backward. Returns (log-probs [N], entropy [N] of each token's tempered
    softmax, a metric without a gradient; empty unless `entropy`).
    """

    @staticmethod
    def forward(ctx, states, weight, bias, targets, temperature: float, chunk: int, entropy: bool = False):
        out = torch.empty(states.shape[0], dtype=_logit_dtype(weight), device=states.device)
        lse = torch.empty_like(out)
        entropies = torch.empty_like(out) if entropy else out.new_empty(0)
        for start in range(0, states.shape[0], max(1, chunk)):
            rows = slice(start, start + chunk)
            logits = _chunk_logits(states[rows], weight, bias, temperature)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            out[rows] = logits.gather(-1, targets[rows, None])[:, 0] - lse[rows]
            if entropy:  # H = lse - sum(softmax * logits)
                entropies[rows] = lse[rows] - (logits - lse[rows, None]).exp_().mul_(logits).sum(-1)
        ctx.save_for_backward(states, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk = temperature, max(1, chunk)
        ctx.mark_non_differentiable(entropies)
        return out, entropies

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        states, weight, bias, targets, lse = ctx.saved_tensors
        want_states, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_states = torch.empty_like(states) if want_states else None
        accumulate = {"dtype": lse.dtype, "device": weight.device}  # fp32 at least, whatever the model's dtype
        grad_weight = torch.zeros(weight.shape, **accumulate) if want_weight else None
        grad_bias = torch.zeros(bias.shape, **accumulate) if want_bias else None
        scale = 1.0 if ctx.temperature in (0.0, 1.0) else 1.0 / ctx.temperature
        for start in range(0, states.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = _chunk_logits(states[rows], weight, bias, ctx.temperature)  # the forward's, exactly
            # d out / d logits = onehot(target) - softmax, in place over this chunk's logits
            grad_logits = logits.sub_(lse[rows, None]).exp_().neg_()
            grad_logits.scatter_add_(-1, targets[rows, None], torch.ones_like(lse[rows, None]))
            grad_logits.mul_(grad_out[rows, None] * scale)
            if want_states:
                grad_states[rows] = (grad_logits.to(weight.dtype) @ weight).to(states.dtype)
            if want_weight:
                grad_weight.addmm_(grad_logits.t(), states[rows].to(lse.dtype))
            if want_bias:
                grad_bias += grad_logits.sum(0)
        return (grad_states, _cast(grad_weight, weight), _cast(grad_bias, bias), None, None, None, None)


def _chunk_logits(states, weight, bias, temperature: float) -> torch.Tensor:
    """Logits of one chunk in fp32 (or wider), tempered as the rollout samples them. The head runs in its
    weights' dtype whatever the caller's autocast: the rollout samples from an fp32 lm_head (models/rollout_copy)
    and the PPO ratio must compare log-probs of the same head (a bf16-autocast head put the per-token ratio
    ~1.9% off on average, 1.3% with it in fp32); and the backward, which runs outside the caller's autocast,
    recomputes exactly these logits (recomputed in fp32 against a bf16 forward's logsumexp, the gradients were
    ~12% off)."""
    with torch.autocast(states.device.type, enabled=False):
        logits = torch.nn.functional.linear(states.to(weight.dtype), weight, bias).to(_logit_dtype(weight))
    if temperature not in (0, 1):
        logits = logits / temperature
    return logits


def _logit_dtype(weight) -> torch.dtype:
    return torch.promote_types(weight.dtype, torch.float32)


def _cast(grad, like):
    return None if grad is None else grad.to(like.dtype)
