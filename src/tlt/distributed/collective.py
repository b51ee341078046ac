"""Summing gradients across policy replicas.

Ray workers are processes: they form a torch.distributed group and all-reduce one flat buffer per step: NCCL
when each holds a whole GPU of its own, gloo otherwise (CPU, or fractional GPUs: NCCL refuses two ranks on one
device; gloo's buffer then goes through host memory). The placement decides (distributed/placement.py).
In-process workers are threads of one process: they sum into a shared buffer behind a barrier, on rank 0's
device. Either way every replica ends the reduction with the same summed gradient, clips the same global norm
and takes the same optimizer step, so the replicas stay identical (tested bit for bit).
"""

from __future__ import annotations

import threading

import torch


def flat_gradients(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in parameters])


def unflatten_into(parameters: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Each parameter's gradient becomes its slice of `flat`, copied to the parameter's own device."""
    flat = flat.to(parameters[0].device)  # one transfer (e.g. gloo's host buffer), then same-device slices
    offset = 0
    for p in parameters:
        count = p.numel()
        p.grad = flat[offset:offset + count].view_as(p).to(p.device, copy=True)
        offset += count


def open_group_store(world_size: int, timeout_s: float, host: str = "127.0.0.1"):
    """Rank 0's rendezvous store, listening on a port the OS picks while binding it: a port found free first and
    bound later can be taken in between (a run then failed with EADDRINUSE). Its `.port` goes to the others."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class ProcessGroupReducer:
    """A torch.distributed group among the worker processes (one rank each). `backend`: "nccl" or "gloo";
    `timeout_s` bounds forming the group and every all-reduce (a dead peer is an error, not a hang). `store`:
    rank 0's from `open_group_store`; the other ranks connect to `address` (its host:port)."""

    def __init__(self, rank: int, world_size: int, address: str, backend: str = "gloo", timeout_s: float = 1800,
                 store=None):
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            if store is None:
                host, port = address.rsplit(":", 1)
                store = dist.TCPStore(host, int(port), world_size, False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        self.world_size = world_size
        self.host_buffer = backend == "gloo"  # gloo sums host tensors: a GPU buffer goes through host memory

    def __call__(self, parameters: list[torch.nn.Parameter]) -> None:
        import torch.distributed as dist

        flat = flat_gradients(parameters)
        if self.host_buffer:
            flat = flat.cpu()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        unflatten_into(parameters, flat)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class ThreadReducer:
    """The same sum for worker threads of one process: each adds its gradient, all wait, all read the total.
    Additions happen in rank order so the floating-point sum does not depend on thread timing. A worker that never
    arrives breaks the barrier after `timeout_s` (threading.BrokenBarrierError in every waiting worker)."""

    def __init__(self, world_size: int, timeout_s: float = 1800):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._parts: dict[int, torch.Tensor] = {}
        self._total: torch.Tensor | None = None

    def abort(self) -> None:
        """A worker failed before its reduction: the others waiting at the barrier raise now, not in 30 minutes."""
        self._barrier.abort()

    def for_rank(self, rank: int):
        def reduce(parameters: list[torch.nn.Parameter]) -> None:
            self._parts[rank] = flat_gradients(parameters)
            if self._barrier.wait() == 0:  # one thread sums, in rank order, on rank 0's device
                device = self._parts[0].device
                self._total = sum(self._parts[r].to(device) for r in range(self.world_size))
            self._barrier.wait()
            unflatten_into(parameters, self._total)
            self._barrier.wait()  # nobody starts the next reduction before all have read this one
        return reduce
