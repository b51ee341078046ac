"""When to speculate and how: the `SpeculationPolicy` protocol the engine talks to, a fixed policy, and the
adaptive one (a batch-size gate with hysteresis and an ε-greedy bandit per batch-size bucket).

Pure policy logic, no engine or torch: the engine asks `choose(batch_size)` before a decode step and reports
`observe(...)` after it. Speculation pays only at small batch (verifying N tokens costs far more than one
token at batch 64, barely more at batch 1), so the gate keeps it off while the batch is large, and the bandit
learns, per bucket of batch sizes, which arm (a draft strategy, or "off") emits the most tokens per second.

Reward model: tokens/s of arm a at batch B = B * τ(a) / t(bucket, a). The step time t is learned per bucket,
but the acceptance length τ depends on the drafter and the policy, not on the batch size, so it is pooled
across buckets: a bucket seen rarely still gets a good τ estimate from the others.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import re
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Protocol, runtime_checkable

from tlt.errors import TltError
from tlt.sampling import is_integer
from tlt.speculative.strategy import SpecStrategy, StrategyError

OFF = "off"  # the arm that decodes one token per step without a drafter
PRICED_OUT_EXPLORATION = 5  # when the price rules out every speculative arm, 1 in this many ε-explorations tries one


class PolicyError(TltError):
    """Invalid gate or bandit settings, or something the engine cannot use as a policy."""


@runtime_checkable
class SpeculationPolicy(Protocol):
    """What the engine asks before every decode step and tells after it; what a trainer resets and checkpoints."""

    def choose(self, batch_size: int) -> SpecStrategy | str | None:
        """The strategy for this step's batch, or None / OFF for a plain step."""

    def observe(self, batch_size: int, arm, emitted_tokens: int, wall_s: float, verify_steps: int, *,
                timed: bool = True) -> None:
        """What the step did: tokens emitted over all rows, its wall time, rows x steps verified. timed=False:
        the wall time includes one-off work (a CUDA graph captured, a drafter state rebuilt from nothing) and
        says nothing about what the arm costs per step; its tokens still count."""

    def reset(self) -> None:
        """A new rollout begins (its batch restarts large)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def summary(self) -> dict:
        """Metrics (e.g. τ and tokens/s per arm); {} when there is nothing to report."""


def check_arm(strategy) -> None:
    """A policy's arm must be a SpecStrategy: anything else would only fail at the first speculative step."""
    if not isinstance(strategy, SpecStrategy):
        raise PolicyError(f"a speculation strategy must be a SpecStrategy (SpecStrategy.parse('S4K2N8')), got "
                          f"{strategy!r}")


def as_strategy(value) -> SpecStrategy:
    """A SpecStrategy, or its name parsed ('S5K1q'; a malformed one says the form): names are taken wherever a
    strategy is, as `verify(strategy=...)` and the CLI take them (QA)."""
    if isinstance(value, str):
        return SpecStrategy.parse(value)
    check_arm(value)
    return value


def _parsed_if_named(arm):
    """An AdaptiveSpeculation arm: a strategy's name parsed; other arms kept (its bandit takes any hashable arm,
    e.g. in a simulation; an engine refuses them when it is given the policy)."""
    try:
        return SpecStrategy.parse(arm) if isinstance(arm, str) else arm
    except StrategyError:
        if re.match(r"S[0-9]", arm):  # meant as a strategy: its form said now, not a bare refusal in the engine
            raise
        return arm


