"""Where the workers live: Ray actors (one process each) or threads of this process — one interface.

Both give `submit(rank, method, *args) -> future`, `wait_any(futures)`, `result(future)`, `hub` (the hub's
methods as plain calls) and `shutdown()`. A worker serves one call at a time, in order, like a Ray actor.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import os
import signal
import threading

import torch

from tlt.distributed.collective import ThreadReducer
from tlt.distributed.hub import DrafterHub
from tlt.distributed.placement import check_ray_resources
from tlt.distributed.worker import HubClient, RolloutWorker, freeze_long_lived, thaw_long_lived
from tlt.errors import TltError

log = logging.getLogger(__name__)


class WorkerError(TltError):
    """A worker died, failed or did not answer in time during a step."""


# Every wait is bounded. A worker call (a shard's rollout, its log-probs, an update) gets CALL_TIMEOUT_S; a hung
# collective ends sooner, at the process group's own GROUP_TIMEOUT_S, and comes back as the worker's error.
CALL_TIMEOUT_S = 2 * 3600
WORKER_START_TIMEOUT_S = 900  # a first run converts the default model's GGUF (about a minute) in every worker
PLACEMENT_TIMEOUT_S = 60      # Ray reserving the workers' CPUs and GPUs (before any model loads)
GROUP_TIMEOUT_S = 1800        # forming the gradient group, and any one all-reduce in it
SHUTDOWN_TIMEOUT_S = 10       # killing the actors and freeing their reservation (seconds when Ray is alive)


def threads_per_worker(config) -> int:
    if config.run.threads_per_worker > 0:
        return config.run.threads_per_worker
    return max(1, (os.cpu_count() or 1) // max(1, config.run.workers))


@contextlib.contextmanager
def _keeping_signal_handlers():
    """The process's SIGTERM and SIGINT handlers as they were before the block (only the main thread may set
    handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def make_backend(config, placement, **kwargs):
    """The backend `placement` names (see distributed/placement.py); `config` has concrete run.workers."""
    if placement.backend == "ray":
        return RayBackend(config, placement, **kwargs)
    return InProcessBackend(config, placement, **kwargs)


