"""Median time of one decode step at batch 1, plain and speculative, on the default model: a regression check
between two versions of the library (run it alternately over each, e.g. with PYTHONPATH pointing at a worktree
of the old commit, and compare medians; the machines are noisy).

The drafter is untrained (random): its steps cost what a trained one's do, which is what this times (τ is not).

    python benchmarks/step_time.py --strategy S5K1q [--tokens 48] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402

PROMPT = "Write a long story about a robot."


def median_step_ms(engine, request, repeats: int) -> float:
    engine.generate([request])  # warm-up: allocator, oneDNN primitives (graphs on CUDA)
    medians = []
    for _ in range(repeats):
        steps = [s.wall_s for s in engine.generate([request]).steps if s.kind == "decode"]
        medians.append(statistics.median(steps) * 1000)
    return statistics.median(medians)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="S5K1q")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    loaded = load_model()
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    request = Request(prompt, params=SamplingParams(temperature=1.0, max_new_tokens=args.tokens, stop_token_ids=(),
                                                    seed=1))
    strategy = SpecStrategy.parse(args.strategy)
    plain = RolloutEngine(loaded, max_batch_size=1)
    speculative = RolloutEngine(loaded, max_batch_size=1, drafter=EagleDrafter(loaded.model.config),
                                speculation=strategy, max_tree_size=strategy.cache_slots)
    results = {"plain_step_ms": median_step_ms(plain, request, args.repeats),
               "sd_step_ms": median_step_ms(speculative, request, args.repeats), "strategy": strategy.name,
               "tokens": args.tokens, "repeats": args.repeats, "environment": environment()}
    print(f"plain {results['plain_step_ms']:.1f} ms  {strategy.name} {results['sd_step_ms']:.1f} ms", file=sys.stderr)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
