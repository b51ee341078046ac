"""How much any drafter could get accepted: the target's own top-K probability mass on its sampled responses.

With target-only acceptance, a drafted child c is accepted with probability p(c). A perfect drafter proposes the
target's K most likely tokens, so its depth-1 acceptance is the mean top-K mass; with per-step acceptance a,
a chain of depth S reaches at most tau = 1 + a + a^2 + ... + a^S (greedy decoding: a = 1).

    python benchmarks/acceptance_bound.py --json benchmarks/results/acceptance_bound.json   # ~2 min
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import KVCache, load_model  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.rollout.sampling import SamplingParams  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    loaded = load_model()
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    engine = RolloutEngine(loaded, max_batch_size=16)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=256, seed=1)
    result = engine.generate([Request(task.prompt_ids(e), params=params) for e in task.sample(args.prompts, 999)])
    forward = engine.forward
    masses = []
    with torch.no_grad():
        for sample in result.samples:
            sequence = list(sample.prompt_ids) + sample.token_ids
            rows = KVCache(forward.spec, 1, len(sequence)).rows(0, 1)
            logits = forward(torch.tensor([sequence]), rows, logits_at="all").logits[0]
            response = logits[len(sample.prompt_ids) - 1:-1] / max(args.temperature, 1e-6)
            masses.append(torch.softmax(response, -1).sort(-1, descending=True).values[:, :4].cumsum(-1))
    top = torch.cat(masses).mean(0).tolist()
    results = {"temperature": args.temperature, "positions": sum(m.shape[0] for m in masses),
               "mean_top_k_mass": {str(k + 1): top[k] for k in range(4)},
               "perfect_chain_tau_bound": {str(s): sum(top[0] ** d for d in range(s + 1)) for s in (3, 5, 8)},
               "environment": environment()}
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
