"""Sequence: one sample in flight, the state the scheduler and the model runner share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tlt.errors import NonFiniteError
from tlt.rollout.request import Request, SampleOutput


@dataclass
class Sequence:
    """A sample in flight. Its cache row holds prompt + tokens[:-1]; tokens[-1] is the next input.

    Each sample draws its randomness from its own CPU generator, so batch composition never changes a stream."""

    request_index: int
    sample_index: int
    request: Request
    stop_ids: frozenset
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    drafter_versions: set = field(default_factory=set)

    def append(self, token: int, logprob: float) -> None:
        # A sampled token's log-prob is finite by construction (a token of probability 0 is never drawn), so a
        # NaN or inf one means the policy's logits were not finite: the token is garbage (greedy NaN rows pick
        # token 0), and the RL step would train on it. Checked here, on the host copy every step makes anyway.
        if not math.isfinite(logprob):
            raise NonFiniteError(
                f"the policy produced non-finite logits (the sampled token's log-prob is {logprob}) at request "
                f"{self.request_index}, sample {self.sample_index}, response token {len(self.tokens)}: its weights "
                f"or activations are NaN/inf (corrupt weights; a dtype that overflows, float16; or, in RL, a diverged "
                f"policy: lower optim.lr, and resume from a checkpoint from before it diverged)")
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.request.params.max_new_tokens:
            self.finish_reason = "length"

    def output(self) -> SampleOutput:
        return SampleOutput(self.request_index, self.sample_index, self.request.prompt_ids, self.tokens,
                            self.logprobs, self.finish_reason, tuple(sorted(self.drafter_versions)))
