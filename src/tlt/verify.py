"""`tlt verify`: check, on the user's own model and drafter, that speculative decoding is lossless.

Two checks, both against references computed without the speculative path:
- greedy identity: at temperature 0, SD must emit exactly the tokens of plain decoding;
- sampled distribution: every token SD emits at temperature > 0 is judged against the target's processed
  distribution p, recomputed by teacher forcing the transformers model itself, by three tests (each at alpha / 3):
  its randomized probability integral transform (PIT) must look uniform (one-sample Kolmogorov–Smirnov: sees a
  bias along the tokens' rank), and two functions g of the drafter's own teacher-forced distribution q must
  average over the emitted tokens what p predicts, sum_x p(x) g(x) (z-tests: they see a bias toward, or away
  from, what the drafter proposes, which is where a wrong acceptance rule moves the samples). g = q sees the
  target-only rule's over-accepted drafts, g = q / (p + q) the q rule's (each one's negative control on SmolLM2:
  z = 8.75 and 0.02; 0.37 and 3.55). The PIT test alone missed min(1, 1.2 p/q) at 12,288 tokens. (q comes from
  the drafter's code, which SD shares; the z-tests stay valid whatever g is, as long as it is fixed by the tokens
  before each position: only p is the reference.) p's temperature / top-k / top-p processing is tlt's
  `processed_logprobs`, which the decoders also use (a trial): a bug there is no SD bug and this check cannot see
  it; tests/test_sampling.py holds it to transformers' own warpers.

Losslessness must hold for ANY drafter (a bad drafter only costs speed), so an untrained drafter is a valid
subject; a drafter that is accepted often exercises the acceptance rule more and makes the test sharper.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from tlt.drafter.chain import draft_logits_along
from tlt.errors import TltError
from tlt.models.loading import LoadedModel
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.sampling import RowSampling, SamplingParams, processed_logprobs
from tlt.speculative.strategy import SpecStrategy


@dataclass
class VerifyReport:
    strategy: str
    prompts: int
    alpha: float
    # greedy identity: one response per prompt, SD vs plain decoding
    greedy_samples: int  # 0 = the greedy check was not run
    greedy_mismatches: int
    first_mismatch: tuple[int, int] | None  # (prompt index, first differing token position)
    # sampled distribution: pooled PIT values of every emitted token vs U(0, 1)
    sampled_responses: int
    tokens: int
    ks_statistic: float
    p_value: float  # the KS test's
    tau: float  # tokens emitted per SD verify step: ~1 means drafts were rarely accepted (a weaker test)
    # the emitted tokens' drafter probability q(x) against what p predicts: z > 0 means drafted tokens too often
    alignment_z: float = 0.0
    alignment_p_value: float = 1.0
    # the same with q / (p + q): z > 0 means tokens the drafter likes more than the target too often
    ratio_z: float = 0.0
    ratio_p_value: float = 1.0
    # emitted tokens whose processed distribution had more than one token (-1: not counted); 0: nothing to test
    choice_tokens: int = -1

    @property
    def greedy_passed(self) -> bool:
        return self.greedy_mismatches == 0

    @property
    def sampled_passed(self) -> bool:
        """Each test at alpha / 3 (Bonferroni): the chance that an exact sampler fails is at most alpha."""
        return min(self.p_value, self.alignment_p_value, self.ratio_p_value) >= self.alpha / TESTS

    @property
    def passed(self) -> bool:
        return self.greedy_passed and self.sampled_passed

    def to_dict(self) -> dict:
        """The report's fields and verdicts; greedy_passed is None when the greedy check did not run."""
        return {**dataclasses.asdict(self), "greedy_passed": self.greedy_passed if self.greedy_samples else None,
                "sampled_passed": self.sampled_passed, "passed": self.passed}


def over_accepting_rule(u: torch.Tensor, cumulative: torch.Tensor, child_probs: torch.Tensor) -> torch.Tensor:
    """A plausible-looking bug for negative controls: drafted children are accepted with 1.2 times the
    probability the target gives them, so drafted tokens are emitted a little too often (the KS test alone
    missed bugs this size: the drafter-alignment test is what catches them)."""
    return u[:, None] <= cumulative * 1.2


