"""CPU linears over packed vs unpacked weights (oneDNN), in plain decoding and in a speculative verify.

Unpacked, oneDNN re-lays out every weight on every call; `PackedOneDNNLinear` packs each weight once (re-packed
when it changes). Interleaved rounds of the engine with either linear on the same prompts: plain greedy decoding
at batch 1 and 8 (16 mixed chat prompts, 64 tokens each) and, with `--drafter`, a batch-1 q-sampling chain at
T = 1. Reported: tok/s per round and the paired packed/unpacked ratios.

    python benchmarks/packed_linears.py --json benchmarks/results/packed_linears.json [--drafter DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import MIXED_PROMPTS, environment, write_json  # noqa: E402

from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.models.onednn_linear import PackedOneDNNLinear, _onednn_linear  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402

LINEARS = {"unpacked": lambda: _onednn_linear, "packed": PackedOneDNNLinear}  # a fresh linear per engine


def tokens_per_s(loaded, prompts, batch: int, linear: str, params: SamplingParams, drafter=None,
                 strategy: SpecStrategy | None = None) -> float:
    engine = RolloutEngine(loaded, max_batch_size=batch, drafter=drafter, speculation=strategy,
                           max_tree_size=strategy.cache_slots if strategy else 0)
    engine.forward.linear = LINEARS[linear]()  # the drafter's too: on the CPU it is attached to this very forward
    engine.generate([Request(prompts[0], params=SamplingParams(max_new_tokens=2))])  # packs, warms up
    return engine.generate([Request(p, params=params) for p in prompts]).tokens_per_s


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drafter", help="a drafter directory: also time a batch-1 S3K1q chain at T=1")
    args = parser.parse_args(argv)
    loaded = load_model()
    chat = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in MIXED_PROMPTS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in chat]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64, stop_token_ids=(), seed=1)
    cases = {f"plain_b{batch}": {"batch": batch, "prompts": prompts[:2 * batch], "params": greedy} for batch in (1, 8)}
    if args.drafter:
        drafter = EagleDrafter.load(args.drafter, loaded.model)
        sampled = SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=(), seed=1)
        cases["sd_S3K1q_b1"] = {"batch": 1, "prompts": prompts[:2], "params": sampled, "drafter": drafter,
                                "strategy": SpecStrategy.parse("S3K1q")}
    runs = {case: {linear: [] for linear in LINEARS} for case in cases}
    for _ in range(args.rounds):
        for case, settings in cases.items():
            for linear in LINEARS:
                runs[case][linear].append(tokens_per_s(loaded, linear=linear, **settings))
    results = {"rounds": args.rounds, "cases": {}, "environment": environment()}
    for case, by_linear in runs.items():
        ratios = [p / u for p, u in zip(by_linear["packed"], by_linear["unpacked"])]
        results["cases"][case] = {"tok_s": by_linear, "packed_over_unpacked": ratios,
                                  "median_ratio": statistics.median(ratios)}
        print(f"{case}: packed/unpacked {statistics.median(ratios):.2f}x (rounds: "
              + ", ".join(f"{r:.2f}" for r in ratios) + ")", file=sys.stderr)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
