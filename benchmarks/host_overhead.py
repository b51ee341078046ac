"""The host's share of a graphed rollout step: Python and tensor bookkeeping, with the device's work taken out.

On a GPU a captured step's device work is fixed, and everything the host does around it (building the step's
inputs, copying them into the graph's buffers, reading what it emitted, appending it to the samples) is paid
between replays, while the device waits: at batch 1 a plain step of SmolLM2-135M is ~1.2 ms on an H200, so
0.1-0.3 ms of host work is a large part of it. This runs the engine's graph path (`GraphRunner(capture=False)`:
the same buffers, padding and bookkeeping) over a tiny model with every replay after a graph's first returning
that first run's outputs, so the measured step time is host work only.

Two ways of building the rows' per-step inputs, interleaved in one run: `per_step` draws each row's uniforms
with one generator call per row and rebuilds the rows' sampling settings at every step (the engine before
rollout/batch_rows.py), `blocks` is the engine's `BatchRows` (settings kept and uniforms sliced from per-row
blocks while the rows stay the same; the graph runner skips copying unchanged settings). Both consume the same
random numbers. Reports the median host µs per decode step by arm and batch size, and their ratio.

    python benchmarks/host_overhead.py --json benchmarks/results/host_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.rollout.batch_rows import BatchRows  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.graph_runner import GraphRunner, _Graph  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import RowSampling, SamplingParams  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402


class PerStepRows(BatchRows):
    """The inputs as the engine built them before BatchRows: new settings tensors and one draw per row, every
    step (the same numbers: each row's next uniforms from its own generator)."""

    def settings(self, seqs):
        return RowSampling.from_params([s.request.params for s in seqs], "cpu")

    def uniforms(self, seqs, count):
        return torch.stack([seq.take_uniforms(count) for seq in seqs])


@contextlib.contextmanager
def device_work_removed():
    """Every graph's replay after its first returns the first run's outputs (clones): no forward runs."""
    real = _Graph.replay

    def replay(graph):
        cached = getattr(graph, "_host_overhead_outputs", None)
        if cached is None:
            cached = graph._host_overhead_outputs = tuple(t.clone() for t in real(graph))
        return cached

    _Graph.replay = replay
    try:
        yield
    finally:
        _Graph.replay = real


def tiny_model(vocab_size: int) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def engine_for(model, arm: str, batch: int, rows_class) -> RolloutEngine:
    drafter = EagleDrafter(model.config)
    speculation = None if arm == "plain" else SpecStrategy.parse(arm)
    engine = RolloutEngine(model, max_batch_size=batch, drafter=drafter, speculation=speculation,
                           max_tree_size=32, eos_token_ids=[model.config.vocab_size - 1])
    engine.runner = GraphRunner(engine.forward, capture=False)
    engine.set_drafter(drafter)  # the drafter's inputs are stored at every plain step, as in an RL rollout
    engine.model_runner.batch_rows = rows_class()
    return engine


def host_us_per_step(engine: RolloutEngine, batch: int, tokens: int) -> float:
    generator = torch.Generator().manual_seed(batch)
    requests = [Request(torch.randint(4, 90, (24,), generator=generator).tolist(),
                        params=SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=row))
                for row in range(batch)]
    engine.generate(requests)  # builds the graphs (their first runs are the only forwards)
    steps = [s for s in engine.generate(requests).steps if s.kind == "decode"]
    return statistics.median(s.wall_s for s in steps) * 1e6


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--arms", default="plain,S4K2N14q", help="plain and/or speculative strategies")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved runs of both ways per cell")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the host work of one step is single-threaded Python
    model = tiny_model(97)
    ways = {"per_step": PerStepRows, "blocks": BatchRows}
    results = {"command": "python benchmarks/host_overhead.py " + " ".join(argv or sys.argv[1:]),
               "environment": environment(), "tokens": args.tokens, "repeats": args.repeats, "by_arm": {},
               "complete": False}
    with device_work_removed():
        for arm in args.arms.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                engines = {way: engine_for(model, arm, batch, cls) for way, cls in ways.items()}
                times = {way: [] for way in ways}
                for _ in range(args.repeats):  # interleaved: the machine's drift hits both ways alike
                    for way, engine in engines.items():
                        times[way].append(host_us_per_step(engine, batch, args.tokens))
                cell = {f"{way}_us": statistics.median(values) for way, values in times.items()}
                cell["ratio"] = cell["per_step_us"] / cell["blocks_us"]
                results["by_arm"].setdefault(arm, {})[str(batch)] = cell
                print(f"{arm:10s} batch {batch:3d}: per-step {cell['per_step_us']:7.1f} us, "
                      f"blocks {cell['blocks_us']:7.1f} us, {cell['ratio']:.2f}x", flush=True)
                write_json(args.json, results, echo=False)
    results["complete"] = True
    write_json(args.json, results, echo=False)
    return results


if __name__ == "__main__":
    main()