def over_accepting_q_rule(u: torch.Tensor, residual_prob: torch.Tensor, draft_prob: torch.Tensor) -> torch.Tensor:
    """The same bug for q-sampling: a drafted child is accepted with min(1, 1.2 r/q) instead of min(1, r/q)."""
    return u * draft_prob <= 1.2 * residual_prob


TESTS = 3  # the sampled check's: PIT uniformity, and drafter alignment with g = q and g = q / (p + q)
OVER_ACCEPTING = {"target": over_accepting_rule, "q": over_accepting_q_rule}  # negative control per rule


def check_alpha(alpha: float) -> None:
    """A significance level: outside (0, 1) the check fails (or passes) whatever the samples are."""
    if not 0 < alpha < 1:
        raise TltError(f"alpha (the sampled check's significance level: it fails when any of its {TESTS} tests' "
                       f"p-values is below alpha / {TESTS}) must be in (0, 1), got {alpha}")


def check_settings(params: SamplingParams, prompts: int, samples_per_prompt: int, alpha: float) -> None:
    """What `verify` refuses, checkable before any model loads (`tlt verify` calls it first)."""
    if params.greedy:
        raise TltError("the sampled check needs temperature > 0 (greedy decoding is checked separately)")
    if prompts < 1 or samples_per_prompt < 1:
        raise TltError("verify needs at least one prompt and samples_per_prompt >= 1")
    if params.max_new_tokens < 2:  # it passed, having checked nothing
        raise TltError(f"verify needs max_new_tokens >= 2, got {params.max_new_tokens}: a response's first token "
                       f"comes from the prefill, speculative steps emit the rest")
    check_alpha(alpha)


def verify(loaded, drafter, *, strategy: SpecStrategy | str, prompts: list[list[int]], params: SamplingParams,
           samples_per_prompt: int, alpha: float = 1e-3, seed: int = 0, accept_rule=None,
           check_greedy: bool = True) -> VerifyReport:
    """Run both checks. loaded: a `LoadedModel` or a transformers causal LM; drafter: an `EagleDrafter`;
    params: the sampled check's settings (temperature > 0; its max_new_tokens also bounds the greedy check);
    accept_rule: replaces the exact acceptance rule on the SD engine (negative controls);
    check_greedy=False skips the greedy check (greedy rows never consult accept_rule, so a negative control
    learns nothing from it)."""
    check_settings(params, len(prompts), samples_per_prompt, alpha)
    if isinstance(strategy, str):  # a name, as the CLI takes it
        strategy = SpecStrategy.parse(strategy)
    model = loaded.model if isinstance(loaded, LoadedModel) else loaded  # a causal LM has a `.model` too
    params = dataclasses.replace(params, seed=seed if params.seed is None else params.seed)
    spec = _sd_engine(loaded, drafter, strategy, accept_rule)
    mismatches, first = _greedy_identity(loaded, spec, prompts, params) if check_greedy else (0, None)
    sampled = spec.generate(_requests(prompts, samples_per_prompt, params))
    tau = sampled.speculation_summary()["tau"]
    if tau is None:
        raise TltError("no speculative step ran: every sampled response ended at its first token, so nothing was "
                       "checked; use other prompts (or a model that does not stop at once)")
    generator = torch.Generator().manual_seed(seed)
    pits, alignment, ratio, choices = [], Alignment(), Alignment(), 0
    for sample in sampled.samples:
        logprobs = reference_logprobs(model, sample.prompt_ids, sample.token_ids, params)
        tokens = torch.tensor(sample.token_ids)
        choices += int((logprobs.exp().amax(-1) < 1 - 1e-6).sum())  # positions whose top token is not certain
        pits.append(randomized_pit(logprobs, tokens, generator))
        q = draft_probabilities(drafter, sample.prompt_ids, sample.token_ids, params)
        alignment.add(logprobs, tokens, q)
        ratio.add(logprobs, tokens, q / (q + logprobs.exp().to(q.device)).clamp(min=1e-30))
    u = torch.cat(pits)
    statistic = ks_statistic(u)
    return VerifyReport(strategy.name, len(prompts), alpha, len(prompts) if check_greedy else 0, mismatches, first,
                        len(sampled.samples), int(u.numel()), statistic, ks_pvalue(statistic, u.numel()), tau,
                        alignment.z, alignment.p_value, ratio.z, ratio.p_value, choices)


