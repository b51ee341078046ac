"""Where the workers live: Ray actors (one process each) or threads of this process — one interface.

Both give `submit(rank, method, *args) -> future`, `wait_any(futures)`, `result(future)`, `hub` (the hub's
methods as plain calls) and `shutdown()`. A worker serves one call at a time, in order, like a Ray actor.
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import socket

from tlt.distributed.hub import DrafterHub
from tlt.distributed.worker import HubClient, RolloutWorker
from tlt.errors import TltError


class WorkerError(TltError):
    """A worker died or failed during a step."""


def threads_per_worker(config) -> int:
    if config.run.threads_per_worker > 0:
        return config.run.threads_per_worker
    return max(1, (os.cpu_count() or 1) // max(1, config.run.workers))


def make_backend(config, **kwargs):
    """run.backend: "ray", "inprocess", or "auto" (Ray for several workers when it is installed)."""
    from tlt.rl.config import BACKENDS, check_choice

    choice = config.run.backend
    check_choice("run.backend", choice, BACKENDS)  # load_config checked it; a config built in code may not be
    if choice == "auto":
        try:
            import ray  # noqa: F401
            choice = "ray" if config.run.workers > 1 else "inprocess"
        except ImportError:
            choice = "inprocess"
    if choice == "ray":
        return RayBackend(config, **kwargs)
    return InProcessBackend(config, **kwargs)


class InProcessBackend:
    """Workers as threads (one policy replica each). With one worker and a `loaded` model, that model is used
    as is; with several, each gets its own copy."""

    def __init__(self, config, *, loaded=None, task=None, reward=None):
        from tlt.distributed.collective import ThreadReducer

        size = config.run.workers
        if size < 1:
            raise TltError(f"run.workers must be >= 1, got {size}")
        self.size = size
        self._hub = DrafterHub(config.run.drafter_buffer_tokens)
        self.hub = HubClient(self._hub)
        reducer = ThreadReducer(size) if size > 1 else None
        self.workers = [
            RolloutWorker(config, rank, size, self._hub, loaded=_replica(loaded, size), task=task, reward=reward,
                          reducer=reducer.for_rank(rank) if reducer else None)
            for rank in range(size)]
        self._pools = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tlt-worker{r}")
                       for r in range(size)]

    def submit(self, rank: int, method: str, *args):
        return self._pools[rank].submit(getattr(self.workers[rank], method), *args)

    def wait_any(self, futures) -> list:
        done, _ = concurrent.futures.wait(list(futures), return_when=concurrent.futures.FIRST_COMPLETED)
        return list(done)

    def result(self, future):
        return future.result()

    def shutdown(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)


class RayBackend:
    """One Ray actor per worker (its own process, `threads_per_worker` CPU threads), a hub actor, and a gloo
    (NCCL on GPUs) process group among the workers for the gradient all-reduce. Workers load the model from
    config.model.path, or receive `loaded` (an in-memory model, e.g. in tests) through Ray's object store."""

    def __init__(self, config, *, loaded=None, task=None, reward=None):
        try:
            import ray
        except ImportError as error:
            raise TltError("run.backend=ray needs Ray: pip install 'tlt-rl[ray]'") from error
        self.size = config.run.workers
        threads = threads_per_worker(config)
        use_gpu = config.model.device not in (None, "cpu") or _cuda_available()
        if use_gpu and self.size > _cuda_devices():
            raise TltError(f"run.workers={self.size} asks for one GPU per worker, but this machine has "
                           f"{_cuda_devices()}: set run.workers={max(1, _cuda_devices())}")
        if not ray.is_initialized():
            # ERROR: Ray's start-up notices (e.g. its token-auth warning) would otherwise open every run's log
            ray.init(num_cpus=max(os.cpu_count() or 1, self.size * threads), include_dashboard=False,
                     log_to_driver=True, logging_level="ERROR")
        self._hub = ray.remote(DrafterHub).options(num_cpus=0).remote(config.run.drafter_buffer_tokens)
        self.hub = HubClient(self._hub)
        actor = ray.remote(_RayWorker).options(num_cpus=threads, num_gpus=1 if use_gpu else 0)
        self.workers = [actor.remote(config, rank, self.size, self._hub, threads=threads, loaded=loaded, task=task,
                                     reward=reward) for rank in range(self.size)]
        self._check(self._started([w.ping.remote() for w in self.workers]))
        if self.size > 1:
            address = f"127.0.0.1:{_free_port()}"
            ray.get([w.join_group.remote(address) for w in self.workers])

    def _started(self, pings) -> list[int]:
        """The ranks the workers answer with, or the first worker's own start-up error (bad model, task file,
        drafter...), raised here as itself rather than buried under Ray's ActorDiedError."""
        import ray

        try:
            answers = ray.get(pings, timeout=WORKER_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise WorkerError(f"the workers did not start within {WORKER_START_TIMEOUT_S} s (Ray could not place "
                              f"them, or loading the model hangs)") from None
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

    def wait_any(self, futures) -> list:
        import ray

        done, _ = ray.wait(list(futures), num_returns=1)
        return done

    def result(self, future):
        """The call's value; a worker's TltError (bad input met mid-step) comes back as itself."""
        import ray

        value = ray.get(future)
        if isinstance(value, _Failed):
            raise value.error from None
        return value

    def kill_worker(self, rank: int) -> None:
        """For fault tests: the worker process dies as if its machine had failed."""
        import ray

        ray.kill(self.workers[rank], no_restart=True)

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        ray.kill(self._hub, no_restart=True)


WORKER_START_TIMEOUT_S = 900  # a first run converts the default model's GGUF (about a minute) in every worker


class _RayWorker(RolloutWorker):
    """A worker whose start-up TltError is kept and handed back by `ping`: raised in an actor's constructor it
    would kill the actor, and the driver would see only Ray's ActorDiedError and a page of remote traceback."""

    def __init__(self, *args, **kwargs):
        self.start_error = None
        try:
            super().__init__(*args, **kwargs)
        except TltError as error:
            self.start_error = error

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


def _replica(loaded, size: int):
    if loaded is None or size == 1:
        return loaded
    return copy.deepcopy(loaded)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
