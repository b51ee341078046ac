"""GRPOTrainer: GRPO with verifiable rewards in one process — the in-process driver of the step's phases.

One step reads top to bottom: sample prompts → rollout (n samples per prompt) → score (rewards, group-normalized
advantages) → PPO-clip update over micro-batches with gradient accumulation and clipping → step metrics. The
phases are rl/phases.py's, the same code each distributed worker runs on its shard (distributed/worker.py); this
class only sequences them over one PolicyReplica and counts steps. Tests and benchmarks drive it directly;
`tlt train` drives it, or the distributed controller, through the same `train_step / step / save / resume`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tlt.drafter.buffer import FeatureBuffer
from tlt.metrics.step import speculation_metrics, step_metrics
from tlt.models.loading import LoadedModel
from tlt.rl import phases
from tlt.rl.checkpoint import save_final_model
from tlt.rl.config import ConfigError, TrainConfig, validate
from tlt.rl.phases import StepBatch
from tlt.rl.replica import PolicyReplica
from tlt.rl.run_checkpoint import resume_replica, save_run_checkpoint
from tlt.rollout.request import RolloutResult

log = logging.getLogger(__name__)


class _OfReplica:
    """An attribute that is the replica's own (read and assigned through), e.g. `trainer.optimizer = SGD(...)`."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else getattr(trainer.replica, self.name)

    def __set__(self, trainer, value):
        setattr(trainer.replica, self.name, value)


class GRPOTrainer:
    config = _OfReplica()
    loaded = _OfReplica()
    device = _OfReplica()
    engine = _OfReplica()
    optimizer = _OfReplica()
    scheduler = _OfReplica()
    autocast_dtype = _OfReplica()
    reference = _OfReplica()
    task = _OfReplica()
    reward = _OfReplica()
    model = _OfReplica()      # read-only (properties of the replica)
    tokenizer = _OfReplica()

    def __init__(self, config: TrainConfig, *, loaded: LoadedModel | None = None, task=None, reward=None,
                 feature_buffer: FeatureBuffer | None = None):
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"GRPOTrainer needs a TrainConfig (tlt.rl.config.load_config), got "
                              f"{type(config).__name__}")
        validate(config)  # a config built in code (TrainConfig().override) gets the command line's checks
        if config.run.speculative != "off" and not config.run.drafter:
            # validate() lets spot or tail training teach a drafter from scratch: `tlt train`'s workers, not this
            # driver; its engine holds the untrained drafter back, so the run is right, just never speculative
            log.warning(f"run.speculative={config.run.speculative} without run.drafter: GRPOTrainer neither "
                        f"spot-trains nor tail-trains a drafter (`tlt train` does), so this run will not speculate")
        self.replica = PolicyReplica.build(config, loaded=loaded, task=task, reward=reward)
        # When set, the drafter's FeatureBuffer is fed from a forward the step runs anyway (the old-log-prob pass,
        # or the update's own forward when that pass is skipped): no extra forward.
        self.feature_buffer = feature_buffer
        self.progress = False  # a rollout progress bar (the CLI turns it on)
        self.on_phase = None   # callable(text): the driver's status line, told when the rollout is over
        self.step = 0          # RL steps completed

    # -- one RL step ----------------------------------------------------------------------------------

    def train_step(self) -> dict:
        started = time.perf_counter()
        examples = phases.sample_prompts(self.replica, self.step)
        rollout = self.rollout(examples)
        rollout_s = time.perf_counter() - started
        self._phase(f"step {self.step + 1}: log-probs and update")
        batch = self.score(examples, rollout)
        update = self.update(batch)
        self.step += 1
        metrics = {**step_metrics(rollout, batch.rewards, batch.correct, update, rollout_s,
                                  time.perf_counter() - started - rollout_s, batch.reward_failures),
                   **speculation_metrics(self.engine), "lr": self.replica.lr}
        if not self.evaluation_due():
            return metrics
        self._phase(f"step {self.step}: held-out evaluation")
        return {**metrics, **self.evaluate()}

    def rollout(self, examples, between_steps=None, lengths=None, collect_features=None) -> RolloutResult:
        return phases.rollout(self.replica, examples, self.step, progress=self.progress,
                              between_steps=between_steps, lengths=lengths, collect_features=collect_features)

    def score(self, examples, rollout: RolloutResult) -> StepBatch:
        return phases.score(self.replica, examples, rollout, self.step, self.feature_buffer)

    def collect_features(self, batch: StepBatch, should_stop=lambda: False) -> int:
        return phases.collect_features(self.replica, batch, should_stop)

    def micro_batches(self, packed) -> list[list[int]]:
        return phases.micro_batches(self.config, packed)

    def update(self, batch: StepBatch, totals: dict | None = None, reduce_gradients=None) -> dict:
        return phases.update(self.replica, batch, totals, reduce_gradients)

    def evaluation_due(self) -> bool:
        return phases.held_out_due(self.replica, self.step)

    def evaluate(self) -> dict:
        return phases.evaluate(self.replica)

    def step_seed(self) -> int:
        return phases.step_seed(self.config, self.step)

    def _phase(self, text: str) -> None:
        if self.on_phase is not None:
            self.on_phase(text)

    # -- checkpoints ----------------------------------------------------------------------------------

    def save(self, run_dir: Path) -> Path:
        return save_run_checkpoint(run_dir, self.replica, self.step)

    def save_final(self, directory: Path) -> Path:
        return save_final_model(self.model, self.tokenizer, directory)

    def resume(self, checkpoint: Path) -> None:
        self.step = resume_replica(self.replica, checkpoint)
