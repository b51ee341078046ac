"""One long-tailed rollout on SmolLM2-135M-Instruct: no SD, each static strategy, and the adaptive engine.

64 distinct prompts of the built-in task (chat template, as in RL), max_new_tokens 256 with EOS: most answers end
early, a few run long — the long tail. Greedy decoding, so every mode produces exactly the same tokens (SD is
lossless) and wall times compare the same work.

    python benchmarks/adaptive.py --json benchmarks/results/adaptive.json --drafter DIR [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.policy import AdaptiveSpeculation, BanditConfig, BatchSizeGate  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402

STRATEGIES = [SpecStrategy.chain(3), SpecStrategy(4, 2, 8), SpecStrategy(5, 3, 16)]


def rollout(loaded, drafter, requests, speculation):
    engine = RolloutEngine(loaded, max_batch_size=64, drafter=drafter, speculation=speculation, max_tree_size=16)
    result = engine.generate(requests)
    return result


def amdahl(baseline, gate: int) -> dict:
    """Share of the no-SD rollout's wall time spent at batch <= gate, and the speedup ceiling it implies:
    even infinitely fast tail steps leave the rest of the rollout as it is."""
    tail = sum(s.wall_s for s in baseline.steps if s.kind == "decode" and s.batch_size <= gate)
    share = tail / baseline.wall_s
    return {"tail_time_share": share, "speedup_ceiling_if_tail_free": 1 / (1 - share) if share < 1 else None,
            "speedup_ceiling_if_tail_2x": 1 / (1 - share / 2)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--drafter", help="a drafter directory (tlt drafter warmup); default: untrained")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gate", type=int, default=8, help="SD only at running batch <= this")
    args = parser.parse_args(argv)
    loaded = load_model()
    drafter = EagleDrafter.load(args.drafter, loaded.model) if args.drafter else EagleDrafter(loaded.model.config)
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    max_new = 128 if args.quick else 256
    params = SamplingParams(temperature=0, max_new_tokens=max_new)
    requests = [Request(task.prompt_ids(e), params=params) for e in task.sample(64, seed=7)]
    rollout(loaded, None, requests[:2], None)  # warm-ups: plain, and the speculative path (its first arm paid
    rollout(loaded, drafter, requests[:2], STRATEGIES[0])  # the SD path's one-off costs: found by review)

    baseline = rollout(loaded, None, requests, None)
    results = {"no_sd_s": baseline.wall_s, "static_s": {}, "static_tau": {}, "tokens": baseline.generated_tokens,
               "drafter": args.drafter or "untrained (random init)", "max_new_tokens": max_new}
    reference = [s.token_ids for s in baseline.samples]
    for strategy in STRATEGIES:
        result = rollout(loaded, drafter, requests, strategy)
        assert [s.token_ids for s in result.samples] == reference, "SD changed greedy output"
        results["static_s"][strategy.name] = result.wall_s
        results["static_tau"][strategy.name] = result.speculation_summary()["tau"]
    policy = AdaptiveSpeculation(STRATEGIES, BatchSizeGate(threshold=args.gate, hysteresis=2), BanditConfig(seed=0))
    adaptive = rollout(loaded, drafter, requests, policy)
    assert [s.token_ids for s in adaptive.samples] == reference, "SD changed greedy output"
    best = min(results["static_s"], key=results["static_s"].get)
    results.update({
        "best_static": best, "best_static_s": results["static_s"][best], "adaptive_s": adaptive.wall_s,
        "adaptive_vs_best_static": adaptive.wall_s / results["static_s"][best],
        "adaptive_speedup_vs_no_sd": baseline.wall_s / adaptive.wall_s,
        "adaptive": {**adaptive.speculation_summary(), "policy": policy.summary()},
        "decode_steps_no_sd": len(baseline.batch_size_trace()),
        "tail_steps_at_batch_le_gate": sum(b <= args.gate for b in baseline.batch_size_trace()),
        **amdahl(baseline, args.gate),
        "environment": environment(),
    })
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