def _sd_engine(loaded, drafter, strategy: SpecStrategy, accept_rule) -> RolloutEngine:
    """An engine that speculates at every step, with room for the strategy's tree past the committed tokens."""
    engine = RolloutEngine(loaded, drafter=drafter, speculation=strategy, max_tree_size=strategy.cache_slots)
    # the rule's own hook: the target-only and q-sampling rules have different signatures
    setattr(engine.spec_decoder, "q_accept_rule" if strategy.rule == "q" else "accept_rule", accept_rule)
    return engine


def _greedy_identity(loaded, spec: RolloutEngine, prompts, params: SamplingParams):
    """At temperature 0 SD must reproduce plain decoding token for token: one response per prompt each way."""
    greedy = dataclasses.replace(params, temperature=0.0)
    plain = RolloutEngine(loaded).generate(_requests(prompts, 1, greedy))
    return _compare(plain.samples, spec.generate(_requests(prompts, 1, greedy)).samples)


def _requests(prompts, samples: int, params: SamplingParams) -> list[Request]:
    """One request per prompt, named as the user counts them in errors ("prompt 2", not requests[1])."""
    return [Request(p, samples, params, label=f"prompt {i + 1}") for i, p in enumerate(prompts)]


def _compare(plain, spec) -> tuple[int, tuple[int, int] | None]:
    """Mismatching responses, and (prompt, position) of the first difference (a prefix differs at its end)."""
    mismatches, first = 0, None
    for index, (a, b) in enumerate(zip(plain, spec)):
        if a.token_ids == b.token_ids:
            continue
        mismatches += 1
        if first is None:
            same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                        min(len(a.token_ids), len(b.token_ids)))
            first = (index, same)
    return mismatches, first


@torch.no_grad()
def reference_logprobs(model, prompt_ids, token_ids, params: SamplingParams) -> torch.Tensor:
    """The target's processed log-probs [T, V] at each response position, by teacher forcing the whole sequence
    through the transformers model itself: no KV cache, no tree mask, no engine code is shared with SD."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=device)
    logits = model(ids).logits[:, len(prompt_ids) - 1:-1]                     # [1, T, V]
    return processed_logprobs(logits, RowSampling.from_params([params], device))[0]


def randomized_pit(logprobs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """u_t = P_t(tokens ranked before x_t) + V_t * p_t(x_t), V_t ~ U(0, 1); logprobs [T, V], tokens [T].

    Tokens are ranked by probability descending, ties by token id, so the order is total and each token owns
    the interval [before, before + p) of [0, 1). If x_t ~ p_t exactly, u_t is U(0, 1) given everything before
    it: the token picks its interval with probability equal to the interval's length and V_t places u_t
    uniformly inside. A conditional law that is U(0, 1) whatever the past makes u_1, u_2, ... i.i.d. uniform
    (their joint density factorizes), however strongly the tokens themselves depend on each other. A sampler
    that favours some tokens (e.g. drafted ones) piles u up where those tokens' intervals lie.
    """
    probs = logprobs.double().exp()
    probs = probs / probs.sum(-1, keepdim=True)                                # float32 log-softmax rounding
    tokens = tokens.to(probs.device)
    p_x = probs.gather(1, tokens[:, None])                                     # [T, 1]
    ids = torch.arange(probs.shape[1], device=probs.device)[None, :]
    ahead = (probs > p_x) | ((probs == p_x) & (ids < tokens[:, None]))
    before = (probs * ahead).sum(-1)
    v = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64)
    return (before.cpu() + v * p_x[:, 0].cpu()).clamp(0.0, 1.0)


def pit_values(model, prompt_ids, token_ids, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """PIT values of one response's tokens under the teacher-forced reference."""
    logprobs = reference_logprobs(model, prompt_ids, token_ids, params)
    return randomized_pit(logprobs, torch.tensor(token_ids), generator)


