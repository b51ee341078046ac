"""Where one speculative step's operations go, by phase: the map of what is left to fuse.

A captured SD step at batch 1 is launch-bound on an H100/H200 (docs/benchmarks.md §9: its cost in plain steps
follows its operation count), so this counts the ATen operations and Triton launches (`step_ops.py`'s counter)
of the last `SpeculativeDecoder.run` of a short rollout, split by phase: the drafter's catch-up pass
(`feed_pairs`), drafting (`draft_tree`), tree selection, the verify forward, log-probs, acceptance; what no
phase claims (packing, KV and feature writes) is the rest. The target has `--layers` layers in the default
model's width and vocabulary (each further layer adds its forward's ~8 operations to the verify forward only),
a random drafter, the Triton kernels under Triton's interpreter, the graph runner's sync-free path.

    python benchmarks/sd_step_phases.py --strategies S6K2q,S5K1q --json benchmarks/results/sd_step_phases.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before tlt imports the kernels
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import step_ops  # noqa: E402
from common import environment, write_json  # noqa: E402

from tlt.models import load_model  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.speculative import decoder  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402

PHASES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
# (owner, attribute, phase name): functions the decoder calls, counted while they run
COUNTED = [(decoder.SpeculativeDecoder, "feed_pairs", "catch_up"), (decoder, "draft_tree", "draft_tree"),
           (decoder, "select_tree", "select_tree"), (decoder.DraftDistributions, "from_candidates", "draft_dists"),
           (decoder, "processed_logprobs", "logprobs")] + [
    (decoder, name, "acceptance") for name in ("accept_q", "accept_q_chain", "accept", "accept_chain")]


INSIDE: list[str] = []  # the phase being counted: a counted function another one calls belongs to the caller's


def counted(function, phase: str):
    def wrapper(*args, **kwargs):
        if INSIDE:  # e.g. drafting's own log-softmax: counted once, in drafting
            return function(*args, **kwargs)
        INSIDE.append(phase)
        try:
            with step_ops.OperationCounter() as counter:
                out = function(*args, **kwargs)
        finally:
            INSIDE.pop()
        PHASES[phase].update(counter.counts)
        return out
    return wrapper


def count_phases(model, strategy: SpecStrategy) -> dict:
    engine = step_ops.counting_engine(model, strategy, "triton")
    engine.forward.run = counted(engine.forward.run, "verify_forward")
    steps, run = [], decoder.SpeculativeDecoder.run

    def whole_step(*args, **kwargs):
        PHASES.clear()
        with step_ops.OperationCounter() as counter:
            out = run(*args, **kwargs)
        rest = counter.counts.copy()
        for phase in PHASES.values():
            rest.subtract(phase)
        phases = {name: dict(c.most_common()) for name, c in PHASES.items()}
        phases["rest"] = {name: n for name, n in rest.most_common() if n}
        steps.append((sum(counter.counts.values()), phases))
        return out

    decoder.SpeculativeDecoder.run = whole_step
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(), seed=0)
        engine.generate([Request([1, 2, 3, 4, 5], params=params)])
    finally:
        decoder.SpeculativeDecoder.run = run
    total, phases = steps[-1]
    totals = {name: sum(ops.values()) for name, ops in phases.items()}
    return {"total": total, "by_phase": totals, "operations": phases}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--strategies", default="S6K2q,S5K1q,S3K1N3")
    parser.add_argument("--layers", type=int, default=1, help="target layers (the default model has 30)")
    args = parser.parse_args(argv)
    step_ops.count_triton_launches()
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in COUNTED]
    for owner, name, phase in COUNTED:
        setattr(owner, name, counted(getattr(owner, name), phase))
    config = AutoConfig.from_pretrained(load_model().source)
    config.num_hidden_layers = args.layers
    model = AutoModelForCausalLM.from_config(config).eval().to(torch.bfloat16)  # the engine serves an fp32 copy
    results = {"layers": args.layers, "by_strategy": {}, "environment": environment(), "complete": False}
    try:
        for name in args.strategies.split(","):
            strategy = SpecStrategy.parse(name)
            results["by_strategy"][strategy.name] = row = count_phases(model, strategy)
            print(f"{strategy.name}: {row['total']} operations {row['by_phase']}", file=sys.stderr, flush=True)
            write_json(args.json, results, echo=False)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    results["complete"] = True
    write_json(args.json, results, echo=False)
    return results


if __name__ == "__main__":
    main()
