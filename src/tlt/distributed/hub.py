"""DrafterHub: where workers meet to share the drafter between rollouts and spot training.

It holds (1) the published drafter versions — the drafter's own layers only, never the target's embedding or
lm_head, which every worker already has; (2) the features every worker's actor forwards produced (an idle
worker's own pass, or the update's forward), so whichever worker goes idle trains on everybody's data; (3) the
per-step control: which worker holds the trainer lease and when spot training must stop. On Ray it runs as one
small actor; in-process it is a plain object. Every method is short and thread-safe, because the rollout worker
polls it between decode steps.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from tlt.errors import TltError


class HubTimeout(TltError):
    """The hub (a Ray actor) did not answer a call in time, or died."""


class DrafterHub:
    def __init__(self, max_feature_tokens: int = 200_000):
        self._lock = threading.Lock()
        self._version = -1
        self._weights: dict | None = None      # latest published drafter state (own layers)
        self._trainer_state: dict | None = None  # the trainer's optimizer state, for the next spot session
        self._history: list[dict] = []          # (version, step, trainer worker, optimizer steps) per publish
        self._untrained: set[int] = set()       # versions at their random initialization: they serve no SD step
        self._features: deque = deque()         # (sequence number, FeatureEntry)
        self._feature_tokens = 0
        self._next_feature = 0
        self.max_feature_tokens = max_feature_tokens
        self._step = -1
        self._stopped = True
        self._lease: int | None = None
        self._step_began = time.monotonic()
        self._decoded: dict[int, float] = {}  # rank -> when it last said it decodes (this step), hub's clock

    # -- drafter versions -----------------------------------------------------------------------------

    def publish(self, weights: dict, *, step: int, worker: int, trainer_steps: int,
                trainer_state: dict | None = None, trained: bool = True) -> int:
        """A new version. trained=False: a drafter at its random initialization (a run's starting drafter without
        run.drafter), which the engines keep from serving until a trained version replaces it."""
        with self._lock:
            self._version += 1
            if not trained:
                self._untrained.add(self._version)
            self._weights = weights
            if trainer_state is not None:
                self._trainer_state = trainer_state
            self._history.append({"version": self._version, "step": step, "worker": worker,
                                  "trainer_steps": trainer_steps})
            return self._version

    def keep_trainer_state(self, trainer_state: dict) -> None:
        """The trainer's optimizer state for the next spot session, its weights already the latest version."""
        with self._lock:
            self._trainer_state = trainer_state

    def latest_version(self) -> int:
        return self._version

    def latest(self) -> tuple[int, dict | None]:
        with self._lock:
            return self._version, self._weights

    def trainer_state(self) -> dict | None:
        with self._lock:
            return self._trainer_state

    def history(self) -> list[dict]:
        with self._lock:
            return list(self._history)

    def restore(self, version: int, weights: dict, trainer_state: dict | None, trained: bool = True) -> None:
        """Resume: the checkpointed drafter becomes the current version again."""
        with self._lock:
            self._version, self._weights, self._trainer_state = version, weights, trainer_state
            self._untrained.discard(version)
            if not trained:
                self._untrained.add(version)

    def is_trained(self, version: int) -> bool:
        """Whether that version ever trained (or was given trained): what decides if it may serve SD steps,
        carried with the version rather than guessed from a config that may change on --resume."""
        with self._lock:
            return version not in self._untrained

    # -- features ---------------------------------------------------------------------------------------

    def add_features(self, entries: list) -> None:
        """entries: `FeatureEntry`s (tokens [T], features [T, H], step); the oldest are evicted first."""
        with self._lock:
            for entry in entries:
                self._features.append((self._next_feature, entry))
                self._next_feature += 1
                self._feature_tokens += int(entry.tokens.shape[0])
            while self._feature_tokens > self.max_feature_tokens and len(self._features) > 1:
                _, old = self._features.popleft()
                self._feature_tokens -= int(old.tokens.shape[0])

    def features_since(self, sequence: int) -> tuple[int, list]:
        """Entries added after `sequence` (a worker's last pull) and the sequence to pull from next time."""
        with self._lock:
            return self._next_feature, [entry for number, entry in self._features if number >= sequence]

    # -- per-step control -------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        with self._lock:
            self._step, self._stopped, self._lease = step, False, None
            self._step_began, self._decoded = time.monotonic(), {}

    # -- liveness -------------------------------------------------------------------------------------------

    def decoding(self, rank: int) -> None:
        """A rolling-out worker decoded a step (said every few seconds): a rollout that stops saying so hangs."""
        with self._lock:
            self._decoded[rank] = time.monotonic()

    def silent_for(self, ranks: list[int]) -> dict[int, float]:
        """Seconds since each rank last said it decodes (since the step began, if it never did), by the hub's
        clock: the driver's and the workers' may be other machines'."""
        with self._lock:
            now = time.monotonic()
            return {rank: now - self._decoded.get(rank, self._step_began) for rank in ranks}

    def acquire_trainer(self, step: int, worker: int) -> bool:
        """One spot trainer per step: the first worker to go idle (see docs/benchmarks.md for why not DP)."""
        with self._lock:
            if self._stopped or step != self._step or self._lease is not None:
                return False
            self._lease = worker
            return True

    def stop(self, step: int) -> None:
        """The last rollout of the step ended: spot training yields within one optimizer step."""
        with self._lock:
            if step == self._step:
                self._stopped = True

    def should_stop(self, step: int) -> bool:
        return self._stopped or step != self._step
