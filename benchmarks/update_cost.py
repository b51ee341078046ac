"""What one policy update costs, and what its suspects cost: cuDNN attention plans, micro-batch count, a full GC.

On an H100 (2026-11-27) the update of ~1,450 response tokens (16 samples, SmolLM2-135M-Instruct) took ~1.05 s
of a 1.4 s RL step, for tens of milliseconds of kernels. This times `phases.update` (forward, loss, backward,
clipping, AdamW: the real path, with the run's autocast and truncated-IS weights) of a replica of the default
run on synthetic steps of that shape, in one process, the variants taking turns step by step:

  default       as a run updates: a new padded length every micro-batch (cuDNN's attention off on CUDA); on
                CUDA under the automatic token budget (optim.micro_batch_tokens=auto: 4 rows at the longest
                possible length, filled with as many shorter rows as fit)
  rows_4        micro-batches of 4 rows whatever their lengths (optim.micro_batch_tokens=0: the default before)
  cudnn_on      the same with torch's default attention choice (cuDNN first for masked bf16 SDPA on Hopper,
                which builds an execution plan per new shape): what the update cost before 2026-11-27
  same_shapes   one step's lengths again and again (every per-shape cache warm)
  micro_batch_16  one micro-batch of 16 sequences instead of 4 (the host's per-operation cost, divided)

and one full garbage collection of this process (what `_return_free_memory` paid after every update before the
workers' objects were frozen). Medians over --steps; each variant's lengths are its own (no shared shape).

    python benchmarks/update_cost.py --device cuda --json $OUT/update_cost_h100.json   # ~1 min on an H100
    python benchmarks/update_cost.py --device cpu --steps 1 --scale 0.1                # a smoke test (~30 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, sync, write_json  # noqa: E402

from tlt.rl import phases  # noqa: E402
from tlt.rl.actor import PackedSamples  # noqa: E402
from tlt.rl.config import load_config  # noqa: E402
from tlt.rl.replica import PolicyReplica  # noqa: E402

SAMPLES = 16
RESPONSE_LENGTHS = (20, 40, 60, 90, 130, 250)  # ~1,450 tokens a step on average, as the H100 run's


def synthetic_batch(seed: int, device: torch.device, scale: float) -> phases.StepBatch:
    """16 samples: prompts of 60-100 tokens, responses drawn from RESPONSE_LENGTHS (x scale), random ids and
    advantages; rollout log-probs present and weights capped at 2, as a bf16 rollout on CUDA gives."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40_000) for _ in range(max(2, int(rng.randint(60, 100) * scale)))]
               for _ in range(SAMPLES)]
    responses = [[rng.randrange(100, 40_000) for _ in range(max(1, int(rng.choice(RESPONSE_LENGTHS) * scale)))]
                 for _ in range(SAMPLES)]
    packed = PackedSamples.build(prompts, responses, 0, device)
    advantages = torch.randn(SAMPLES, generator=torch.Generator().manual_seed(seed)).to(device)
    # RL step 0 for all: the seed only draws the lengths (a step number would move the lr schedule)
    return phases.StepBatch(0, packed, torch.zeros(SAMPLES), torch.zeros(SAMPLES, dtype=torch.bool), 0,
                            advantages, None, None, torch.zeros(packed.response_mask.shape, device=device), 2.0)


def timed_update(replica: PolicyReplica, batch: phases.StepBatch, device: torch.device) -> float:
    sync(device)
    started = time.perf_counter()
    phases.update(replica, batch, phases.loss_totals(replica.config, batch))
    sync(device)
    return time.perf_counter() - started


def with_micro_batches(replica: PolicyReplica, **optim) -> PolicyReplica:
    """The same replica (model, optimizer) updating with other optim.micro_batch_* settings."""
    config = dataclasses.replace(replica.config, optim=dataclasses.replace(replica.config.optim, **optim))
    return dataclasses.replace(replica, config=config)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=4, help="measured updates per variant")
    parser.add_argument("--scale", type=float, default=1.0, help="length scale (a CPU smoke test: 0.1)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = load_config(None, ["run.speculative=off", "run.workers=1", f"model.device={args.device}"])
    replica = PolicyReplica.build(config)  # cuDNN's attention off on CUDA, as every replica
    cuda = device.type == "cuda"
    variants = {"default": replica, "rows_4": with_micro_batches(replica, micro_batch_tokens=0),
                "same_shapes": replica,
                "micro_batch_16": with_micro_batches(replica, micro_batch_size=16, micro_batch_tokens=0)}
    if cuda:
        variants["cudnn_on"] = replica
    results = {"command": " ".join(["python benchmarks/update_cost.py", *(argv or sys.argv[1:])]),
               "samples": SAMPLES, "update_s": {name: [] for name in variants}, "environment": environment(),
               "autocast": str(replica.autocast_dtype), "complete": False}
    timed_update(replica, synthetic_batch(0, device, args.scale), device)  # Adam's state, cuBLAS handles
    fixed = synthetic_batch(1, device, args.scale)
    timed_update(replica, fixed, device)  # same_shapes: its per-shape caches warm
    results["response_tokens"] = int(fixed.packed.response_mask.sum())
    for step in range(args.steps):
        for index, (name, variant) in enumerate(variants.items()):
            batch = fixed if name == "same_shapes" else synthetic_batch(1000 * (index + 1) + step, device, args.scale)
            torch.backends.cuda.enable_cudnn_sdp(name == "cudnn_on")
            try:
                results["update_s"][name].append(round(timed_update(variant, batch, device), 4))
            finally:
                torch.backends.cuda.enable_cudnn_sdp(not cuda)  # back to what the replica set
        write_json(args.json, results, echo=False)  # a run cut at its limit keeps its finished steps
    results["median_update_s"] = {name: statistics.median(times) for name, times in results["update_s"].items()}
    started = time.perf_counter()
    gc.collect()
    results["full_gc_s"] = round(time.perf_counter() - started, 4)
    results["gc_tracked_objects"] = len(gc.get_objects())
    results["complete"] = True
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