class InProcessBackend:
    """Workers as threads (one policy replica each), each on its placement's device. With one worker and a
    `loaded` model, that model is used as is; with several, each gets its own copy on its own device. Each
    worker is built and called on its own thread, whose current CUDA device is the worker's."""

    def __init__(self, config, placement, *, loaded=None, task=None, reward=None):
        size = placement.workers
        self.size = size
        # one pool for the process (torch's is global): run.threads_per_worker for each of its workers
        torch.set_num_threads(threads_per_worker(config) * size)
        self._hub = DrafterHub(config.run.drafter_buffer_tokens)
        self.hub = HubClient(self._hub)
        reducer = self._reducer = ThreadReducer(size) if size > 1 else None
        self._pools = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tlt-worker{r}",
                                                             initializer=_use_device, initargs=(device,))
                       for r, device in enumerate(placement.devices)]
        self.workers = []
        self._frozen = False  # freeze_long_lived() done: shutdown thaws
        try:  # one at a time, as before: model loading and seeded initialization never interleave
            for rank, (pool, device) in enumerate(zip(self._pools, placement.devices)):
                self.workers.append(pool.submit(
                    _start_worker, _on_device(config, device), rank, size, self._hub, _replica(loaded, size, device),
                    task, reward, reducer.for_rank(rank) if reducer else None).result(WORKER_START_TIMEOUT_S))
        except concurrent.futures.TimeoutError:
            self.shutdown(wait=False)
            raise WorkerError(f"in-process worker {len(self.workers)} did not start within "
                              f"{WORKER_START_TIMEOUT_S} s (loading the model hangs)") from None
        except BaseException:  # its own start-up error (bad model, task file...), raised as itself
            self.shutdown()
            raise
        freeze_long_lived()
        self._frozen = True

    def submit(self, rank: int, method: str, *args):
        return self._pools[rank].submit(getattr(self.workers[rank], method), *args)

    def wait_any(self, futures, timeout: float | None = None) -> list:
        timeout = CALL_TIMEOUT_S if timeout is None else timeout
        done, _ = concurrent.futures.wait(list(futures), timeout=timeout,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        if not done:
            raise TimeoutError(f"no answer within {timeout:g} s")
        return list(done)

    def result(self, future, timeout: float | None = None):
        timeout = CALL_TIMEOUT_S if timeout is None else timeout
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no answer within {timeout:g} s") from None

    def abort_collectives(self) -> None:
        """Release workers waiting in a gradient sum for a worker that failed."""
        if self._reducer is not None:
            self._reducer.abort()

    def shutdown(self, wait: bool = True) -> None:
        for pool in self._pools:
            pool.shutdown(wait=wait)
        if self._frozen:
            self._frozen = False
            thaw_long_lived()


class RayBackend:
    """One Ray actor per worker (its own process, `threads_per_worker` CPU threads, `placement.gpus_per_worker`
    of a GPU), a hub actor, and a process group among the workers for the gradient all-reduce (NCCL when each
    holds a whole GPU, gloo otherwise). Before any actor starts, Ray's cluster is checked and the workers' CPUs
    and GPUs reserved (a placement group, bounded wait), so a placement Ray cannot satisfy fails in seconds.
    Workers load the model from config.model.path, or receive `loaded` (an in-memory model, e.g. in tests)
    through Ray's object store."""

    def __init__(self, config, placement, *, loaded=None, task=None, reward=None):
        try:
            import ray
        except ImportError as error:
            raise TltError("run.backend=ray needs Ray: pip install 'tlt-rl[ray]'") from error
        self.size = placement.workers
        self.workers, self._hub, self._group = [], None, None
        threads = threads_per_worker(config)
        if not ray.is_initialized():
            with _keeping_signal_handlers():  # ray.init puts its own in place of tlt's: cli._signals_as_one_interrupt
                # ERROR: Ray's start-up notices (e.g. its token-auth warning) would otherwise open every run's log
                ray.init(num_cpus=max(os.cpu_count() or 1, self.size * threads), include_dashboard=False,
                         log_to_driver=True, logging_level="ERROR")
        check_ray_resources(placement, threads, ray.cluster_resources())
        self._group = self._reserve(placement, threads)
        try:
            self._start(config, placement, threads, loaded=loaded, task=task, reward=reward)
        except BaseException:
            self.shutdown()  # a failed start must not keep the reservation: the next run in this session needs it
            raise

    def _start(self, config, placement, threads: int, **inputs) -> None:
        """The hub, the workers (each answering once loaded) and their gradient group."""
        import ray

        self._hub = ray.remote(DrafterHub).options(num_cpus=0).remote(config.run.drafter_buffer_tokens)
        self.hub = HubClient(self._hub)
        config = _on_device(config, placement.devices[0])  # Ray: every actor's GPU is its own `cuda`
        actor = ray.remote(_RayWorker)
        self.workers = [self._options(actor, rank, placement, threads).remote(
            config, rank, self.size, self._hub, threads=threads, **inputs) for rank in range(self.size)]
        self._check(self._started([w.ping.remote() for w in self.workers]))
        if self.size > 1:
            what = f"the workers did not form their {placement.collective} group"
            port = self._wait([self.workers[0].open_group.remote(GROUP_TIMEOUT_S)], 120, what)[0]
            self._wait([w.join_group.remote(f"127.0.0.1:{port}", placement.collective, GROUP_TIMEOUT_S)
                        for w in self.workers], GROUP_TIMEOUT_S + 60, what)

    def _reserve(self, placement, threads: int):
        """A placement group holding every worker's CPUs and GPU share, ready within PLACEMENT_TIMEOUT_S."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = {"CPU": float(threads)}
        if placement.gpus_per_worker > 0:
            bundle["GPU"] = placement.gpus_per_worker
        group = placement_group([dict(bundle) for _ in range(self.size)], strategy="PACK")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise WorkerError(f"Ray could not reserve {self.size} x {bundle} for the workers within "
                              f"{PLACEMENT_TIMEOUT_S} s (free: {_resources(ray.available_resources())}): lower "
                              f"run.workers, run.gpus_per_worker or run.threads_per_worker") from None
        return group

    def _options(self, actor, rank: int, placement, threads: int):
        """Worker `rank` in its reserved bundle: its CPU threads and its share of a GPU."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=rank)
        return actor.options(num_cpus=threads, num_gpus=placement.gpus_per_worker, scheduling_strategy=strategy)

    def _wait(self, refs, timeout: float, what: str):
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise WorkerError(f"{what} within {timeout:g} s") from None

    def _started(self, pings) -> list[int]:
        """The ranks the workers answer with, or the first worker's own start-up error (bad model, task file,
        drafter...), raised here as itself rather than buried under Ray's ActorDiedError."""
        import ray

        try:
            answers = ray.get(pings, timeout=WORKER_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise WorkerError(f"the workers did not start within {WORKER_START_TIMEOUT_S} s (their resources were "
                              f"reserved: loading the model hangs)") from None
        except ray.exceptions.RayError as error:
            self.shutdown()
            raise WorkerError(f"a worker died while starting: {_last_line(error)}") from None
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed:
            self.shutdown()
            raise failed[0]
        return answers

    def _check(self, ranks):
        if sorted(ranks) != list(range(self.size)):
            raise WorkerError(f"workers answered as ranks {ranks}, expected 0..{self.size - 1}")

    def submit(self, rank: int, method: str, *args):
        return self.workers[rank].call.remote(method, *args)

    def wait_any(self, futures, timeout: float | None = None) -> list:
        import ray

        timeout = CALL_TIMEOUT_S if timeout is None else timeout
        done, _ = ray.wait(list(futures), num_returns=1, timeout=timeout)
        if not done:
            raise TimeoutError(f"no answer within {timeout:g} s")
        return done

    def result(self, future, timeout: float | None = None):
        """The call's value; a worker's TltError (bad input met mid-step) comes back as itself."""
        import ray

        timeout = CALL_TIMEOUT_S if timeout is None else timeout
        try:
            value = ray.get(future, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"no answer within {timeout:g} s") from None
        if isinstance(value, _Failed):
            raise value.error from None
        return value

    def abort_collectives(self) -> None:
        """Nothing to release here: a gloo all-reduce cannot be interrupted from outside; the driver raises the
        failed worker's error at once and shutting the actors down ends the others' wait."""

    def kill_worker(self, rank: int) -> None:
        """For fault tests: the worker process dies as if its machine had failed."""
        import ray

        ray.kill(self.workers[rank], no_restart=True)

    def shutdown(self) -> None:
        """Kill the actors and free their reservation, waiting SHUTDOWN_TIMEOUT_S at most: a SIGTERM to the whole
        process group (what `timeout`, SLURM's scancel and systemd send) also kills Ray's head processes, which
        share the group, and then every call here waited 60 s for a GCS that is gone."""
        release = threading.Thread(target=self._release, name="ray-shutdown", daemon=True)
        release.start()
        release.join(SHUTDOWN_TIMEOUT_S)
        if release.is_alive():
            log.warning("Ray did not answer within %g s while shutting down (its head processes were likely killed "
                        "by the same signal): leaving without waiting for it", SHUTDOWN_TIMEOUT_S)

    def _release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        if self._hub is not None:
            ray.kill(self._hub, no_restart=True)
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None


class _RayWorker(RolloutWorker):
    """A worker whose start-up TltError is kept and handed back by `ping`: raised in an actor's constructor it
    would kill the actor, and the driver would see only Ray's ActorDiedError and a page of remote traceback."""

    def __init__(self, *args, **kwargs):
        self.start_error = None
        try:
            super().__init__(*args, **kwargs)
        except TltError as error:
            self.start_error = error
        freeze_long_lived()  # the actor's process is this worker's: nothing to thaw before it ends

    def ping(self):
        return self.start_error if self.start_error is not None else super().ping()

    def call(self, method: str, *args):
        """A step's call. Its TltError comes back as a value: raised, it would reach the driver wrapped in
        RayTaskError, and a second worker's failure that the driver never collects (it stops at the first)
        would be printed by Ray as an 'Unhandled error' with a remote traceback."""
        try:
            return getattr(self, method)(*args)
        except TltError as error:
            return _Failed(error)


class _Failed:
    """A worker call's TltError, handed back as a value (see `_RayWorker.call`)."""

    def __init__(self, error: TltError):
        self.error = error


def _last_line(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def _replica(loaded, size: int, device: str):
    """The in-memory model for one in-process worker: itself for a single worker, else a copy on `device`."""
    if loaded is None:
        return None
    import torch

    replica = loaded if size == 1 else copy.deepcopy(loaded)
    current, target = next(replica.model.parameters()).device, torch.device(device)
    if current.type != target.type or (target.index is not None and current.index != target.index):
        replica.model.to(target)
    return replica


def _on_device(config, device: str):
    """The config one worker loads its model with (model.device = its placement's device)."""
    if config.model.device == device:
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))


def _use_device(device: str) -> None:
    """A worker thread's initializer: its CUDA calls (graphs, streams, allocations) go to its own GPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def _start_worker(config, rank, size, hub, loaded, task, reward, reducer):
    return RolloutWorker(config, rank, size, hub, loaded=loaded, task=task, reward=reward, reducer=reducer)


def _resources(resources: dict) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in sorted(resources.items()) if key in ("CPU", "GPU")) or "none"
