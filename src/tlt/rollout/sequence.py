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
    # uniforms drawn from the generator ahead of use and given back unused (`BatchRows`): they come first
    spare_uniforms: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def take_uniforms(self, count: int) -> torch.Tensor:
        """[count] host uniforms: the next of this sample's stream (given-back spares first, then its generator)."""
        spare = self.spare_uniforms
        if spare is None:
            return torch.rand(count, generator=self.generator)
        if spare.shape[0] > count:
            self.spare_uniforms = spare[count:]
            return spare[:count]
        self.spare_uniforms = None
        if spare.shape[0] == count:
            return spare
        return torch.cat([spare, torch.rand(count - spare.shape[0], generator=self.generator)])

    def give_back_uniforms(self, unused: torch.Tensor) -> None:
        """Uniforms taken from this stream but not used: the next draw starts with them."""
        if unused.shape[0] == 0:
            return
        if self.spare_uniforms is not None:  # spares still held were drawn after the ones taken: they follow
            unused = torch.cat([unused, self.spare_uniforms])
        self.spare_uniforms = unused

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


def same_rows(a: list[Sequence], b: list[Sequence]) -> bool:
    """The same sequences in the same order (by identity: a step's rows are these objects)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
