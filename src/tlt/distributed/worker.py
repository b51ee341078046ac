"""RolloutWorker: one policy replica with its rollout engine, its share of the step, and spot training.

The controller calls, per RL step: `rollout(step, shard)` → `prepare()` (rewards; old log-probs only with several
updates per step) → `spot_train(step)` if other workers are still in the long tail (it first computes this shard's
drafter features, while the tail lasts) → `update(totals)` (its forward yields the features not computed yet).
Each call runs a phase of rl/phases.py — the code GRPOTrainer runs in one process — over this worker's
PolicyReplica; what the worker adds is the drafter: versions from the hub, spot and tail training, features.
While it rolls out, the worker checks the hub between decode steps and swaps in any newer drafter at once.
A lone worker has no idle peer: with tail training it trains the drafter itself beside its own long tail
(drafter/tail_trainer.py: a background thread, a second CUDA stream), on the features its rollout kept.
The same class runs as a Ray actor (one process per worker) or as a thread of the in-process backend.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import gc
import hashlib
import logging
import sys
import time
import traceback
from pathlib import Path

import torch

from tlt.distributed.collective import ProcessGroupReducer, open_group_store
from tlt.distributed.hub import HubTimeout
from tlt.drafter.buffer import FeatureBuffer
from tlt.drafter.gate import HOLDOUT_EVERY, PublishGate
from tlt.drafter.tail_trainer import TailReport, TailTrainer, decoding_first
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer
from tlt.metrics.step import speculation_metrics
from tlt.metrics.timeline import WorkerTimeline
from tlt.models.eagle import EagleDrafter, layer_weight_names
from tlt.rl import phases
from tlt.rl.checkpoint import save_final_model
from tlt.rl.config_checks import tail_training_active
from tlt.rl.replica import PolicyReplica
from tlt.rl.run_checkpoint import (FINAL_DRAFTER_DIR, DrafterSnapshot, read_drafter, resume_replica,
                                   save_final_drafter, save_run_checkpoint)
from tlt.rollout.request import in_long_tail

log = logging.getLogger(__name__)


HUB_TIMEOUT_S = 300  # one hub call (a drafter version or a step's features are the largest it moves)
DECODING_SAID_EVERY_S = 10.0  # how often a rolling-out worker tells the hub it decodes (one small call)


class HubClient:
    """The hub's methods as plain calls, whether it is a local object or a Ray actor handle (each call bounded
    by HUB_TIMEOUT_S: a hub that does not answer is an error naming the call, not a hang)."""

    def __init__(self, hub):
        self._hub = hub
        self._remote = hasattr(getattr(hub, "latest_version", None), "remote")

    def __getattr__(self, name):
        method = getattr(self._hub, name)
        if not self._remote:
            return method

        def call(*args, **kwargs):
            import ray

            try:
                return ray.get(method.remote(*args, **kwargs), timeout=HUB_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise HubTimeout(f"the drafter hub did not answer {name}() within {HUB_TIMEOUT_S} s") from None
            except ray.exceptions.RayActorError as error:  # killed, or its process died: no worker is to blame
                raise HubTimeout(f"the drafter hub (a Ray actor) died during {name}() "
                                 f"({type(error).__name__}); nothing of this step was saved: `tlt train ... "
                                 f"--resume` continues from the last checkpoint") from None
        return call


class RolloutWorker:
    def __init__(self, config, rank: int, world_size: int, hub, *, threads: int | None = None, loaded=None,
                 task=None, reward=None, reducer=None):
        if threads:  # a Ray worker process: its own thread budget, and no per-process loading bars in the log
            torch.set_num_threads(threads)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        self.rank, self.world_size, self.config = rank, world_size, config
        self.hub = HubClient(hub)
        self.replica = PolicyReplica.build(config, loaded=loaded, task=task, reward=reward, announce=rank == 0)
        self.reducer = reducer
        self._group_store = None  # rank 0's rendezvous (Ray workers: open_group, then join_group)
        self.engine = self.replica.engine
        self.drafter = self.engine.drafter  # in the policy's dtype; the engine serves a copy in its rollout dtype
        self._carried: DrafterSnapshot | None = None  # a resumed checkpoint's drafter, kept while SD is off
        self._spot = None  # (training drafter, DrafterTrainer, local buffer, next feature sequence) once used
        self._last_publish: tuple | None = None  # (trainer, its steps, the version) of this worker's last publish
        self.tail = None   # a TailTrainer when this lone worker trains the drafter beside its own tail
        speculates = self.drafter is not None and self.engine.speculation is not None  # (a gate of 0: never)
        if speculates and tail_training_active(config.run, world_size):
            self.tail = self._tail_trainer()
        # The features the step's forwards yield, handed to the hub as they come, for the workers idle in the
        # tail to train on. None when nothing does (no drafter; one worker, or run.spot_training=false) or when
        # tail training takes the rollout's own instead: a copy per sample for nothing, and on CUDA a blocking one.
        idle_workers_train = config.run.spot_training and world_size > 1
        self.features = FeatureBuffer(10**9) if (self.drafter is not None and self.tail is None
                                                 and idle_workers_train) else None
        self._step = 0  # the RL step in progress (the controller names it with each rollout)
        self._examples, self._result, self._batch = None, None, None  # this step's shard, as its phases go
        self._last_poll = 0.0
        self._last_decoding_said = 0.0
        self._peak_rows = 0

    # -- process group -------------------------------------------------------------------------------------

    def open_group(self, timeout_s: float = 1800) -> int:
        """Rank 0: open the gradient group's rendezvous; returns its port (then every rank calls join_group)."""
        self._group_store = open_group_store(self.world_size, timeout_s)
        return self._group_store.port

    def join_group(self, address: str, backend: str = "gloo", timeout_s: float = 1800) -> None:
        """Join the workers' gradient group ("nccl" or "gloo": the placement's choice) at rank 0's `address`."""
        store = self._group_store if self.rank == 0 else None
        self.reducer = ProcessGroupReducer(self.rank, self.world_size, address, backend, timeout_s, store=store)

    # -- one RL step ----------------------------------------------------------------------------------------

    def sample_examples(self, step: int) -> list:
        """The step's prompts (every worker could draw them; rank 0 does, from the run seed and the step)."""
        return phases.sample_prompts(self.replica, step)

    def rollout(self, step: int, examples: list, lengths: list[int] | None = None, first: int = 0) -> dict:
        """Generate this worker's shard (`first`: its first prompt's position in the step); swap in newer
        drafters between decode steps. `lengths`: an equal-work replay (one length per sample; see
        rollout/replay.py)."""
        self._step, self._examples = step, examples
        self.timeline = WorkerTimeline(self.rank)
        if self.drafter is not None:
            self._sync_drafter(self.engine, force=True)
        self._peak_rows = 0
        collect = self.tail.collect(step) if self.tail is not None else None
        wall_start = time.time()
        try:
            # on CUDA with a tail trainer: decoding on a stream above the trainer's (`decoding_first`)
            with decoding_first(self.engine.device, self.tail is not None and self.config.run.tail_decode_priority):
                self._result = phases.rollout(self.replica, examples, step, between_steps=self._between_steps,
                                              lengths=lengths, collect_features=collect, first=first)
        finally:  # the training thread never outlives the rollout (nor a failed one)
            tail = self.tail.stop() if self.tail is not None else TailReport()
        self.timeline.add_rollout(self._result, wall_start, time.time())
        if tail.started_s is not None:
            self.timeline.record_overlay("tail_train", tail.started_s, tail.ended_s)
        return {"rollout": _lean_rollout(self._result), "end": time.time(),
                "tail_train": {**_report(tail), "held_back": self._held_back() if tail.started_s else 0}}

    def prepare(self) -> dict:
        """Rewards and advantages of this shard (the update's inputs), and old log-probs when the step takes
        several updates; that forward then also collects the drafter's features, which go to the hub."""
        started = time.time()
        self._batch = phases.score(self.replica, self._examples, self._result, self._step, self.features)
        self._hand_features()
        self.timeline.record("logprobs", started)
        return {"rewards": self._batch.rewards, "correct": self._batch.correct,
                "totals": phases.loss_totals(self.config, self._batch),
                "reward_failures": self._batch.reward_failures, "end": time.time()}

    def spot_train(self, step: int) -> dict:
        """Train the drafter until the hub says the last rollout ended (checked before every optimizer step).
        A failure is logged and reported; the drafter versions already published stay in service."""
        if self.drafter is None or not self.hub.acquire_trainer(step, self.rank):
            return {"trained_steps": 0, "published": [], "error": None, "held_back": 0}
        started = time.time()
        published, history, error = [], [], None
        stop = lambda: self.hub.should_stop(step)  # noqa: E731 - checked before every forward and optimizer step
        try:
            drafter, trainer, buffer = self._spot_state()
            every = max(1, self.config.run.publish_every)
            collecting = True
            self._pull_features(buffer)
            # Earlier steps' features (their updates' forwards collected them) train first: in a short idle window
            # (2 CPU cores: a second or two) collecting first left no time for a drafter step.
            trained_first = len(buffer) > 0
            while not stop():
                # This shard's features (its update would compute them, but only after the tail), one decoder
                # forward of a micro-batch at a time, taking turns with `every` drafter steps over all features
                # so far: a short idle window still trains.
                if collecting and not trained_first:
                    done = self._batch.features_done or 0  # (None: this batch keeps no features)
                    # no progress: all collected, or stopped
                    collecting = phases.collect_features(self.replica, self._batch, stop, limit=1) > done
                    self._hand_features()
                    self._pull_features(buffer)
                if not len(buffer):
                    if collecting:
                        continue
                    break
                trained_first = False
                chunk = trainer.train_until(stop, every)
                history.extend(chunk)
                if not chunk:
                    break
                published += [v for v in [self._publish(drafter, trainer, step, final=False)] if v is not None]
            if history:
                published += [v for v in [self._publish(drafter, trainer, step, final=True)] if v is not None]
        except Exception as exc:  # noqa: BLE001 - spot training must never take the RL step down
            error = f"{type(exc).__name__}: {exc}"
            log.warning("spot training failed on worker %d (SD keeps the last good drafter): %s\n%s",
                        self.rank, error, traceback.format_exc())
        self.timeline.record("spot_train", started)
        return {"trained_steps": len(history), "published": published, "error": error,
                "held_back": self._held_back(),
                "loss": history[-1]["loss"] if history else None,
                "top1": history[-1]["top1"] if history else None}

    def update(self, totals: dict) -> dict:
        """The policy update on this shard, normalized by the global totals, gradients summed across workers."""
        started = time.time()
        stats = phases.update(self.replica, self._batch, totals, reduce_gradients=self.reducer)
        self._hand_features()  # those the update's forward collected: the next step's spot training uses them
        self._examples, self._result, self._batch = None, None, None
        _return_free_memory()
        self.timeline.record("update", started)
        return {"update": stats, "timeline": self.timeline, "end": time.time(), "lr": self.replica.lr,
                "speculation_metrics": speculation_metrics(self.engine)}

    def evaluate(self, step: int) -> dict:
        """Held-out greedy accuracy after step `step`'s update, when due (replicas are identical: rank 0
        evaluates for all)."""
        return phases.evaluate(self.replica) if phases.held_out_due(self.replica, step) else {}

    def _hand_features(self) -> None:
        """Move the features collected so far to the hub, where every worker's spot training reads them."""
        entries = self.features.take() if self.features is not None else []
        if entries:
            self.hub.add_features(entries)

    # -- drafter versions -------------------------------------------------------------------------------------

    def _between_steps(self, engine) -> None:
        if time.monotonic() - self._last_decoding_said >= DECODING_SAID_EVERY_S:
            self.hub.decoding(self.rank)  # the driver ends a rollout that stops saying so (controller.STALL_S)
            self._last_decoding_said = time.monotonic()
        if self.drafter is not None and time.time() - self._last_poll >= self.config.run.swap_poll_s:
            self._sync_drafter(engine)
        self._peak_rows = max(self._peak_rows, engine.running_rows)
        if (self.tail is not None and not self.tail.running
                and in_long_tail(engine.running_rows, engine.waiting_samples, self._peak_rows)):
            # the latest version and optimizer state (a restored checkpoint's, the first time), loaded by the
            # training thread: the decode loop goes on meanwhile
            self.tail.start(prepare=self._spot_state)

    def _sync_drafter(self, engine, force: bool = False) -> None:
        self._last_poll = time.time()
        current = engine.drafter_version if engine.drafter_version is not None else -1
        if not force and self.hub.latest_version() <= current:
            return
        version, weights = self.hub.latest()
        if weights is None or version == engine.drafter_version:
            return
        self._fit_drafter(weights)
        self.drafter.load_state_dict(weights)
        # an untrained version (the starting drafter of a run without run.drafter) serves no SD step
        engine.set_drafter(self.drafter, version=version, trained=self.hub.is_trained(version))

    def _fit_drafter(self, weights: dict) -> None:
        """Rebuild this worker's drafter as the published weights' when they have another draft vocabulary or
        layer: a run resumed from a checkpoint written with another run.draft_vocab (or by a tlt that drafted over
        the whole vocabulary, or gave a Qwen3 target's new drafter Qwen3's layer) goes on with the checkpoint's
        drafter, which its trainer state fits."""
        theirs, ours = weights.get("draft_to_target"), self.drafter.draft_to_target
        same_layer = layer_weight_names(weights) == layer_weight_names(self.drafter.state_dict())
        if same_layer and ((theirs is None and ours is None) or (theirs is not None and ours is not None
                                                                 and torch.equal(theirs.cpu(), ours.cpu()))):
            return
        if self.rank == 0 and same_layer:
            size = "the whole vocabulary" if theirs is None else f"{theirs.shape[0]} tokens"
            log.warning("the run's drafter drafts over %s (a resumed run's checkpoint may hold another vocabulary "
                        "than run.draft_vocab makes): worker %d goes on with it instead of the %s it built", size,
                        self.rank, "whole vocabulary" if ours is None else f"{ours.shape[0]} tokens")
        vocab = None if theirs is None else theirs.cpu()
        if self.tail is not None and self.tail.running:  # first: its thread uses the training objects
            self.tail.stop()  # (not at a rollout's start, where a resume refits: its thread starts in the tail)
        rebuilt = (self.drafter.like(vocab) if same_layer
                   else EagleDrafter.for_weights(self.replica.model.config, weights, vocab))
        if self.rank == 0 and not same_layer:
            log.warning("the run's drafter has a %s layer (a resumed run's checkpoint may hold another than a new "
                        "drafter gets): worker %d goes on with it", rebuilt.config.model_type, self.rank)
        self.drafter = rebuilt.attach(self.replica.model)
        self._spot = None  # the training copy is made again, over the same vocabulary
        if self.tail is not None:
            self.tail = self._tail_trainer()

    def publish_initial_drafter(self) -> int:
        """Version 0: the run's starting drafter, with its warm-up optimizer state when the directory has one
        (a fresh Adam would take full-size steps on an already trained drafter and undo part of its warm-up)."""
        state = None
        source = self.config.run.drafter
        if source and DrafterTrainer.has_saved_state(source):
            trainer = self._spot_objects()[1]
            trainer.load_optimizer(source)
            # a copy: in-process, the hub's state would alias the live Adam moments training then moves on
            state = {"optimizer": copy.deepcopy(trainer.optimizer.state_dict()), "steps": trainer.steps}
        return self.hub.publish(_cpu_state(self.drafter), step=self._step, worker=self.rank, trainer_steps=0,
                                trainer_state=state, trained=bool(source))

    def _spot_objects(self) -> list:
        """[training drafter, DrafterTrainer, local FeatureBuffer, next hub feature sequence], made on first use.
        The training drafter is a separate copy: the engine's drafter keeps serving the published version."""
        if self._spot is None:
            drafter = self.drafter.like(self.drafter.draft_to_target).attach(self.engine.policy_forward)
            # the ramp for a warmed drafter only: a random one has nothing a kick could cost, and a later
            # trainer state (loaded in _spot_state) has had its first steps
            warmed = self.hub.is_trained(self.hub.latest_version())
            config = DrafterTrainConfig(lr=self.config.run.drafter_lr, seed=self.config.run.seed + self.rank,
                                        warmup_steps=self.config.run.drafter_lr_ramp if warmed else 0,
                                        temperature=self.config.rollout.temperature,
                                        cuda_graph=self.config.run.drafter_cuda_graph,
                                        unroll=self.config.run.drafter_unroll)
            gated = self.config.run.publish_gate
            buffer = FeatureBuffer(self.config.run.drafter_buffer_tokens, seed=self.config.run.seed + self.rank,
                                   holdout_every=HOLDOUT_EVERY if gated else 0)
            trainer = DrafterTrainer(drafter, buffer, config)
            self._spot = [drafter, trainer, buffer, 0, PublishGate(trainer) if gated else None]
        return self._spot

    def _tail_trainer(self) -> TailTrainer:
        drafter, trainer, _, _, _ = self._spot_objects()
        return TailTrainer(trainer, lambda final: self._publish(drafter, trainer, self._step, final),
                           publish_every=self.config.run.publish_every, device=self.engine.device)

    def _spot_state(self):
        """The training objects at the latest published version, with the last spot trainer's optimizer state."""
        drafter, trainer, buffer, _, gate = self._spot_objects()
        version, weights = self.hub.latest()
        drafter.load_state_dict(weights)
        if gate is not None:  # judged against what serves now (an untrained version: against nothing)
            gate.start(weights if self.hub.is_trained(version) else None)
        state = self.hub.trainer_state()
        if state is not None:
            # through load_optimizer: this run's run.drafter_lr, betas and weight decay, not the saved run's (a
            # resume with another drafter_lr kept the old one); a copy: in-process the hub's saved state would
            # otherwise move on with every later step of this optimizer
            trainer.load_optimizer("the hub's latest drafter trainer state", copy.deepcopy(state))
        return drafter, trainer, buffer

    def _pull_features(self, buffer: FeatureBuffer) -> None:
        sequence, entries = self.hub.features_since(self._spot[3])
        for entry in entries:
            buffer.add(entry.tokens, entry.features, entry.step)
        self._spot[3] = sequence

    def _held_back(self) -> int:
        """Versions the publish gate kept back in this worker's last training session."""
        gate = self._spot[4] if self._spot is not None else None
        return gate.held_back if gate is not None else 0

    def _publish(self, drafter, trainer, step: int, final: bool) -> int | None:
        """A new drafter version (None: the final one of a session whose last chunk already published these very
        weights, which only hands the hub the trainer's state: a second version of equal weights made every
        worker in its rollout reload them)."""
        state = None
        gate = self._spot[4]
        if final:  # a copy: in-process, the hub's state would alias the live Adam moments
            state = {"optimizer": copy.deepcopy(trainer.optimizer.state_dict()), "steps": trainer.steps}
            if self._last_publish == (id(trainer), trainer.steps, self.hub.latest_version()):
                self.hub.keep_trainer_state(state)
                return None
        if gate is not None and not gate.allows():  # no better than what serves: it keeps serving
            log.info("worker %d: drafter after %d steps not published (held-out depth-1 acceptance %s)",
                     self.rank, trainer.steps, gate.last)
            if final:
                self.hub.keep_trainer_state(state)
            return None
        weights = _cpu_state(drafter)
        version = self.hub.publish(weights, step=step, worker=self.rank, trainer_steps=trainer.steps,
                                   trainer_state=state)
        if gate is not None:
            gate.published(weights)
        self._last_publish = (id(trainer), trainer.steps, version)
        return version

    # -- checkpoints and checks -------------------------------------------------------------------------------

    def save(self, run_dir: str, step: int, extra: dict) -> str:
        """The run's checkpoint after `step` steps (replicas are identical: rank 0's copy is the run's), with
        the hub's latest drafter version and its trainer's optimizer state."""
        return str(save_run_checkpoint(run_dir, self.replica, step, drafter=self._drafter_snapshot(), extra=extra))

    def save_final(self, directory: str) -> str:
        """The policy as a Hugging Face model directory (replicas are identical: rank 0's copy) and, in a run
        with a trained drafter (spot-trained, or given as run.drafter), the drafter's latest version in its
        `drafter/` folder: the deployable byproduct."""
        snapshot = self._drafter_snapshot()
        if snapshot is not None and not snapshot.trained:
            snapshot = None  # the untrained drafter the run started from: nothing worth serving
        also = None if snapshot is None else (
            lambda staging: save_final_drafter(staging / FINAL_DRAFTER_DIR, self.replica.model.config, snapshot))
        return str(save_final_model(self.replica.model, self.replica.tokenizer, directory, also=also))

    def _drafter_snapshot(self) -> DrafterSnapshot | None:
        if self.drafter is None:
            return self._carried
        version, weights = self.hub.latest()
        return None if weights is None else DrafterSnapshot(version, weights, self.hub.trainer_state(),
                                                            self.hub.is_trained(version))

    def resume(self, checkpoint: str) -> int:
        """Restore this replica from the checkpoint; returns its step. A run resumed with SD off keeps the
        checkpoint's drafter as it is, in its own checkpoints and final/ (it was deleted with the checkpoints
        pruned after it: found by a trial), for a later --resume with SD on to go on with."""
        if self.drafter is None and self.rank == 0:
            self._carried = read_drafter(Path(checkpoint))
        return resume_replica(self.replica, checkpoint, self.rank)

    def speculation_state(self) -> dict | None:
        """This worker's speculation policy state (its bandit's experience), for the run's checkpoint."""
        policy = self.engine.speculation
        return None if policy is None else policy.state_dict()

    def restore_drafter(self, checkpoint: str) -> int:
        """Make the checkpoint's drafter (and its trainer state) the hub's current version again."""
        snapshot = read_drafter(checkpoint)
        if snapshot is None:
            return self.hub.latest_version()  # a checkpoint from a run without a drafter: keep the initial one
        self.hub.restore(snapshot.version, snapshot.weights, snapshot.trainer_state, snapshot.trained)
        return snapshot.version

    def parameter_digest(self) -> str:
        """SHA-256 of every policy parameter's bytes: equal digests = identical replicas."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.replica.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def ping(self) -> int:
        return self.rank


def freeze_long_lived() -> None:
    """Move every object alive now (the model, tokenizer, engine, the libraries' modules: ~370,000 objects with
    the default model) to the garbage collector's permanent generation, once the workers are built. A full
    collection walks every tracked object: ~200 ms on a 2-core CPU, paid by `_return_free_memory` after every
    update and by each full collection Python starts on its own, mid-rollout included (on a GPU a 135M model's
    update is ~1 s). After the freeze it walks what was made since: ~0.3 ms. Refcounting still frees frozen
    objects; only their cycles wait for `thaw_long_lived` (the in-process backend's shutdown: a process that
    builds runs one after another, as tests do, would otherwise keep each run's cycles)."""
    gc.collect()
    gc.freeze()


def thaw_long_lived() -> None:
    gc.unfreeze()


def _return_free_memory() -> None:
    """Hand the update's freed activations back to the OS. glibc keeps freed heap pages, so a worker would
    otherwise hold its peak (several GB for a 135M model's backward) while it waits for the next step."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to trim
            pass


def _cpu_state(module) -> dict:
    return {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}


def _report(tail: TailReport) -> dict:
    """A tail-training report in the shape of a spot-training result (the controller counts both alike; the
    timeline overlay gives its time)."""
    return {"trained_steps": tail.trained_steps, "published": tail.published, "error": tail.error,
            "loss": tail.loss, "top1": tail.top1, "stop_s": tail.stop_s}


def _lean_rollout(rollout):
    """The rollout without prompt ids (the controller needs tokens, reasons, versions and the trace)."""
    samples = [dataclasses.replace(s, prompt_ids=()) for s in rollout.samples]
    return dataclasses.replace(rollout, samples=samples)
