"""Sampling settings, the processed distribution (temperature → top-k → top-p), and seeded per-sample draws.

Every row carries its own settings and its own random stream, so a sample's tokens do not depend on which
other samples share its batch, and a seeded rollout is reproducible, as long as each step is decoded the same
way: a speculative step draws other tokens than a plain one from the same uniforms (both exact samples), so a
batch-size gate or the adaptive bandit makes runs exact but not token-for-token repeatable. Speculative
decoding applies exactly the same `processed_logprobs` to the target's logits, which is what makes its acceptance
rule lossless: every emitted token is an exact sample of the verify forward's distribution. In fp32 that is the
plain step's distribution too; in bf16 a verify forward (several tokens per row) and a plain step (one) round
their GEMMs differently, so the two agree up to that rounding (docs/architecture.md, "Greedy identity in bf16").
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from tlt.errors import RequestError


MIN_TEMPERATURE = 1e-5  # the smallest temperature > 0 (vLLM treats smaller ones as greedy)


def is_integer(value) -> bool:
    """An int (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def token_ids(values, what: str) -> tuple[int, ...]:
    """A sequence of integral token ids as ints. A string is not one ("35" is not (3, 5)), nor is 5.7 a token id
    (it was truncated to 5); 0-d integer tensors and numpy integers are."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise RequestError(f"{what} must be a sequence of token ids, got {values!r}")
    ids = []
    for value in values:
        try:
            integral = not isinstance(value, (bool, str)) and int(value) == value
        except (TypeError, ValueError):
            integral = False
        if not integral:
            raise RequestError(f"{what} must hold integer token ids, got {value!r}")
        ids.append(int(value))
    return tuple(ids)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    temperature: 0 = greedy (argmax; log-probs are then reported under the temperature-1 distribution).
    top_k: keep the k most probable tokens (0 = off). top_p: keep the smallest set of most probable tokens
    whose mass reaches top_p (1 = off). max_new_tokens: hard cap on the response length.
    stop_token_ids: tokens that end the response (included in it); None = the model's EOS tokens.
    seed: seeds this request's per-sample random streams, together with the request's position in the list
        given to `generate()` and the sample's index (so two requests with one seed in one call differ; the same
        list gives the same samples whatever the batch size, unless a batch-size gate or an adaptive policy picks
        another decoding procedure per step: equal in law, not token for token); None = drawn from torch's global
        generator. Torch's CPU generator keeps 32 bits of the derived seed: seeds are distinct as long as their
        derived seeds differ modulo 2^32 (the derivation is linear, so consecutive seeds, requests and samples do).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None

    def __post_init__(self):
        if not (is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        object.__setattr__(self, "temperature", float(self.temperature))  # (a numpy float, too)
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / T can overflow float32 to inf: NaN log-probs
            raise RequestError(f"temperature must be 0 or at least {MIN_TEMPERATURE}, got {self.temperature!r} "
                               f"(sampling below it is greedy in all but name: use 0 for greedy decoding)")
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_p", float(self.top_p))
        if not (is_integer(self.top_k) and self.top_k >= 0):
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (is_integer(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not is_integer(self.seed):
            raise RequestError(f"seed must be an integer or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", token_ids(self.stop_token_ids, "stop_token_ids"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


TOP_K_CAP = 2**62


@dataclass
class RowSampling:
    """Per-row settings of a batch as tensors [B] (built once per batch composition).

    The flags say, from the host, which processing steps any row needs, so sampling never reads a device
    tensor to decide (no host sync inside a decode step). They may over-approximate (a subset of rows keeps
    its parent's flags): an unneeded step is a no-op, never a different result. sync_free: top-k/top-p find
    each row's kept set over the whole sorted vocabulary, reading nothing on the host (a CUDA graph's steps),
    instead of widening a candidate set until it holds the nucleus (cheaper on a CPU; same kept set)."""

    temperature: torch.Tensor  # float; greedy rows hold 1.0 (their log-probs use the untempered distribution)
    top_k: torch.Tensor        # long; 0 = off
    top_p: torch.Tensor        # float; 1 = off
    greedy: torch.Tensor       # bool
    any_tempered: bool | None = None   # some row's temperature is not 1
    any_filtered: bool | None = None   # some row uses top-k or top-p
    any_greedy: bool | None = None
    all_greedy: bool | None = None
    sync_free: bool = False

    def __post_init__(self):  # built from tensors alone: derive the flags once (one sync, outside any step)
        if self.any_tempered is None:
            self.any_tempered = bool((self.temperature != 1).any())
        if self.any_filtered is None:
            self.any_filtered = bool((self.top_k > 0).any()) or bool((self.top_p < 1).any())
        if self.any_greedy is None:
            self.any_greedy = bool(self.greedy.any())
        if self.all_greedy is None:
            self.all_greedy = bool(self.greedy.all())

    @classmethod
    def from_params(cls, params: list[SamplingParams], device) -> "RowSampling":
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        greedy = [p.greedy for p in params]
        return cls(torch.tensor(temps, device=device, dtype=torch.float32),
                   # any k past the vocabulary keeps it all: capped so that a huge one fits a long
                   torch.tensor([min(p.top_k, TOP_K_CAP) for p in params], device=device, dtype=torch.long),
                   torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32),
                   torch.tensor(greedy, device=device, dtype=torch.bool),
                   any_tempered=any(t != 1 for t in temps),
                   any_filtered=any(p.top_k > 0 or p.top_p < 1 for p in params),
                   any_greedy=any(greedy), all_greedy=all(greedy))

    def to(self, device) -> "RowSampling":
        """The same settings on `device` (a graph runner takes host settings and copies them into its buffers)."""
        return RowSampling(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device),
                           self.greedy.to(device), self.any_tempered, self.any_filtered, self.any_greedy,
                           self.all_greedy, self.sync_free)

    def select(self, rows: torch.Tensor) -> "RowSampling":
        return RowSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.greedy[rows],
                           self.any_tempered, self.any_filtered, self.any_greedy,
                           self.all_greedy,  # False for a subset is safe: greedy rows are overridden
                           self.sync_free)


def processed_logprobs(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Log-probabilities of the processed distribution; logits [B, ..., V] with per-row settings [B].

    Order as in transformers and vLLM: temperature, then top-k, then top-p. Removed tokens get -inf.
    """
    batch = logits.shape[0]
    extra = (1,) * (logits.dim() - 2)
    scaled = logits.float()
    if rows.any_tempered:
        scaled = scaled / rows.temperature.view(batch, *extra, 1)
    if rows.any_filtered:
        flat = scaled.reshape(-1, scaled.shape[-1])
        repeat = flat.shape[0] // batch
        scaled = filter_top_k_top_p(flat, rows.top_k.repeat_interleave(repeat), rows.top_p.repeat_interleave(repeat),
                                    sync_free=rows.sync_free).view(scaled.shape)
    return torch.log_softmax(scaled, dim=-1)


TOP_P_FIRST_CANDIDATES = 256  # most of the mass sits in a few hundred tokens; more are fetched when not


def filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *,
                       sync_free: bool = False) -> torch.Tensor:
    """Set to -inf every token outside the row's top-k, then outside its top-p nucleus; scaled [R, V].

    A full vocabulary sort costs ~120 ms at [64, 49152] on a CPU core, so the kept set is found among the
    top candidates (torch.topk), widened until it provably contains the nucleus: exact, just cheaper; how far
    to widen is read on the host. sync_free: sort the whole vocabulary instead (a CUDA graph cannot read
    anything on the host, and a GPU sorts a row in microseconds): the same kept sets.
    Top-p keeps a token when the mass of the strictly more probable tokens is below top_p (the top-1
    token always stays), as transformers' TopPLogitsWarper does; ties are broken by rank.
    """
    if sync_free:
        return _filter_over_the_sorted_vocabulary(scaled, top_k, top_p)
    vocab = scaled.shape[-1]
    k_rows = torch.where(top_k > 0, top_k, vocab)
    nucleus = top_p < 1                      # rows that apply top-p at all
    any_top_p = bool(nucleus.any())
    k_needed = int(k_rows[top_k > 0].max()) if bool((top_k > 0).any()) else 0
    candidates = min(vocab, max(k_needed, TOP_P_FIRST_CANDIDATES if any_top_p else 0))
    if candidates == 0:  # no row filters (a subset of a batch whose other rows did): nothing to remove
        return scaled
    # Normalizer of the top-k-filtered distribution: all of a row's kept tokens must be among the candidates,
    # or the row keeps the whole vocabulary (top-k off) and normalizes over it.
    full_lse = torch.logsumexp(scaled, dim=-1, keepdim=True) if any_top_p else None
    while True:
        values = torch.topk(scaled, candidates, dim=-1).values  # sorted, descending
        rank = torch.arange(candidates, device=scaled.device)[None, :]
        remove = rank >= k_rows[:, None]
        within = k_rows <= candidates        # the row's top-k set lies inside the candidates
        if any_top_p:
            lse = torch.where(within[:, None],
                              torch.logsumexp(values.masked_fill(remove, -math.inf), -1, keepdim=True), full_lse)
            probs = (values - lse).exp().masked_fill(remove, 0.0)
            mass = probs.cumsum(dim=-1)
            complete = within | ~nucleus | (mass[:, -1] >= top_p)  # the nucleus ends inside the candidates
            if not bool(complete.all()) and candidates < vocab:
                # A wide nucleus (a flat distribution): past 1/8 of the vocabulary a full sort is cheaper.
                candidates = vocab if candidates * 8 > vocab // 8 else candidates * 8
                continue
            remove |= _outside_the_nucleus(probs, mass, rank, top_p, nucleus)
        keep = _keep_most_probable(scaled, values, remove)
        # Rows are truncated only when their kept set provably lies inside the candidates (top-k within, or a
        # nucleus that ended there); a row with neither filter keeps everything. Each row is decided on its own:
        # the batch's largest k or top-p must never truncate another row.
        keep |= ~(within | nucleus)[:, None]
        return scaled.masked_fill(~keep, -math.inf)


