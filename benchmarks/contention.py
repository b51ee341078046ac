"""Does spot training on one CPU core slow the rollout decoding on the other? (Shared memory bandwidth.)
And what would data-parallel spot training cost: a gloo all-reduce of the drafter's gradients vs a drafter step.

Process A decodes SmolLM2-135M at batch 8 on 1 thread; process B, on the other core, trains a SmolLM2-sized
EAGLE drafter on 1 thread (or does nothing). Ratios of A's median step time with B training vs B idle, measured in
alternating rounds so machine drift hits both alike.

    python benchmarks/contention.py --json benchmarks/results/contention.json [--rounds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402


def decode_steps(steps: int, ready, go, out) -> None:
    import torch

    from tlt.models import load_model
    from tlt.rollout.engine import RolloutEngine
    from tlt.rollout.request import Request
    from tlt.sampling import SamplingParams

    torch.set_num_threads(1)
    loaded = load_model()
    engine = RolloutEngine(loaded, max_batch_size=8)
    params = SamplingParams(temperature=0, max_new_tokens=steps, stop_token_ids=())
    request = Request(loaded.tokenizer.encode("Tell me a long story about the sea."), n=8, params=params)
    engine.generate([Request(request.prompt_ids, n=8, params=SamplingParams(temperature=0, max_new_tokens=4))])
    ready.set()
    while True:
        command = go.get()
        if command is None:
            return
        result = engine.generate([request])
        out.put(statistics.median(s.wall_s for s in result.steps if s.kind == "decode"))


def train_drafter(active, stop, timings) -> None:
    import torch

    from tlt.drafter.buffer import FeatureBuffer
    from tlt.drafter.trainer import DrafterTrainer
    from tlt.models import load_model
    from tlt.models.eagle import EagleDrafter

    torch.set_num_threads(1)
    loaded = load_model()
    drafter = EagleDrafter(loaded.model.config, torch.arange(8192)).attach(loaded.model)
    buffer = FeatureBuffer(10**6)
    for _ in range(16):
        buffer.add(torch.randint(0, 8192, (256,)), torch.randn(256, loaded.model.config.hidden_size), 0)
    trainer = DrafterTrainer(drafter, buffer)
    steps = []
    while not stop.is_set():
        if active.is_set():
            steps.append(trainer.train_steps(1)[0]["step_s"])
        else:
            time.sleep(0.01)
    timings.put({"drafter_step_s": statistics.median(steps),
                 "drafter_parameters": sum(p.numel() for p in drafter.parameters())})


def all_reduce_ms(rank: int, numel: int, port: int, out) -> None:
    """Median time of a gloo all-reduce of `numel` floats between two processes (one thread each)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    flat = torch.randn(numel)
    times = []
    for _ in range(12):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(flat)
        times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    if rank == 0:
        out.put(statistics.median(times[2:]) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=96)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ready, active, stop = ctx.Event(), ctx.Event(), ctx.Event()
    go, out, timings = ctx.Queue(), ctx.Queue(), ctx.Queue()
    decoder = ctx.Process(target=decode_steps, args=(args.steps, ready, go, out))
    trainer = ctx.Process(target=train_drafter, args=(active, stop, timings))
    decoder.start()
    trainer.start()
    ready.wait()
    time.sleep(5)  # the trainer process has loaded its model too
    alone, contended = [], []
    for _ in range(args.rounds):
        for training, bucket in ((False, alone), (True, contended)):
            (active.set if training else active.clear)()
            time.sleep(1.0)
            go.put(1)
            bucket.append(out.get())
    go.put(None)
    stop.set()
    decoder.join()
    drafter = timings.get()
    trainer.join()
    drafter["all_reduce_ms"] = round(_measure_all_reduce(ctx, drafter["drafter_parameters"]), 2)
    result = {"environment": environment(), "batch": 8, "threads_each": 1,
              "decode_step_ms_alone": [round(v * 1e3, 2) for v in alone],
              "decode_step_ms_with_spot_training": [round(v * 1e3, 2) for v in contended],
              "slowdown_median": round(statistics.median(c / a for a, c in zip(alone, contended)), 3),
              "data_parallel": {**drafter, "drafter_step_s": round(drafter["drafter_step_s"], 3),
                                "all_reduce_share_of_step": round(drafter["all_reduce_ms"] / 1e3
                                                                  / drafter["drafter_step_s"], 4)}}
    write_json(args.json, result)
    print(result)


def _measure_all_reduce(ctx, numel: int) -> float:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = ctx.Queue()
    ranks = [ctx.Process(target=all_reduce_ms, args=(rank, numel, port, out)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    result = out.get()
    for process in ranks:
        process.join()
    return result


if __name__ == "__main__":
    main()
