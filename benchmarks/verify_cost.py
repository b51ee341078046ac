"""What verifying a draft tree costs: one target forward over T tokens per row vs one token, by batch size.

    python benchmarks/verify_cost.py --json benchmarks/results/verify_cost.json   # ~1 min

The CPU's eager forward. On a GPU a step is a replayed CUDA graph, and the engine measures this curve itself at
start-up, through its graphs (rollout/cost_curve.py, cached per device: a GPU session sends it back as
cost_curves.tar); an eager CUDA forward here would time kernel launches instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import KVCache, LeanForward, load_model  # noqa: E402


def step_ms(forward: LeanForward, batch: int, tokens: int, context: int = 200, repeats: int = 9) -> float:
    cache = KVCache(forward.spec, batch, context + tokens + 1)
    rows = cache.rows(0, batch)
    forward(torch.randint(0, 1000, (batch, context)), rows, logits_at=None)
    rows.advance(context)
    ids = torch.randint(0, 1000, (batch, tokens))
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        forward(ids, rows, logits_at="all")  # uncommitted: every repeat verifies the same block
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1000


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    forward = LeanForward(load_model(device="cpu").model)
    results = {"step_ms": {}, "cost_vs_one_token": {}}
    for batch in (1, 4, 16):
        base = step_ms(forward, batch, 1)
        for tokens in (1, 2, 4, 9, 17, 33):
            ms = base if tokens == 1 else step_ms(forward, batch, tokens)
            results["step_ms"][f"b{batch}_t{tokens}"] = ms
            results["cost_vs_one_token"][f"b{batch}_t{tokens}"] = ms / base
    results["environment"] = environment()
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
