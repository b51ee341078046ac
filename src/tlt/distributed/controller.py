"""DistributedGRPO: drives one RL step over N rollout workers, and turns their idle tail time into drafter training.

A step: the prompts are sharded by group (a GRPO group never straddles workers, so advantages stay local) →
every worker rolls out its shard → as each finishes, it scores it (rewards; old log-probs only when the step
takes several updates) and, if others are still decoding, computes its shard's drafter features and trains the
drafter ("spot training"), publishing versions the long-tail workers pick up mid-rollout → when the last worker
has scored its shard, spot training is told to stop (it yields within one micro-batch or optimizer step, and
nothing waits on it before the update barrier) → every worker takes the same policy update (gradients summed
across workers; its forward yields the features not computed yet).
Each worker runs rl/phases.py's phases, as GRPOTrainer does in one process; this class only sequences them
across workers and merges their results (metrics/ computes the step metrics, the tail share and the timeline).
Same interface as GRPOTrainer (`train_step`, `step`, `save`, `resume`), so `tlt train` drives either.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from tlt.distributed import backends
from tlt.distributed.backends import WorkerError, make_backend
from tlt.distributed.placement import resolve_and_log
from tlt.errors import TltError, first_line
from tlt.metrics.step import merge_speculation_metrics, step_metrics, tail_time_share
from tlt.metrics.timeline import merge_step, time_shares
from tlt.rl.checkpoint import latest_checkpoint
from tlt.rl.phases import evaluation_due, merge_worker_updates
from tlt.rollout.request import RolloutResult

log = logging.getLogger(__name__)
STILL_WAITING_S = 900  # how often a wait for workers that have not answered says so
STALL_S = 1800        # a rolling-out worker that has not decoded a step for this long hangs: the step ends
STALL_CHECK_S = 60    # how often a wait for workers checks that the rolling-out ones still decode

# phases that run once self.step counts the step they belong to (a failed checkpoint of step 2 was reported as
# step 3's: found by QA)
AFTER_THE_STEP = ("evaluate", "speculation_state", "save", "save_final")


class DistributedGRPO:
    def __init__(self, config, *, placement=None, backend=None, **backend_kwargs):
        """placement: the config's Placement when the caller resolved it already (then `config` is the resolved
        one, as `tlt train` does to print its notes first); otherwise it is resolved here."""
        if placement is None:
            loaded = backend_kwargs.get("loaded")
            config, placement = resolve_and_log(
                config, device=next(loaded.model.parameters()).device.type if loaded is not None else None)
        self.placement = placement
        if config.rollout.prompts_per_step < config.run.workers:
            raise TltError(f"rollout.prompts_per_step={config.rollout.prompts_per_step} is fewer than "
                           f"run.workers={config.run.workers}: every worker needs at least one prompt")
        self.config = config  # run.workers and run.backend as placed (config.run.workers may have said "auto")
        self.backend = backend or make_backend(config, self.placement, **backend_kwargs)
        self.size = self.backend.size
        self.step = 0
        self.progress = False
        self.on_phase = None  # callable(text): the driver's status line, told when the rollout is over
        self.last_timeline: dict | None = None
        self.last_rollout: RolloutResult | None = None  # every worker's samples of the last step, prompt-major
        self.speculative = config.run.speculative != "off"
        self.spot_training = self.speculative and config.run.spot_training and self.size > 1
        if self.speculative:
            try:
                self._call(0, "publish_initial_drafter")
            except BaseException:  # nobody holds this controller to close it: the workers it started (and the
                if backend is None:  # process's frozen garbage collection, worker.freeze_long_lived) end here
                    self.backend.shutdown()
                raise

    # -- one RL step -----------------------------------------------------------------------------------------

    def train_step(self, lengths: list[int] | None = None) -> dict:
        """One RL step. `lengths` (benchmarks): an equal-work replay, every sample decodes exactly this many
        tokens, stop tokens ignored — one per sample, prompt-major, e.g. another run's `last_rollout` lengths."""
        step_start = time.time()
        examples = self._call(0, "sample_examples", self.step)
        shards = _shard(examples, self.size)
        replay = self._length_shards(lengths, shards)
        self.backend.hub.begin_step(self.step)
        # whether the drafter the rollouts start with has trained (an untrained one serves no SD step)
        ready = self.backend.hub.is_trained(self.backend.hub.latest_version()) if self.speculative else None
        rollouts, prepared, spot = self._run_workers(shards, replay)
        rollout_end = max(r["end"] for r in rollouts.values())
        totals = _sum_totals([prepared[r]["totals"] for r in range(self.size)])
        updates = self._gather({r: self.backend.submit(r, "update", totals) for r in range(self.size)}, "update")
        self.step += 1
        step_end = time.time()
        timeline = merge_step(self.step, [updates[r]["timeline"] for r in range(self.size)], step_start, step_end)
        self.last_timeline = timeline
        metrics = self._metrics(rollouts, prepared, spot, updates, timeline, ready, rollout_end - step_start,
                                step_end - rollout_end)
        if self.config.task.eval_size > 0 and evaluation_due(self.config, self.step):
            self._phase(f"step {self.step}: held-out evaluation")
        return {**metrics, **self._call(0, "evaluate", self.step)}  # {} unless rank 0 has a held-out set, due

    def _length_shards(self, lengths, shards: list[list]) -> list:
        if lengths is None:
            return [None] * self.size
        n = self.config.rollout.samples_per_prompt
        total = n * sum(len(shard) for shard in shards)
        if len(lengths) != total:
            raise TltError(f"a replay step needs one length per sample: {total} samples, {len(lengths)} lengths")
        parts, start = [], 0
        for shard in shards:
            parts.append([int(x) for x in lengths[start:start + n * len(shard)]])
            start += n * len(shard)
        return parts

    def _run_workers(self, shards: list[list], lengths: list) -> tuple[dict, dict, dict]:
        """rollout → prepare → (spot_train while any rollout is still running), per worker, as futures finish."""
        firsts = [sum(len(shard) for shard in shards[:r]) for r in range(self.size)]
        pending = {self.backend.submit(r, "rollout", self.step, shards[r], lengths[r], firsts[r]): ("rollout", r)
                   for r in range(self.size)}
        results = {"rollout": {}, "prepare": {}, "spot_train": {}}
        stopped = False
        try:
            while pending:
                for future in self._wait_any(pending):
                    phase, rank = pending.pop(future)
                    results[phase][rank] = self._result(future, phase, rank)
                    if phase == "rollout" and len(results["rollout"]) == self.size:
                        self._phase(f"step {self.step + 1}: log-probs and update")
                    if phase == "rollout":
                        pending[self.backend.submit(rank, "prepare")] = ("prepare", rank)
                    elif phase == "prepare" and self.spot_training and len(results["prepare"]) < self.size:
                        pending[self.backend.submit(rank, "spot_train", self.step)] = ("spot_train", rank)
                if not stopped and len(results["prepare"]) == self.size:
                    self.backend.hub.stop(self.step)  # the last worker is ready for the update: stop spot training
                    stopped = True
        except BaseException:
            # a worker failed: the idle ones' spot training would run on, and closing the workers wait for it. The
            # failure is the one to report: a hub that died with it would replace it with its own traceback.
            with contextlib.suppress(Exception):
                self.backend.hub.stop(self.step)
            raise
        return results["rollout"], results["prepare"], results["spot_train"]

    def _wait_any(self, pending: dict) -> list:
        """The calls that have finished, waiting at most CALL_TIMEOUT_S for one. Every STILL_WAITING_S without
        an answer it says what it waits for: a worker that hung (alive, stuck) said nothing for two hours
        (found by QA). A rollout whose worker has not decoded for STALL_S hangs: the step ends then."""
        calls = ", ".join(f"{phase} on worker {rank}" for phase, rank in pending.values())
        step = self._step_of(phase for phase, _ in pending.values())
        limit, waited, said = backends.CALL_TIMEOUT_S, 0.0, 0.0
        while True:
            wait = min(STALL_CHECK_S, limit - waited)
            try:
                return self.backend.wait_any(pending, timeout=wait)
            except TimeoutError:
                waited += wait
            if waited >= limit:
                raise WorkerError(f"RL step {step}: no worker answered (no answer within {limit:g} s) "
                                  f"while waiting for {calls}; nothing of this step was saved{self._next_move()}")
            self._end_a_stalled_rollout(pending)
            if waited - said >= STILL_WAITING_S:
                said = waited
                log.warning("RL step %d: still waiting for %s after %.0f min (a long rollout, or a worker that "
                            "hangs: it is given %.0f min; Ctrl-C three times aborts)", step, calls,
                            waited / 60, limit / 60)

    def _end_a_stalled_rollout(self, pending: dict) -> None:
        """A rolling-out worker tells the hub it decodes every few seconds; one silent for STALL_S hangs (a
        decode step never takes minutes), alive or not: waited for up to CALL_TIMEOUT_S, two hours (QA)."""
        rolling = [rank for phase, rank in pending.values() if phase == "rollout"]
        if not rolling:
            return
        silent = {rank: s for rank, s in self.backend.hub.silent_for(rolling).items() if s >= STALL_S}
        if silent:
            rank, seconds = max(silent.items(), key=lambda item: item[1])
            raise WorkerError(f"worker {rank} has decoded nothing for {seconds / 60:.0f} min during the rollout of "
                              f"RL step {self.step + 1}: it hangs; nothing of this step was saved"
                              f"{self._next_move()}")

    def _phase(self, text: str) -> None:
        """Tell the driver's display what the step is doing (minutes pass between rollout and step line)."""
        if self.on_phase is not None:
            self.on_phase(text)

    def _gather(self, futures: dict, phase: str, abort: bool = True) -> dict:
        """Every worker's result, taken as each finishes, so a failure is raised at once and names its worker:
        waited for in rank order, rank 0 sat in the gradient sum for a worker that had failed (30 minutes), then
        was named as the one that failed."""
        pending = {future: (phase, rank) for rank, future in futures.items()}
        results = {}
        try:
            while pending:
                for future in self._wait_any(pending):
                    rank = pending.pop(future)[1]
                    results[rank] = self._result(future, phase, rank)
        except BaseException:
            if abort:  # (one worker's call: nobody waits in a sum, and a caller going on would find it broken)
                self.backend.abort_collectives()  # the others wait in a sum the failed worker never joins
            raise
        return results

    def _call(self, rank: int, method: str, *args):
        """One worker's call, waited for as `_gather` waits: a worker stopped mid-save (SIGSTOP) left the driver
        silent in the checkpoint for two hours (found by a trial); now it says what it waits for."""
        return self._gather({rank: self.backend.submit(rank, method, *args)}, method, abort=False)[rank]

    def _result(self, future, phase: str, rank: int):
        try:
            return self.backend.result(future)
        except TltError:
            raise  # bad input met by a worker (a prompt too long, a broken reward...): its own message
        except Exception as error:  # noqa: BLE001 - any worker failure ends the step with one clear message
            step = self._step_of([phase])
            raise WorkerError(
                f"worker {rank} failed during {phase} of RL step {step} "
                f"({type(error).__name__}: {first_line(error)}){_memory_hint(error)}; nothing of this step was "
                f"saved{self._next_move()}"
            ) from error

    def _step_of(self, phases) -> int:
        """The RL step calls belong to: the one under way, or (evaluation, checkpoint) the one just completed."""
        return self.step if all(phase in AFTER_THE_STEP for phase in phases) else self.step + 1

    def _next_move(self) -> str:
        """Point at --resume only when there is a checkpoint to resume from."""
        checkpoint = latest_checkpoint(self.config.run.out_dir)
        if checkpoint is None:
            return ""
        return f" — `tlt train ... --resume` continues from {checkpoint.name}"

    # -- metrics ----------------------------------------------------------------------------------------------

    def _metrics(self, rollouts, prepared, spot, updates, timeline, ready, rollout_s, train_s) -> dict:
        ranks = range(self.size)
        merged = RolloutResult([s for r in ranks for s in rollouts[r]["rollout"].samples],
                               [t for r in ranks for t in rollouts[r]["rollout"].steps],
                               max(rollouts[r]["rollout"].wall_s for r in ranks))
        self.last_rollout = merged
        rewards = torch.cat([prepared[r]["rewards"] for r in ranks])
        correct = torch.cat([prepared[r]["correct"] for r in ranks])
        update = merge_worker_updates([updates[r]["update"] for r in ranks])
        metrics = step_metrics(merged, rewards, correct, update, rollout_s, train_s,
                               sum(prepared[r]["reward_failures"] for r in ranks))
        shares = time_shares(timeline)
        # A lone worker's tail training (during its rollout) counts with spot training: both train the drafter.
        trainers = list(spot.values()) + [rollouts[r]["tail_train"] for r in ranks]
        published = [v for result in trainers for v in result["published"]]
        served = [s.drafter_versions for s in merged.samples]
        version = self.backend.hub.latest_version() if self.speculative else None
        metrics.update({
            "step_s": timeline["duration"],
            "rollout_tail_share": tail_time_share(
                [(rollouts[r]["end"] - rollouts[r]["rollout"].wall_s, rollouts[r]["rollout"].steps) for r in ranks]),
            "workers": self.size,
            "idle_fraction": shares["idle"],
            "spot_train_share": shares["spot_train"],
            "tail_train_share": shares["tail_train"],
            # of the rollout's time: waiting for the tail trainer's last micro-step and publish after decoding
            "tail_stop_s": sum(rollouts[r]["tail_train"]["stop_s"] for r in ranks),
            "spot_train_steps": sum(result["trained_steps"] for result in trainers),
            "spot_train_errors": sum(result["error"] is not None for result in trainers),
            "drafter_versions": published,
            # trained versions the publish gate kept back: no better than the serving one on held-out features
            "drafter_versions_held_back": sum(result.get("held_back", 0) for result in trainers),
            "drafter_version": version,
            # the version the rollouts started with had trained (false: SD waited for a trained one)
            "drafter_trained": ready,
            # versions that served a sample's SD steps (an untrained version serves none): > 1 = hot-swapped
            "samples_hot_swapped": sum(len(v) > 1 for v in served),
            "drafter_versions_per_sample": [len(v) for v in served],  # the full lists are in the RolloutResult
            "lr": updates[0]["lr"],
            **merge_speculation_metrics([updates[r]["speculation_metrics"] for r in ranks]),
        })
        return metrics

    # -- checkpoints ------------------------------------------------------------------------------------------

    def save(self, run_dir) -> str:
        """Rank 0 writes the checkpoint (replicas are identical), with every worker's bandit state: each learned
        its own batch sizes (a resumed run gave every worker rank 0's; found by review)."""
        states = self._gather({r: self.backend.submit(r, "speculation_state") for r in range(self.size)}, "save")
        extra = {"workers": self.size, "speculation_by_rank": [states[r] for r in range(self.size)]}
        return self._call(0, "save", str(run_dir), self.step, extra)

    def save_final(self, directory) -> str:
        return self._call(0, "save_final", str(directory))

    def resume(self, checkpoint) -> None:
        steps = self._gather({r: self.backend.submit(r, "resume", str(checkpoint)) for r in range(self.size)},
                             "resume")
        self.step = steps[0]
        if self.speculative:
            self._call(0, "restore_drafter", str(checkpoint))

    def parameter_digests(self) -> list[str]:
        return [self._call(r, "parameter_digest") for r in range(self.size)]

    def close(self) -> None:
        self.backend.shutdown()


