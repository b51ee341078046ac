"""Where the workers go: how many, on which device, how much of a GPU each Ray actor asks for, which collective.

`plan(...)` is a pure function of the request (`run.workers`, `run.gpus_per_worker`, `run.backend`) and the
machine (device kind, visible GPUs, whether Ray is installed); it returns a `Placement` or raises one
`PlacementError` naming the keys to change. The rules:

- `run.workers=auto`: one worker per device: one per GPU on CUDA (so 1 on a one-GPU machine), `1 /
  run.gpus_per_worker` per GPU when a fraction packs several; 1 on the CPU (all its cores: on 2 cores one worker
  ran the same work 1.15-1.27x faster than two, SD off and on, docs/benchmarks.md section 12); 1 on any other
  accelerator. A lone worker trains its drafter beside its own tail (`run.tail_training`).
- A GPU holds at most floor(1 / run.gpus_per_worker) workers (default 1: a whole GPU each). More workers than
  that fails here, before anything loads: never N full replicas and optimizers silently stacked on one GPU.
- Ray actors ask for `run.gpus_per_worker` GPUs each (Ray sets each actor's CUDA_VISIBLE_DEVICES, so its GPU is
  its `cuda`); in-process workers are spread over the GPUs, worker r on `cuda:{r % gpus}`.
- Gradients: NCCL only between Ray workers that each hold a whole GPU (NCCL refuses two ranks on one device);
  gloo between processes otherwise (CPU, or GPUs shared by fractional actors); threads sum in-process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
from dataclasses import dataclass

from tlt.errors import TltError
from tlt.rl.config_checks import tail_training_active

AUTO = "auto"
CPU_DEFAULT_WORKERS = 1  # CPU: one worker on all cores (faster than two splitting them: module docstring)


class PlacementError(TltError):
    """Workers that cannot be placed on this machine as asked."""


@dataclass(frozen=True)
class Placement:
    workers: int
    backend: str                 # "ray" or "inprocess"
    device: str                  # device kind: "cpu", "cuda", or another accelerator's
    gpus: int                    # GPUs the workers occupy at most (0 off CUDA)
    gpus_per_worker: float       # what each Ray actor asks Ray for (0 off CUDA)
    devices: tuple[str, ...]     # the torch device each worker loads its replica on (Ray: as the actor sees it)
    collective: str              # gradient sum: "none" (one worker), "threads", "gloo" or "nccl"

    def describe(self) -> str:
        where = f"{self.gpus} GPU(s), {self.gpus_per_worker:g} GPU each" if self.gpus else self.device
        return (f"{self.workers} worker(s) on {where}, {self.backend}"
                + (f", {self.collective} all-reduce" if self.collective != "none" else ""))


def plan(workers, *, device: str, gpus: int, gpus_per_worker: float = 1.0, backend: str = AUTO,
         ray_installed: bool = False, at_most: int | None = None) -> Placement:
    """The placement of `workers` ("auto" or an int >= 1) on a machine with `device` (a torch device string:
    "cpu", "cuda", "cuda:1", "mps"...) and `gpus` visible CUDA GPUs. `backend`: "auto", "ray" or "inprocess".
    `at_most` caps what "auto" picks (a step's prompts: every worker needs one)."""
    _check_request(workers, gpus_per_worker, backend)
    cap = at_most if at_most is not None else 1 << 30
    kind, _, index = device.partition(":")
    if kind == "cpu":
        count = min(CPU_DEFAULT_WORKERS, cap) if workers == AUTO else workers
        chosen = _backend(backend, count, ray_installed)
        collective = "none" if count == 1 else ("gloo" if chosen == "ray" else "threads")
        return Placement(count, chosen, "cpu", 0, 0.0, ("cpu",) * count, collective)
    if kind == "cuda":
        if gpus < 1:
            raise PlacementError(f"model.device={device} but no CUDA GPU is visible here: set model.device=cpu, or "
                                 f"leave model.device unset (CUDA when available, else CPU)")
        if index and int(index) >= gpus:
            raise PlacementError(f"model.device={device}, but this machine has {gpus} GPU(s) (cuda:0..{gpus - 1})")
        usable = 1 if index else gpus
    else:  # another accelerator (mps, xpu...): one device, like a single GPU; Ray does not schedule it
        usable = 1
    per_gpu = math.floor(1 / gpus_per_worker + 1e-9)
    capacity = usable * per_gpu
    count = min(capacity, cap) if workers == AUTO else workers
    if count > capacity:
        raise PlacementError(_too_many(count, usable, per_gpu, gpus_per_worker, device))
    chosen = _backend(backend, count, ray_installed and not index)
    if index and chosen == "ray":
        raise PlacementError(f"model.device={device} pins one GPU, but Ray gives each worker a GPU of its own: set "
                             f"model.device=cuda (choose GPUs with CUDA_VISIBLE_DEVICES), or run.backend=inprocess")
    if kind != "cuda":
        collective = "none" if count == 1 else ("gloo" if chosen == "ray" else "threads")
        return Placement(count, chosen, kind, 0, 0.0, (device,) * count, collective)
    if chosen == "ray":
        collective = "none" if count == 1 else ("nccl" if per_gpu == 1 else "gloo")
        return Placement(count, "ray", "cuda", min(usable, count), gpus_per_worker, ("cuda",) * count, collective)
    devices = tuple(device if index else f"cuda:{rank % usable}" for rank in range(count))
    return Placement(count, "inprocess", "cuda", min(usable, count), gpus_per_worker, devices,
                     "none" if count == 1 else "threads")


def _check_request(workers, gpus_per_worker: float, backend: str) -> None:
    if workers != AUTO and not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1):
        raise PlacementError(f"run.workers must be an integer >= 1 (or auto), got {workers!r}")
    if not (isinstance(gpus_per_worker, (int, float)) and 0 < gpus_per_worker <= 1):
        raise PlacementError(f"run.gpus_per_worker must be in (0, 1] (0.5 puts two workers on each GPU), got "
                             f"{gpus_per_worker!r}")
    if backend not in (AUTO, "ray", "inprocess"):
        raise PlacementError(f"run.backend must be one of auto, ray, inprocess, got {backend!r}")