def _filter_over_the_sorted_vocabulary(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """`filter_top_k_top_p` with every candidate: fixed shapes, no host read. A row without filters keeps all
    (its k is the vocabulary, its nucleus off); a k past the vocabulary is the vocabulary."""
    vocab = scaled.shape[-1]
    values = torch.sort(scaled, dim=-1, descending=True).values
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    remove = rank >= torch.where(top_k > 0, top_k, vocab)[:, None]
    lse = torch.logsumexp(values.masked_fill(remove, -math.inf), -1, keepdim=True)
    probs = (values - lse).exp().masked_fill(remove, 0.0)
    remove = remove | _outside_the_nucleus(probs, probs.cumsum(dim=-1), rank, top_p, top_p < 1)
    return scaled.masked_fill(~_keep_most_probable(scaled, values, remove), -math.inf)


def _outside_the_nucleus(probs, mass, rank, top_p, nucleus) -> torch.Tensor:
    """Sorted positions whose strictly more probable tokens already reach top_p (never the top-1). Rows without
    top-p are left alone: rounding can push their cumulative mass to 1 before the end."""
    return ((mass - probs) >= top_p[:, None]) & (rank > 0) & nucleus[:, None]


def _keep_most_probable(scaled, values, remove) -> torch.Tensor:
    """Each row keeps its m most probable tokens (m: the sorted candidates not removed), ties broken by the lowest
    token id. The count m depends only on the row's sorted values; which members of a tie torch.topk returns
    depends on how many candidates the batch asked for, so the kept set is drawn from the whole row, not from
    its indices: otherwise the other rows' settings would change a row's tokens (a review found greedy rows with
    top-k doing so)."""
    m = (~remove).sum(-1, keepdim=True)
    threshold = values.gather(1, m - 1)                                       # the m-th largest value
    above = scaled > threshold
    tied = scaled == threshold
    return above | (tied & (tied.cumsum(-1) <= m - above.sum(-1, keepdim=True)))


CDF_BLOCK = 256
# The fused draws (models/kernels.py's sampler, models/draft_kernels.py's draws without replacement, for an engine
# on the Triton kernels), set with `drawing_with` around a runner's steps. A context variable: each thread (an
# in-process worker) and each engine's steps keep their own, and every caller deep in the SD step (drafting, both
# acceptance rules, residuals) draws the same way without a sampler threaded through a dozen signatures.
class FusedDraws(NamedTuple):
    """The fused kernels a step's draws and its tree's bookkeeping go through (None: torch's operations)."""

    sample: Callable | None = None               # sample_from_logprobs(logprobs, uniforms)
    without_replacement: Callable | None = None  # q_sampling.draw_without_replacement(logq, uniforms, greedy)
    verify_q_nodes: Callable | None = None       # models/draft_kernels.verify_q_nodes: a q tree's node tests
    expand_frontier: Callable | None = None      # models/draft_kernels.expand_frontier: a drafted depth's records
    follow_q_path: Callable | None = None        # models/tree_kernels.follow_q_path: a q tree's accepted path
    tree_mask: Callable | None = None            # models/tree_kernels.ancestor_mask: a tree's attention mask
    commit_path: Callable | None = None          # models/tree_kernels.commit_path: a verified tree's writes
    gather_pairs: Callable | None = None         # models/tree_kernels.gather_pairs: the drafter's catch-up inputs
    whole_tree: Callable | None = None           # models/tree_kernels.whole_tree: a whole tree's node tables


TORCH_DRAWS = FusedDraws()
_FUSED_DRAW: contextvars.ContextVar = contextvars.ContextVar("tlt_fused_draw", default=TORCH_DRAWS)


@contextlib.contextmanager
def drawing_with(draw=None, **kernels: Callable):
    """Within this block (this thread), `sample_from_logprobs` calls draw(logprobs, uniforms), and the speculative
    step's draws, q-tree tests, tree records, accepted paths, tree masks and tables, writes and catch-up inputs
    go through the kernels named (`FusedDraws`' fields; the others: torch's)."""
    token = _FUSED_DRAW.set(FusedDraws(draw, **kernels))
    try:
        yield
    finally:
        _FUSED_DRAW.reset(token)


def fused_draws() -> FusedDraws:
    """What `drawing_with` set here (TORCH_DRAWS without); never read under torch.compile, which the Triton
    kernels exclude (Dynamo cannot trace a context variable)."""
    return TORCH_DRAWS if torch.compiler.is_compiling() else _FUSED_DRAW.get()


def sample_from_logprobs(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of logprobs [B, V] from uniforms [B] in [0, 1).

    Two levels (a float64 CDF over blocks of 256 tokens, then within the chosen block) instead of one float64
    cumsum over the vocabulary: same draw, a fraction of the memory traffic. A token of probability 0 owns
    an empty interval and is never drawn. Every drafter pass of q-sampling draws with this, and a GPU step pays
    per kernel (~3 us replayed): each line is one operation, the float64 casts inside the reductions.
    """
    fused = fused_draws().sample
    if fused is not None:
        return fused(logprobs, uniforms)
    batch, vocab = logprobs.shape
    blocks = -(-vocab // CDF_BLOCK)
    probs = logprobs.exp()
    if blocks == 1:  # one block: its CDF is the whole one (a small draft vocabulary, a test's model)
        return _sample_from_one_block(probs, uniforms)
    padded = blocks * CDF_BLOCK != vocab
    if padded:
        probs = torch.nn.functional.pad(probs, (0, blocks * CDF_BLOCK - vocab))
    probs = probs.view(batch, blocks, CDF_BLOCK)
    block_cdf = probs.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, blocks], the block sums accumulated in float64
    total = block_cdf[:, -1:]
    zero = torch.zeros_like(total)
    target = torch.minimum(uniforms.to(total.device, torch.float64)[:, None] * total, torch.nextafter(total, zero))
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks - 1)  # [B, 1]
    before = torch.cat([zero, block_cdf], 1).gather(1, block)  # the CDF up to the block (0 before the first)
    inner = probs.gather(1, block[:, :, None].expand(-1, 1, CDF_BLOCK))[:, 0].cumsum(-1, dtype=torch.float64)
    offset = torch.minimum((target - before).clamp(min=0), torch.nextafter(inner[:, -1:], zero))
    within = torch.searchsorted(inner, offset, right=True).clamp_(max=CDF_BLOCK - 1)
    token = torch.add(within, block, alpha=CDF_BLOCK)[:, 0]
    # Only a NaN row reaches the padding past the vocabulary: kept in range, so a later gather cannot fail (a
    # device-side assert on CUDA); its NaN log-prob is what the caller reports.
    return token.clamp_(max=vocab - 1) if padded else token


def _sample_from_one_block(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`sample_from_logprobs` for a vocabulary of at most CDF_BLOCK tokens: one float64 CDF, not padded to a
    block (a vocabulary of 5 padded to 256 was 50x the work)."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.to(cdf.device, torch.float64)[:, None] * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    # a NaN row's index may fall past the vocabulary: kept in range, as in the blocked path
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]


def sample_next(logits: torch.Tensor, rows: RowSampling, uniforms: torch.Tensor):
    """Pick one token per row from logits [B, V]; returns (tokens [B], their processed log-probs [B])."""
    logprobs = processed_logprobs(logits, rows)
    # Greedy rows take the argmax of their processed distribution (untempered, so the raw argmax up to ties):
    # a top-k/top-p that breaks a tie at the top keeps one tied token, and the verify step of speculative
    # decoding picks that same one.
    if rows.all_greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        tokens = sample_from_logprobs(logprobs, uniforms)
        if rows.any_greedy:
            tokens = torch.where(rows.greedy, logprobs.argmax(dim=-1), tokens)
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