def _shard(examples: list, size: int) -> list[list]:
    """Contiguous, near-equal shards of prompts (each prompt's n samples stay together)."""
    base, extra = divmod(len(examples), size)
    shards, start = [], 0
    for rank in range(size):
        count = base + (rank < extra)
        shards.append(examples[start:start + count])
        start += count
    return shards


def _sum_totals(parts: list[dict]) -> dict:
    totals = {key: sum(part[key] for part in parts) for key in ("tokens", "sequences")}
    totals["max_tokens"] = parts[0]["max_tokens"]
    return totals


# How an allocation failure reads: torch's CUDA OutOfMemoryError, and its CPU allocator's RuntimeError
OUT_OF_MEMORY = ("out of memory", "can't allocate memory")


def _memory_hint(error: BaseException) -> str:
    """What lowers a step's memory, when a worker ran out of it (a CLI trial's 8k-token prompt failed its update
    with the allocator's message only)."""
    if not (isinstance(error, (MemoryError, torch.OutOfMemoryError))
            or any(marker in str(error).lower() for marker in OUT_OF_MEMORY)):
        return ""
    return (" — out of memory: optim.grad_checkpointing=true, a smaller optim.micro_batch_size or "
            "rollout.max_batch_size, or shorter prompts and rollout.max_new_tokens need less")