def _backend(backend: str, workers: int, ray_installed: bool) -> str:
    if backend == AUTO:
        return "ray" if ray_installed and workers > 1 else "inprocess"
    return backend


def _too_many(count: int, usable: int, per_gpu: int, share: float, device: str) -> str:
    have = f"this machine has {usable} GPU(s)" if device == "cuda" else f"model.device={device} is one device"
    packed = math.ceil(count / usable)  # workers per GPU that would fit them all
    fraction = math.floor(1000 / packed) / 1000  # rounded down: Ray must fit `packed` of them in one GPU
    return (f"run.workers={count} with run.gpus_per_worker={share:g} needs {math.ceil(count / per_gpu)} GPU(s) "
            f"(at most {per_gpu} worker(s) per GPU), but {have}: set run.workers={usable * per_gpu} (or auto), or "
            f"run.gpus_per_worker={fraction:g} to put {packed} workers on each GPU (each a full policy replica "
            f"with its optimizer)")


# -- the machine, and the config it turns into ---------------------------------------------------------------------

def placement_for(config, device: str | None = None) -> Placement:
    """`plan` for this config on this machine. The device: model.device, else `device` (e.g. where an in-memory
    model already is), else CUDA when a GPU is visible, else CPU."""
    import torch

    cuda = torch.cuda.is_available()
    device = config.model.device or device or ("cuda" if cuda else "cpu")
    return plan(config.run.workers, device=device, gpus=torch.cuda.device_count() if cuda else 0,
                gpus_per_worker=config.run.gpus_per_worker, backend=config.run.backend,
                ray_installed=importlib.util.find_spec("ray") is not None, at_most=config.rollout.prompts_per_step)


def resolve(config, device: str | None = None):
    """(config with run.workers and run.backend made concrete, its Placement, notes for the user).

    One case changes more: `run.workers=auto` that comes to a single worker with a speculative mode, no
    `run.drafter` and `run.tail_training=off` has no way to train a drafter: that run decodes without speculation
    (lossless either way: the same samples in distribution) and a note says so. An explicit `run.workers=1` there
    stays an error."""
    placement = placement_for(config, device)
    run = dataclasses.replace(config.run, workers=placement.workers, backend=placement.backend)
    notes = []
    if (config.run.workers == AUTO and placement.workers == 1 and run.speculative != "off" and not run.drafter
            and not tail_training_active(run, 1)):
        run = dataclasses.replace(run, speculative="off")
        notes.append(f"run.speculative={config.run.speculative} without run.drafter needs a second worker to "
                     f"spot-train the drafter, run.workers=auto gives one here ({placement.describe()}) and "
                     f"run.tail_training=off: this run decodes without speculation. Give run.drafter (tlt drafter "
                     f"warmup) to speculate, or run.tail_training=auto to train it beside this worker's own tail.")
    return dataclasses.replace(config, run=run), placement, notes


def resolve_and_log(config, device: str | None = None):
    """`resolve`, with its notes logged as warnings (for drivers without a console of their own)."""
    resolved, placement, notes = resolve(config, device)
    for note in notes:
        logging.getLogger(__name__).warning(note)
    return resolved, placement


# -- Ray's view of the cluster -------------------------------------------------------------------------------------

def check_ray_resources(placement: Placement, threads: int, cluster: dict) -> None:
    """Fail at once, naming the keys, when Ray's cluster (`ray.cluster_resources()`) cannot hold the workers at
    all; Ray itself would leave the actors pending forever. (Resources that exist but are busy: the backend's
    bounded wait for its reservation.) Totals, not free amounts: Ray frees a killed actor's share lazily."""
    cpus = placement.workers * threads
    if cluster.get("CPU", 0.0) + 1e-9 < cpus:
        raise PlacementError(f"Ray's cluster has {cluster.get('CPU', 0.0):g} CPU(s); the workers need {cpus} "
                             f"(run.workers={placement.workers} x run.threads_per_worker={threads}): lower "
                             f"run.threads_per_worker or run.workers")
    gpus = placement.workers * placement.gpus_per_worker
    have = cluster.get("GPU", 0.0)
    if gpus > 0 and have + 1e-9 < gpus:
        raise PlacementError(f"Ray's cluster has {have:g} GPU(s); the workers need {gpus:g} (run.workers="
                             f"{placement.workers} x run.gpus_per_worker={placement.gpus_per_worker:g}): lower "
                             f"run.workers or run.gpus_per_worker")
