"""CPU linears on inputs of more than 64 rows: padded to a few row counts per octave vs computed at their own.

`PackedOneDNNLinear` pads inputs past `ROUNDED_ABOVE` rows (`models/onednn_linear.py`) so that oneDNN, which makes
and keeps a primitive per input shape, meets few shapes: a run's prefill and scoring lengths otherwise made new
ones every RL step (memory: docs/architecture.md, "CPU specifics"). This times what the padding costs or saves
per row: rounds of SmolLM2's four linear shapes at a random row count (65-700, a new one each round, as prefills
of new lengths are), each mode in turn, the order alternating.

    python benchmarks/padded_rows.py --json benchmarks/results/padded_rows.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import onednn_linear  # noqa: E402
from tlt.models.onednn_linear import PackedOneDNNLinear  # noqa: E402

SHAPES = [(576, 576), (1536, 576), (576, 1536), (192, 576)]  # SmolLM2-135M: q/o, gate/up, down, k/v
MODES = {"padded": onednn_linear.ROUNDED_ABOVE, "exact": 10 ** 9}


@torch.no_grad()
def one_round(linear, weights, rows: int) -> float:
    """Microseconds per row for one input of `rows` rows through every weight."""
    inputs = [torch.randn(rows, w.shape[1]) for w in weights]
    started = time.perf_counter()
    for x, weight in zip(inputs, weights):
        linear(x, weight, None)
    return (time.perf_counter() - started) / rows * 1e6


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    linear, rng = PackedOneDNNLinear(), random.Random(0)
    one_round(linear, weights, 2)  # packs the weights
    per_row = {mode: [] for mode in MODES}
    try:
        for index in range(args.rounds):
            rows = rng.randrange(65, 701)
            for mode in (MODES if index % 2 else reversed(list(MODES))):
                onednn_linear.ROUNDED_ABOVE = MODES[mode]
                per_row[mode].append(one_round(linear, weights, rows))
    finally:
        onednn_linear.ROUNDED_ABOVE = MODES["padded"]
    result = {"us_per_row_median": {mode: statistics.median(v) for mode, v in per_row.items()},
              "padded_over_exact": statistics.median(p / e for p, e in zip(per_row["padded"], per_row["exact"])),
              "rounds": args.rounds, "threads": args.threads, "shapes": SHAPES, "environment": environment(),
              "complete": True}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
