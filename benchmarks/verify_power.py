"""The power of `tlt verify`'s sampled tests against a realistic bug: each acceptance rule accepting drafts 1.2x
too often (`verify.OVER_ACCEPTING`), beside the exact rule, on SmolLM2 with a drafter.

For each strategy: SD samples of the built-in task's prompts, then every test's statistic on them: the PIT's KS
p-value and the drafter-alignment z for g = q, g = q / (p + q) (what `verify` runs) and g = 1[x = argmax q].

    python benchmarks/verify_power.py --drafter benchmarks/drafters/smollm2-arithmetic \
        --json benchmarks/results/verify_power.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

import tlt.verify as V  # noqa: E402
from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402


def statistics(loaded, drafter, samples, params) -> dict:
    tests = {"q": V.Alignment(), "q_over_p_plus_q": V.Alignment(), "argmax_q": V.Alignment()}
    generator, pits = torch.Generator().manual_seed(0), []
    for sample in samples:
        logprobs = V.reference_logprobs(loaded.model, sample.prompt_ids, sample.token_ids, params)
        tokens = torch.tensor(sample.token_ids)
        pits.append(V.randomized_pit(logprobs, tokens, generator))
        q, p = V.draft_probabilities(drafter, sample.prompt_ids, sample.token_ids, params), logprobs.exp()
        tests["q"].add(logprobs, tokens, q)
        tests["q_over_p_plus_q"].add(logprobs, tokens, q / (p + q).clamp(min=1e-30))
        tests["argmax_q"].add(logprobs, tokens, (q >= q.max(-1, keepdim=True).values).float())
    u = torch.cat(pits)
    return {"tokens": int(u.numel()), "ks_p": V.ks_pvalue(V.ks_statistic(u), u.numel()),
            **{f"z_{name}": round(test.z, 3) for name, test in tests.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--strategies", default="S4K2N8,S5K1q")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    loaded = load_model("smollm2")
    drafter = EagleDrafter.load(args.drafter, loaded.model)
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    prompts = [task.prompt_ids(e) for e in task.sample(args.prompts, 0)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    result = {"environment": environment(), "drafter": args.drafter, "prompts": args.prompts,
              "samples_per_prompt": args.samples_per_prompt, "max_new_tokens": args.max_new_tokens, "runs": {}}
    for name in args.strategies.split(","):
        strategy = SpecStrategy.parse(name)
        for label, rule in (("exact", None), ("accepts_1.2x", V.OVER_ACCEPTING[strategy.rule])):
            engine = V._sd_engine(loaded, drafter, strategy, rule)
            samples = engine.generate(V._requests(prompts, args.samples_per_prompt, params)).samples
            result["runs"][f"{strategy.name} {label}"] = statistics(loaded, drafter, samples, params)
            print(strategy.name, label, result["runs"][f"{strategy.name} {label}"], flush=True)
            write_json(args.json, result, echo=False)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
