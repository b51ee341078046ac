"""What a caller asks the rollout engine for, and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field

from tlt.errors import RequestError
from tlt.sampling import SamplingParams, is_integer, token_ids


TAIL_FRACTION = 0.25  # the long tail: no sample waits and at most this share of the rollout's peak rows decode


def tail_rows(peak: int) -> int:
    """The most rows still decoding in the long tail of a rollout whose batch peaked at `peak` (at least one:
    the last row is always the tail). One definition for the engine's tail training and the step metrics."""
    return max(1, int(TAIL_FRACTION * peak))


def in_long_tail(running: int, waiting: int, peak: int) -> bool:
    """Whether a rollout with `running` rows decoding, `waiting` samples queued and a peak of `peak` rows so
    far is in its long tail (the batch has drained; most of the device sits idle)."""
    return waiting == 0 and 0 < running <= tail_rows(peak)


@dataclass(frozen=True)
class Request:
    """One prompt to sample `n` responses for."""

    prompt_ids: tuple[int, ...]
    n: int = 1
    params: SamplingParams = field(default_factory=SamplingParams)
    label: str | None = field(default=None, compare=False)  # names it in errors (e.g. its dataset record)
    # Which random stream of its seed the samples draw (default: the request's position in generate()'s list).
    # Callers that split one batch of requests across engines give each its position in the whole batch, so the
    # samples do not depend on the split (data-parallel workers: run.workers stays operational).
    stream: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", token_ids(self.prompt_ids, "prompt_ids"))
        if not self.prompt_ids:
            raise RequestError("empty prompt: a request needs at least one prompt token")
        if not (is_integer(self.n) and self.n >= 1):
            raise RequestError(f"n (samples per prompt) must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.params, SamplingParams):  # a dict failed inside generate() with AttributeError
            raise RequestError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        if self.stream is not None and not (is_integer(self.stream) and self.stream >= 0):
            raise RequestError(f"stream must be an integer >= 0, got {self.stream!r}")

    def stream_at(self, position: int) -> int:
        """The random stream its samples draw when it is `position` in generate()'s list."""
        return position if self.stream is None else self.stream


def check_fits(request: Request, vocab_size: int, context: int, name: str, context_note: str = "") -> None:
    """A request the model can serve whole: token ids in its vocabulary, and the prompt with the response
    budget within its context (nothing is ever truncated). context_note: why the context is what it is
    (`ModelSpec.context_note`)."""
    ids = request.prompt_ids
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise RequestError(f"{name}: prompt token id out of range [0, {vocab_size})")
    stops = request.params.stop_token_ids or ()
    if any(not 0 <= stop < vocab_size for stop in stops):  # a typo'd stop id would never stop anything
        raise RequestError(f"{name}: stop token id out of range [0, {vocab_size}): {list(stops)}")
    total = len(ids) + request.params.max_new_tokens
    if total > context:
        raise RequestError(
            f"{name}: prompt of {len(ids)} tokens + max_new_tokens {request.params.max_new_tokens} = {total} "
            f"exceeds the model's context of {context} tokens{context_note} (nothing is truncated: shorten the "
            f"prompt or the budget)")


@dataclass
class SampleOutput:
    """One sampled response."""

    request_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]       # of each sampled token under the processed distribution
    finish_reason: str          # "stop" (a stop token, included in token_ids) or "length"
    drafter_versions: tuple[int, ...] = ()  # drafter versions that served this sample's SD steps (hot-swap)


@dataclass(frozen=True)
class StepTrace:
    """One engine forward: what the long tail looks like, step by step."""

    kind: str          # "prefill" or "decode"
    batch_size: int    # rows in the forward
    new_tokens: int    # tokens emitted by this step
    wall_s: float
    mode: str = "plain"              # "plain" or "sd"
    strategy: str | None = None      # the SpecStrategy name of an SD step
    accepted_hist: tuple = ()        # SD: rows that accepted 0, 1, 2, ... draft tokens
    draft_s: float = 0.0
    verify_s: float = 0.0
    start_s: float = 0.0             # when the step began, seconds after generate() started
    landed: int = 1                  # steps whose tokens this trace holds: an overlapped call's are the
                                     # step before's (0 for the first, 2 when the lag ends; a step drained
                                     # after the call, before an arm switch or a prefill, counts to it)


def acceptance_by_depth(sd_steps: list[StepTrace]) -> list[float]:
    """Per depth d: of the rows that accepted d - 1 draft tokens in steps of an arm drafting d deep or more, the
    share that accepted a d-th. A row of a shallower arm that accepted all it drafted went no deeper: it was
    counted as rejected at the next depth when arms of several depths were pooled (found by a trial)."""
    depth = max((len(s.accepted_hist) - 1 for s in sd_steps), default=0)  # a hist counts rows accepting 0..D
    shares = []
    for d in range(1, depth + 1):
        deep = [s.accepted_hist for s in sd_steps if len(s.accepted_hist) - 1 >= d]
        tried, accepted = sum(sum(h[d - 1:]) for h in deep), sum(sum(h[d:]) for h in deep)
        shares.append(accepted / tried if tried else 0.0)
    return shares


@dataclass
class RolloutResult:
    samples: list[SampleOutput]   # ordered by (request_index, sample_index)
    steps: list[StepTrace]
    wall_s: float

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def batch_size_trace(self) -> list[int]:
        return [s.batch_size for s in self.steps if s.kind == "decode"]

    def speculation_summary(self) -> dict:
        """τ (emitted tokens per row per verify step, bonus included), per-depth acceptance, SD share, timing."""
        decode = [s for s in self.steps if s.kind == "decode"]
        sd = [s for s in decode if s.mode == "sd"]
        row_steps = sum(s.batch_size for s in sd)
        return {
            "sd_step_share": len(sd) / len(decode) if decode else 0.0,
            "tau": sum(s.new_tokens for s in sd) / row_steps if row_steps else None,  # None: no SD step ran
            "acceptance_by_depth": acceptance_by_depth(sd),
            "draft_s": sum(s.draft_s for s in sd),
            "verify_s": sum(s.verify_s for s in sd),
        }