@dataclass
class FixedSpeculation:
    """One strategy, at every batch size or only while the batch is at most `gate`; nothing to learn."""

    strategy: SpecStrategy | str  # a name is parsed
    gate: int | None = None

    def __post_init__(self):
        self.strategy = as_strategy(self.strategy)
        if self.gate is not None and not (is_integer(self.gate) and self.gate >= 1):
            raise PolicyError(f"gate must be None (always speculate) or an integer >= 1 (rows running), "
                              f"got {self.gate!r}")

    def choose(self, batch_size: int) -> SpecStrategy | None:
        return self.strategy if self.gate is None or batch_size <= self.gate else None

    def observe(self, batch_size: int, arm, emitted_tokens: int, wall_s: float, verify_steps: int, *,
                timed: bool = True) -> None:
        pass

    def reset(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def summary(self) -> dict:
        return {}


def as_policy(speculation) -> SpeculationPolicy | None:
    """What `RolloutEngine(speculation=...)` accepts: None (never speculate), a `SpecStrategy` or its name
    (always, with it) or a `SpeculationPolicy`."""
    if isinstance(speculation, AdaptiveSpeculation):  # its bandit takes any hashable arm; an engine needs strategies
        for arm in speculation.bandit.arms:
            if arm != OFF:
                check_arm(arm)
    if speculation is None or isinstance(speculation, SpeculationPolicy):
        return speculation
    if isinstance(speculation, (SpecStrategy, str)):
        return FixedSpeculation(as_strategy(speculation))
    raise PolicyError(f"speculation must be None, a SpecStrategy (or its name) or a SpeculationPolicy (choose, "
                      f"observe, reset, state_dict, load_state_dict, summary), got {type(speculation).__name__}; for "
                      f"a gate use FixedSpeculation(strategy, gate=8)")


def policy_strategies(policy) -> list[SpecStrategy]:
    """The strategies a built-in policy may pick (a custom policy's are checked when it picks them)."""
    if isinstance(policy, FixedSpeculation):
        return [policy.strategy]
    if isinstance(policy, AdaptiveSpeculation):
        return [arm for arm in policy.bandit.arms if arm != OFF]
    return []


@dataclass
class BatchSizeGate:
    """SD is off while the running batch exceeds `threshold`; it turns on once the batch has stayed at or
    below it for `hysteresis` consecutive steps, and off again as soon as it rises above (e.g. new prompts
    joined the batch).

    Default 8, from measurements on the 2-core CPU (docs/benchmarks.md): verifying a 9-token tree costs ~1.1x a
    plain step at batch 1, ~1.8x at batch 4 and ~3.3x at batch 16, so above 8 no realistic τ pays; the bandit
    still decides per bucket below it. Hysteresis 2 keeps one straggling admission from flapping the mode."""

    threshold: int = 8
    hysteresis: int = 2
    _below: int = 0

    def __post_init__(self):
        if self.threshold < 1 or self.hysteresis < 1:
            raise PolicyError(f"gate needs threshold >= 1 and hysteresis >= 1, got {self.threshold}, "
                              f"{self.hysteresis}")

    def update(self, batch_size: int) -> bool:
        self._below = self._below + 1 if batch_size <= self.threshold else 0
        return self._below >= self.hysteresis

    def reset(self) -> None:
        self._below = 0


@dataclass(frozen=True)
class BanditConfig:
    bucket_bounds: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # bucket i holds batch sizes in (bounds[i-1], bounds[i]]
    epsilon: float = 0.1       # exploration rate per bucket once every arm has been tried
    window: int = 32           # observations kept per (bucket, arm) step time and per arm τ
    min_trials: int = 2        # tries of every arm in a bucket before exploiting
    seed: int = 0

    def __post_init__(self):
        bounds = self.bucket_bounds
        if not bounds or list(bounds) != sorted(set(bounds)) or bounds[0] < 1:
            raise PolicyError(f"bucket_bounds must be strictly increasing positive ints, got {bounds}")
        if not 0 <= self.epsilon <= 1:
            raise PolicyError(f"epsilon must be in [0, 1], got {self.epsilon}")
        if self.window < 1 or self.min_trials < 0:
            raise PolicyError("window must be >= 1 and min_trials >= 0")


@dataclass
class ArmStats:
    """What one arm did: for metrics (τ and tokens/s per arm). Counts add up across workers
    (`metrics.step.merge_speculation_metrics`)."""

    steps: int = 0
    emitted: int = 0
    verify_steps: int = 0
    timed_emitted: int = 0    # tokens of the steps whose wall time is the arm's own (no graph capture in it)
    timed_wall_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Over timed steps only: a step that also captured a CUDA graph (10-100x a step) says nothing about
        the arm's rate, as the bandit knows."""
        return self.timed_emitted / self.timed_wall_s if self.timed_wall_s > 0 else 0.0

    def metrics(self) -> dict:
        """The counts (which add up across workers) and what they give: τ and tokens/s."""
        return {**dataclasses.asdict(self), "tau": self.tau, "tokens_per_s": self.tokens_per_s}


@dataclass
class StrategyBandit:
    """ε-greedy per batch-size bucket over `arms` (hashable strategies; include OFF to let it win)."""

    arms: list[Hashable]
    config: BanditConfig = field(default_factory=BanditConfig)
    # price(arm, batch_size): what a step of the arm costs in plain steps on this device (the cost curve), or
    # None. With it, an arm whose pooled τ cannot pay that price gets no forced trials in a new bucket (ε still
    # tries it there): a barely trained drafter was tried 2x per arm in every bucket, a fifth of a short CPU
    # rollout spent on steps the curve already said would lose.
    price: Callable[[Hashable, int], float] | None = None

    def __post_init__(self):
        if not self.arms or len(set(self.arms)) != len(self.arms):
            raise PolicyError(f"arms must be non-empty and distinct, got {self.arms}")
        self._rng = random.Random(self.config.seed)
        self._step_time = defaultdict(lambda: deque(maxlen=self.config.window))  # (bucket, arm) -> s per step
        self._tau = defaultdict(lambda: deque(maxlen=self.config.window))        # arm -> tokens per row-step
        self._trials = defaultdict(int)                                           # (bucket, arm) -> count
        self.stats = defaultdict(ArmStats)                                        # arm -> totals
        # (bucket, arm) -> times chosen: counts, not a list of every choice (thousands a rollout, summed up at
        # every RL step for the metrics: found by review)
        self.choice_counts: Counter = Counter()

    def bucket(self, batch_size: int) -> int:
        """Index of the smallest bound >= batch_size (sizes above the last bound share the last bucket)."""
        if batch_size < 1:
            raise PolicyError(f"batch_size must be >= 1, got {batch_size}")
        return min(bisect.bisect_left(self.config.bucket_bounds, batch_size), len(self.config.bucket_bounds) - 1)

    def choose(self, batch_size: int) -> Hashable:
        bucket = self.bucket(batch_size)
        untried = [a for a in self.arms
                   if self._trials[bucket, a] < self.config.min_trials and not self._priced_out(batch_size, a)]
        if untried:
            arm = untried[0]
        elif self._rng.random() < self.config.epsilon:
            arm = self._explore(batch_size)
        else:
            arm = max(self.arms, key=lambda a: self.estimate(batch_size, a))
        self.choice_counts[bucket, arm] += 1
        return arm

    def observe(self, batch_size: int, arm: Hashable, emitted_tokens: int, wall_s: float,
                verify_steps: int | None = None, *, timed: bool = True) -> None:
        """Record one decode step: `emitted_tokens` over all rows; `verify_steps` = rows x steps (= batch size).
        timed=False (the step also captured a graph or rebuilt a drafter state): its tokens count toward τ and
        the totals, but its wall time stays out of the step-time window and it is not a trial of the arm (a
        first try that captures would otherwise make the arm look 10-100x slower than it is)."""
        if not (math.isfinite(wall_s) and (wall_s > 0 or not timed)) or emitted_tokens < 0:
            # a zero time divided every estimate by zero, a NaN one kept the arm from ever being chosen
            raise PolicyError(f"a decode step needs a positive, finite wall time and tokens >= 0: got "
                              f"wall_s={wall_s}, emitted_tokens={emitted_tokens}")
        rows = verify_steps if verify_steps is not None else batch_size
        bucket = self.bucket(batch_size)
        if timed:
            self._trials[bucket, arm] += 1
            self._step_time[bucket, arm].append(wall_s)
        if arm != OFF and rows > 0:
            self._tau[arm].append(emitted_tokens / rows)
        totals = self.stats[arm]
        totals.steps += rows // batch_size  # the steps observed: an overlapped call lands 0, 1 or 2 (review)
        totals.emitted += emitted_tokens
        totals.verify_steps += rows
        if timed:
            totals.timed_emitted += emitted_tokens
            totals.timed_wall_s += wall_s

    def _explore(self, batch_size: int) -> Hashable:
        """ε's random arm, among those the price does not rule out here; one exploration in
        PRICED_OUT_EXPLORATION tries any arm, so a priced-out arm's τ is seen again when a better drafter lifts
        it (exploring them at the full ε cost a short CPU rollout a fifth of its time, in the tail, where the wall
        time is; never exploring them locked an arm out for the run while any other arm stayed open: review)."""
        open_arms = [a for a in self.arms if not self._priced_out(batch_size, a)]
        if not open_arms or self._rng.random() < 1 / PRICED_OUT_EXPLORATION:
            return self._rng.choice(self.arms)
        return self._rng.choice(open_arms) if len(open_arms) > 1 else open_arms[0]

    def _priced_out(self, batch_size: int, arm: Hashable) -> bool:
        """Whether the arm's τ, known from its tries anywhere, is below what its step costs at this batch size:
        then it emits fewer tokens per second than plain decoding here, by the device's own measurement."""
        if arm == OFF or self.price is None or len(self._tau[arm]) < self.config.min_trials:
            return False
        return self._pooled_tau(arm) < self.price(arm, batch_size)

    def _pooled_tau(self, arm: Hashable) -> float:
        """The arm's tokens per row-step over its recent tries in every bucket (1 for plain decoding or untried)."""
        taus = self._tau[arm]
        return 1.0 if arm == OFF or not taus else sum(taus) / len(taus)

    def estimate(self, batch_size: int, arm: Hashable) -> float:
        """Expected tokens/s of `arm` at this batch size (0 if never tried in this bucket)."""
        times = self._step_time[self.bucket(batch_size), arm]
        if not times:
            return 0.0
        return batch_size * self._pooled_tau(arm) / (sum(times) / len(times))

    def best(self, batch_size: int) -> Hashable:
        return max(self.arms, key=lambda a: self.estimate(batch_size, a))

    # -- checkpointing: carried across RL steps ------------------------------------------------------

    def state_dict(self) -> dict:
        index = {arm: i for i, arm in enumerate(self.arms)}
        return {
            "step_time": [[b, index[a], list(v)] for (b, a), v in self._step_time.items() if a in index],
            "tau": [[index[a], list(v)] for a, v in self._tau.items() if a in index],
            "trials": [[b, index[a], n] for (b, a), n in self._trials.items() if a in index],
            "rng": list(self._rng.getstate()[1]),
            "arms": [str(arm) for arm in self.arms],
            "stats": [[index[a], dataclasses.asdict(s)] for a, s in self.stats.items() if a in index],  # metrics
        }

    def load_state_dict(self, state: dict) -> None:
        """Experience is matched to arms by name: a run resumed with a different arm set keeps what it learned
        about the arms both sets share and starts the new ones fresh."""
        by_name = {str(arm): arm for arm in self.arms}
        saved = state.get("arms", [str(arm) for arm in self.arms])  # older states: same arms, same order
        arms = {i: by_name[name] for i, name in enumerate(saved) if name in by_name}
        for bucket, arm, values in state["step_time"]:
            if arm in arms:
                self._step_time[bucket, arms[arm]].extend(values)
        for arm, values in state["tau"]:
            if arm in arms:
                self._tau[arms[arm]].extend(values)
        for bucket, arm, count in state["trials"]:
            if arm in arms:
                self._trials[bucket, arms[arm]] = count
        for arm, counts in state.get("stats", []):  # older states: per-arm metrics restart
            if arm in arms:
                self.stats[arms[arm]] = ArmStats(**counts)
        version, _, gauss = self._rng.getstate()
        self._rng.setstate((version, tuple(state["rng"]), gauss))

    def summary(self) -> dict:
        """Metrics: share of steps with SD, the arm chosen most per bucket, τ and tokens/s per arm."""
        chosen = sum(self.choice_counts.values())
        sd_steps = sum(count for (_, arm), count in self.choice_counts.items() if arm != OFF)
        per_bucket: dict[int, dict] = defaultdict(lambda: defaultdict(int))
        for (bucket, arm), count in sorted(self.choice_counts.items(), key=lambda item: item[0][0]):
            per_bucket[bucket][str(arm)] += count
        return {
            "sd_step_share": sd_steps / chosen if chosen else 0.0,
            "arm_counts_per_bucket": {str(self.config.bucket_bounds[b]): dict(c) for b, c in per_bucket.items()},
            "arms": {str(a): s.metrics() for a, s in self.stats.items()},
        }


class AdaptiveSpeculation:
    """The engine's speculation policy: the gate decides whether SD may run; the bandit picks the arm.

    Pass it as `RolloutEngine(..., speculation=AdaptiveSpeculation(strategies))`; keep the same object across
    RL steps (or checkpoint `state_dict()`) so what it learned carries over.
    """

    def __init__(self, strategies: list, gate: BatchSizeGate | None = None, config: BanditConfig | None = None,
                 price: Callable[[Hashable, int], float] | None = None):
        """price(strategy, batch_size): a step's cost in plain steps (e.g. from the device's cost curve); see
        `StrategyBandit.price`."""
        if not strategies:
            raise PolicyError("AdaptiveSpeculation needs at least one strategy (plain decoding is always an arm)")
        self.gate = gate or BatchSizeGate()
        self.bandit = StrategyBandit([OFF, *map(_parsed_if_named, strategies)], config or BanditConfig(), price)
        self.gated_steps = 0

    def choose(self, batch_size: int):
        if not self.gate.update(batch_size):
            self.gated_steps += 1
            return OFF
        return self.bandit.choose(batch_size)

    def observe(self, batch_size: int, arm, emitted_tokens: int, wall_s: float, verify_steps: int | None = None,
                *, timed: bool = True) -> None:
        if batch_size <= self.gate.threshold:  # steps the gate kept plain say nothing about small-batch arms
            self.bandit.observe(batch_size, arm, emitted_tokens, wall_s, verify_steps, timed=timed)

    def reset(self) -> None:
        """Call between rollouts: the batch restarts large."""
        self.gate.reset()

    def state_dict(self) -> dict:
        return {"bandit": self.bandit.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.bandit.load_state_dict(state["bandit"])

    def summary(self) -> dict:
        return {**self.bandit.summary(), "gated_steps": self.gated_steps}
