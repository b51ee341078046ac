"""Sampling settings, the processed distribution (temperature → top-k → top-p), and seeded per-sample draws.

Every row carries its own settings and its own random stream, so a sample's tokens do not depend on which
other samples share its batch, and a seeded rollout is reproducible. Speculative decoding applies exactly the
same `processed_logprobs` to the target's logits, which is what makes its acceptance rule lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tlt.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    temperature: 0 = greedy (argmax; log-probs are then reported under the temperature-1 distribution).
    top_k: keep the k most probable tokens (0 = off). top_p: keep the smallest set of most probable tokens
    whose mass reaches top_p (1 = off). max_new_tokens: hard cap on the response length.
    stop_token_ids: tokens that end the response (included in it); None = the model's EOS tokens.
    seed: seeds this request's per-sample random streams; None = drawn from torch's global generator.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RowSampling:
    """Per-row settings of a batch as tensors [B] (built once per batch composition)."""

    temperature: torch.Tensor  # float; greedy rows hold 1.0 (their log-probs use the untempered distribution)
    top_k: torch.Tensor        # long; 0 = off
    top_p: torch.Tensor        # float; 1 = off
    greedy: torch.Tensor       # bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], device) -> "RowSampling":
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        return cls(torch.tensor(temps, device=device, dtype=torch.float32),
                   torch.tensor([p.top_k for p in params], device=device, dtype=torch.long),
                   torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32),
                   torch.tensor([p.greedy for p in params], device=device, dtype=torch.bool))

    def select(self, rows: torch.Tensor) -> "RowSampling":
        return RowSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.greedy[rows])


def processed_logprobs(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Log-probabilities of the processed distribution; logits [B, ..., V] with per-row settings [B].

    Order as in transformers and vLLM: temperature, then top-k, then top-p. Removed tokens get -inf.
    """
    batch, vocab = logits.shape[0], logits.shape[-1]
    extra = (1,) * (logits.dim() - 2)
    scaled = logits.float() / rows.temperature.view(batch, *extra, 1)
    use_top_k = bool((rows.top_k > 0).any())
    use_top_p = bool((rows.top_p < 1).any())
    if use_top_k or use_top_p:
        scaled = _filter_top_k_top_p(scaled, rows, extra, vocab, use_top_k, use_top_p)
    return torch.log_softmax(scaled, dim=-1)


def _filter_top_k_top_p(scaled, rows: RowSampling, extra, vocab: int, use_top_k: bool, use_top_p: bool):
    batch = scaled.shape[0]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_top_k:
        k = torch.where(rows.top_k > 0, rows.top_k, vocab).view(batch, *extra, 1)
        # Ties with the k-th value stay in, as in transformers' TopKLogitsWarper.
        kth = sorted_logits.gather(-1, (k - 1).expand(*sorted_logits.shape[:-1], 1))
        remove |= sorted_logits < kth
    if use_top_p:
        probs = torch.softmax(sorted_logits.masked_fill(remove, -math.inf), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more probable tokens
        remove |= (mass_before >= rows.top_p.view(batch, *extra, 1)) & (rank > 0)
    return scaled.scatter(-1, order, sorted_logits.masked_fill(remove, -math.inf))


def sample_from_logprobs(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of logprobs [B, V] from uniforms [B] in [0, 1).

    A token whose probability is 0 owns an empty interval and can never be drawn.
    """
    cdf = logprobs.double().exp().cumsum(dim=-1)
    target = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=logprobs.shape[-1] - 1)[:, 0]


def sample_next(logits: torch.Tensor, rows: RowSampling, uniforms: torch.Tensor):
    """Pick one token per row from logits [B, V]; returns (tokens [B], their processed log-probs [B])."""
    logprobs = processed_logprobs(logits, rows)
    tokens = sample_from_logprobs(logprobs, uniforms)
    if bool(rows.greedy.any()):
        tokens = torch.where(rows.greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def sample_generator(seed: int | None, request_index: int, sample_index: int) -> torch.Generator:
    """A CPU generator for one sample, derived from its request's seed (or the global torch RNG)."""
    if seed is None:
        base = int(torch.randint(0, 2**62, (1,)).item())
    else:
        base = (int(seed) * 1_000_003 + request_index) * 1_000_033 + sample_index
    generator = torch.Generator(device="cpu")
    generator.manual_seed(base % (2**63 - 1))
    return generator


def draw_uniforms(generators: list[torch.Generator], count: int = 1) -> torch.Tensor:
    """[B, count] uniforms, row b drawn from generators[b] (CPU; moved to the device by the caller)."""
    return torch.stack([torch.rand(count, generator=g) for g in generators])