def draft_probabilities(drafter, prompt_ids, token_ids, params: SamplingParams) -> torch.Tensor:
    """[T, V]: the drafter's processed distribution (the sampling settings applied, as SD drafts under them) over
    the target vocabulary at each response token, teacher-forced; 0 outside its draft vocabulary."""
    logits = draft_logits_along(drafter, drafter.target, list(prompt_ids), list(token_ids))
    probs = processed_logprobs(logits[None], RowSampling.from_params([params], logits.device))[0].exp()
    if drafter.draft_to_target is None:
        return probs
    vocab = drafter.target.spec.vocab_size
    return probs.new_zeros(probs.shape[0], vocab).index_copy_(1, drafter.draft_to_target.to(probs.device), probs)


class Alignment:
    """The z-test on g = q, the drafter's probability of each emitted token. Any g fixed by the tokens before a
    position works: if x_t ~ p_t, then g_t(x_t) - sum_x p_t(x) g_t(x) has mean 0 given the past, whatever the
    past was, so the sum of these terms over all tokens is a martingale, and over the sum of their conditional
    variances its square root is N(0, 1) for many tokens (martingale central limit theorem; responses of
    random length stop it at a bounded time, as in `ks_statistic`). g = q points where speculative bugs push:
    over-accepting rules emit the drafter's favourites too often, a residual drawn wrongly too seldom."""

    def __init__(self):
        self.deviation, self.variance = 0.0, 0.0

    def add(self, logprobs: torch.Tensor, tokens: torch.Tensor, g: torch.Tensor) -> None:
        p = logprobs.double().exp()
        p = p / p.sum(-1, keepdim=True)
        g = g.double().to(p.device)
        mean = (p * g).sum(-1)
        self.deviation += float((g.gather(1, tokens.to(p.device)[:, None])[:, 0] - mean).sum())
        self.variance += float(((p * g * g).sum(-1) - mean * mean).clamp(min=0).sum())

    @property
    def z(self) -> float:
        return self.deviation / math.sqrt(self.variance) if self.variance > 0 else 0.0

    @property
    def p_value(self) -> float:
        """Two-sided."""
        return math.erfc(abs(self.z) / math.sqrt(2))


def ks_statistic(u: torch.Tensor) -> float:
    """One-sample Kolmogorov–Smirnov D = sup |F_n(x) - x| of the values u against U(0, 1).

    Responses stop at a stop token or the length cap, so how many u a response contributes depends on its
    tokens. The count of u <= s minus s times their number is still a martingale stopped at a bounded time:
    centred, with the Brownian-bridge covariance, so D keeps its Kolmogorov limit as responses grow in number."""
    n = u.numel()
    if n == 0:
        raise TltError("no tokens were sampled: nothing to test")
    u = u.double().sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - u, u - (i - 1) / n).max())


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for the Kolmogorov distribution (the limit of sqrt(n) * D).

    Two series for the same function, each where it converges in a few terms: the alternating series
    2 * sum_k (-1)^(k-1) exp(-2 k^2 x^2) for large x, the theta-function form
    P(K <= x) = sqrt(2 pi) / x * sum_k exp(-(2k - 1)^2 pi^2 / (8 x^2)) for small x."""
    if x <= 0:
        return 1.0
    if x < 1.18:
        total = sum(math.exp(-(2 * k - 1) ** 2 * math.pi ** 2 / (8 * x * x)) for k in range(1, 20))
        return min(1.0, max(0.0, 1.0 - math.sqrt(2 * math.pi) / x * total))
    total = sum((-1) ** (k - 1) * math.exp(-2 * k * k * x * x) for k in range(1, 20))
    return min(1.0, max(0.0, 2.0 * total))


def ks_pvalue(statistic: float, n: int) -> float:
    """Asymptotic p-value of D over n values. For finite n, P(sqrt(n) D > x) lies a little below the limit,
    so this p-value errs on the large side (slightly conservative)."""
    return kolmogorov_sf(math.sqrt(n) * statistic)
