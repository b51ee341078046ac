"""What a draft vocabulary saves and what it costs, for a drafter trained from scratch in `tlt train`.

Saves: a spot-training step (`DrafterTrainer`, the target's and the drafter's distributions both over the draft
vocabulary) and a draft pass in the engine (the drafter's head is the target's lm_head restricted to it), each timed
side by side against the whole vocabulary. Costs: the target's probability mass outside it, never acceptable by any
rule, teacher-forced on fresh T=1 responses of the built-in task, for the vocabulary `tlt train` makes before any
response exists (`fresh_drafter`: the task prompts' tokens, the stop tokens, the lowest ids), the lowest ids alone,
and one from a first step's responses (what the warm-up does, from 16 prompts here).

    python benchmarks/draft_vocab.py --json benchmarks/results/draft_vocab.json
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

from tlt.drafter.buffer import FeatureBuffer  # noqa: E402
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer  # noqa: E402
from tlt.drafter.vocabulary import frequent_tokens  # noqa: E402
from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.models.loading import eos_token_ids  # noqa: E402
from tlt.rl.config import load_config  # noqa: E402
from tlt.rl.replica import fresh_drafter  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402
from tlt.tasks import build_task  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts whose responses measure the mass")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--sizes", default="4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    loaded = load_model()
    task = build_task(load_config(None, []).task, loaded.tokenizer)
    sizes = [int(size) for size in args.sizes.split(",")]
    results = {"environment": environment(), "sizes": sizes, "complete": False}
    results["train_step_s"] = train_step_times(loaded, [0, 8192], args.repeats)
    write_json(args.json, results, echo=False)
    results["draft_pass"] = draft_pass_times(loaded, task, [0, 8192])
    write_json(args.json, results, echo=False)
    results["mass_outside"] = mass_outside(loaded, task, sizes, args)
    results["complete"] = True
    write_json(args.json, results)
    return results


def train_step_times(loaded, sizes: list[int], repeats: int) -> dict:
    """Median seconds of one optimizer step over 8 samples of 150 tokens (1,192 pairs): the spot trainer's unit.
    Feature values do not change the cost: random ones."""
    hidden = loaded.model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    buffer = FeatureBuffer(200_000)
    for _ in range(8):
        tokens = torch.randint(0, 8000, (150,), generator=generator)
        buffer.add(tokens, torch.randn(150, hidden, generator=generator), 1)
    times = {}
    for size in sizes:
        vocab = None if size == 0 else torch.arange(size)
        trainer = DrafterTrainer(EagleDrafter(loaded.model.config, vocab).attach(loaded.model), buffer,
                                 DrafterTrainConfig())
        trainer.train_steps(1)  # warm-up
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            trainer.train_steps(1)
            samples.append(time.perf_counter() - started)
        times[_name(size)] = statistics.median(samples)
    times["ratio_whole_over_draft"] = times[_name(sizes[0])] / times[_name(sizes[1])]
    return times


def draft_pass_times(loaded, task, sizes: list[int]) -> dict:
    """Drafting seconds per speculative step at batch 1 (S5K1q: five draft passes), both drafters untrained (τ ≈ 1
    for both, so the steps compare): the engine's own split of a step into drafting and verification."""
    example = task.sample(1, seed=7)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=0)
    out = {}
    for size in sizes:
        drafter = fresh_drafter(loaded, task, size)
        engine = RolloutEngine(loaded, max_batch_size=1, drafter=drafter, speculation=SpecStrategy.parse("S5K1q"))
        engine.generate([Request(task.prompt_ids(example), params=params)])  # warm-up
        result = engine.generate([Request(task.prompt_ids(example), params=params)])
        sd = [s for s in result.steps if s.kind == "decode" and s.mode == "sd"]
        out[_name(size)] = {"draft_ms_per_step": 1e3 * sum(s.draft_s for s in sd) / len(sd),
                            "step_ms": 1e3 * statistics.median(s.wall_s for s in sd), "sd_steps": len(sd)}
    whole, draft = out[_name(sizes[0])], out[_name(sizes[1])]
    out["draft_ratio_whole_over_draft"] = whole["draft_ms_per_step"] / draft["draft_ms_per_step"]
    out["step_ratio_whole_over_draft"] = whole["step_ms"] / draft["step_ms"]
    return out


def mass_outside(loaded, task, sizes: list[int], args) -> dict:
    engine = RolloutEngine(loaded, max_batch_size=16)

    def responses(count: int, seed: int):
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=seed)
        return engine.generate([Request(task.prompt_ids(e), params=params) for e in task.sample(count, seed)]).samples

    first_step = [list(s.token_ids) for s in responses(16, 5)]
    held_out = responses(args.prompts, 999)
    probs = torch.cat([_target_probs(loaded.model, s) for s in held_out])
    vocab_size, stops = loaded.spec.vocab_size, eos_token_ids(loaded.model, loaded.tokenizer)
    out = {"positions": int(probs.shape[0])}
    for size in sizes:
        vocabularies = {"fresh_drafter": fresh_drafter(loaded, task, size).draft_to_target,
                        "lowest_ids": torch.arange(size),
                        "first_step_responses": frequent_tokens(first_step, size, vocab_size, always=stops)}
        out[str(size)] = {name: _outside(probs, ids) for name, ids in vocabularies.items()}
    return out


@torch.no_grad()
def _target_probs(model, sample) -> torch.Tensor:
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.token_ids)])
    logits = model(ids).logits[0, len(sample.prompt_ids) - 1:-1]
    return torch.softmax(logits.float(), -1)


def _outside(probs: torch.Tensor, ids: torch.Tensor) -> float:
    inside = torch.zeros(probs.shape[-1], dtype=torch.bool)
    inside[ids.cpu()] = True
    return float(probs[:, ~inside].sum(-1).mean())


def _name(size: int) -> str:
    return "whole" if size == 0 else str(size)


if __name__ == "__main__":
    main()
