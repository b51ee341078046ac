"""What one drafter optimizer step costs the thread that runs it beside the decode loop: operations and device reads.

On one GPU the drafter trains on a thread beside the rollout's tail (drafter/tail_trainer.py). That thread holds
Python's GIL for each kernel it launches and for the Python between them; the decode loop, whose replayed step is a
few launches and one read, waits for the GIL each time it wants it back. On the H200 (seventh session) the decoding
a tail trainer overlapped ran 19% slower (#15: <= 3%). So this counts, on the CPU, what a step asks of its thread:
the ATen operations it dispatches (one launch each on CUDA; views and allocations not counted) and the reads of
device values outside the update (float()/item(), nonzero, boolean-mask indexing: each a sync on CUDA, where the
thread waits and then must win the GIL back), in the default model's shape (random weights, SmolLM2-135M: hidden
576, draft vocabulary 8192) on eight samples of mixed lengths. The host's own work (packing the rows, moving them)
is left out: it is Python and CPU tensors on every device. The optimizer's update is counted apart, for torch's
foreach AdamW (what the thread used) and the fused one (what a CUDA trainer now makes).

    python benchmarks/tail_step_ops.py --label this --json benchmarks/results/tail_step_ops.json
    PYTHONPATH=<a checkout of another commit>/src python benchmarks/tail_step_ops.py --label <name> --json ...

Counts, not times: the GPU's time follows them only as far as the step is launch-bound (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
import step_ops  # noqa: E402
from common import environment, write_json  # noqa: E402

from tlt.drafter import trainer as trainer_module  # noqa: E402
from tlt.drafter.buffer import FeatureBuffer  # noqa: E402
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer  # noqa: E402
from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402

VIEWS = step_ops.VIEWS | {"empty_strided"}  # what launches nothing, as step_ops.py counts (plus this allocation)
SAMPLE_LENGTHS = (64, 120, 200, 300, 500, 700, 900, 1024)  # one RL step's mixed response lengths (+1 prompt token)


class StepCounter(TorchDispatchMode):
    """Operations and device reads, except while `on_host` (the trainer's host-side work)."""

    def __init__(self):
        super().__init__()
        self.operations: collections.Counter = collections.Counter()
        self.reads: collections.Counter = collections.Counter()
        self.on_host = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.on_host:
            name = func.overloadpacket.__name__
            if name not in VIEWS:
                self.operations[name] += 1
            boolean_index = name == "index" and any(torch.is_tensor(i) and i.dtype == torch.bool for i in args[1])
            if name in ("_local_scalar_dense", "nonzero") or boolean_index:
                self.reads["boolean index" if boolean_index else name] += 1
        return func(*args, **(kwargs or {}))


def trainer_for(model, buffer: FeatureBuffer, rows: int, fused: bool | None) -> DrafterTrainer:
    torch.manual_seed(0)
    drafter = EagleDrafter(model.config, torch.arange(8192)).attach(model)
    trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(rows_per_micro_step=rows, entries_per_step=8))
    if fused is not None:  # the same update, foreach or fused (fused AdamW runs on the CPU too since torch 2.4)
        params = [p for p in drafter.parameters() if p.requires_grad]
        trainer.optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), fused=fused or None,
                                              foreach=None if fused else True)
    return trainer


def count_step(trainer: DrafterTrainer) -> dict:
    """One optimizer step after a warm-up one: micro-steps (forward + backward), then the update apart."""
    trainer._step()  # warm-up: the optimizer's state exists from here on
    counter = StepCounter()
    to_device, update, loss = trainer._to_device, trainer.optimizer.step, trainer.loss
    micro_steps = []

    def on_host(*args):
        counter.on_host = True
        try:
            return to_device(*args)
        finally:
            counter.on_host = False

    def counted_loss(rows, *args, **kwargs):
        micro_steps.append(rows.valid.shape[0])
        return loss(rows, *args, **kwargs)
    updates = {}

    def counted_update():
        before, reads = sum(counter.operations.values()), sum(counter.reads.values())
        update()
        updates["operations"] = sum(counter.operations.values()) - before
        # torch's foreach AdamW reads its step counts: host tensors on CUDA too (no sync); fused keeps them there
        updates["reads"] = sum(counter.reads.values()) - reads
    trainer._to_device, trainer.optimizer.step, trainer.loss = on_host, counted_update, counted_loss
    # the rows are packed and weighed from host tensors: no launch on any device (before 2026-11-28 the trainer
    # packed inline: pack_pairs was wrapped instead)
    plan = getattr(trainer, "_micro_batches", None)
    pack = trainer_module.pack_pairs

    def on_host_too(function):
        def wrapped(*args, **kwargs):
            counter.on_host = True
            try:
                return function(*args, **kwargs)
            finally:
                counter.on_host = False
        return wrapped
    if plan is not None:
        trainer._micro_batches = on_host_too(plan)
    else:
        trainer_module.pack_pairs = on_host_too(pack)
    try:
        with counter:
            trainer._step()
    finally:
        trainer_module.pack_pairs = pack
    total = sum(counter.operations.values())
    return {"micro_steps": len(micro_steps), "rows": sum(micro_steps), "operations": total,
            "forward_backward_operations": total - updates["operations"], "update_operations": updates["operations"],
            "device_reads": sum(counter.reads.values()) - updates["reads"], "update_step_count_reads": updates["reads"],
            "reads_by_kind": dict(counter.reads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the code measured (e.g. this, session-start)")
    parser.add_argument("--json", type=Path, help="add the result under its label to this file")
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(load_model().source)  # the default model's shape; weights random below
    config.num_hidden_layers = 1  # the drafter reads the target's embedding and head only
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(0)
    buffer = FeatureBuffer(10**7, seed=0)
    for length in SAMPLE_LENGTHS:
        buffer.add(torch.randint(0, config.vocab_size, (length + 1,), generator=generator),
                   torch.randn(length + 1, config.hidden_size, generator=generator), step=0)
    result = {}
    for rows in (2, 8):
        for fused in (False, True):
            buffer._rng.seed(1)  # the same entries in every setting
            counts = count_step(trainer_for(model, buffer, rows, fused))
            result[f"rows{rows}_{'fused' if fused else 'foreach'}"] = counts
            print(f"{args.label}: {rows} rows a micro-step, {'fused' if fused else 'foreach'} AdamW: {counts}")
    if args.json:
        existing = json.loads(args.json.read_text()) if args.json.exists() else {}
        existing.setdefault("by_code", {})[args.label] = result
        existing.update({"environment": environment(), "sample_lengths": list(SAMPLE_LENGTHS),
                         "entries_per_step": 8, "row_length": 256, "draft_vocab": 8192})
        write_json(args.json, existing)


if __name__ == "__main__":
    main()
