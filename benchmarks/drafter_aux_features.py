"""Would the drafter draft better from more of the target than its last layer? A depth-1 probe of EAGLE-3's idea.

The drafter reads f_t, the target's final normed hidden state (models/eagle.py). EAGLE-3 (Li et al. 2025) feeds it
a low, a middle and a high layer's states instead, arguing that the last layer keeps only what the next token
needs. Before building that into serving (features captured in every verify forward, a buffer three times as
large, deeper drafts that cannot be teacher-forced), this asks what it buys where it is cheapest to ask: at depth 1,
teacher-forced, on the same responses, the same steps, lr and initialisation.

Variant `final`: the drafter as it is. Variant `final+L1,L2`: the same fused input plus aux([h_L1; h_L2]), a new
linear layer over the residual stream after layers L1 and L2, each RMS-normalised (the residual stream's scale
grows with depth). `aux` starts at zero, so a variant fine-tuned from a warmed drafter starts where it is.
Scored on held-out prompts: top-1 agreement with the target's argmax (what greedy decoding accepts at depth 1) and
sum min(p, q) at T=1 (what q-sampling accepts), over the draft vocabulary, as DrafterTrainer.evaluate reports them.

    python benchmarks/drafter_aux_features.py --json benchmarks/results/drafter_aux_features.json \
        --cache /tmp/responses.json --lr 1e-4 --steps 300 --eval-every 100            # the committed drafter
    python benchmarks/drafter_aux_features.py --json benchmarks/results/drafter_aux_features_scratch.json \
        --cache /tmp/responses.json --from-scratch --lr 1e-3 --steps 300 --eval-every 100
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402
from drafter_unroll import add_response_args, held_out_responses  # noqa: E402

from tlt.drafter.buffer import FeatureBuffer  # noqa: E402
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402

COMMITTED = Path(__file__).parent / "drafters" / "smollm2-arithmetic"


class AuxFeatureDrafter(EagleDrafter):
    """EagleDrafter whose training input also carries `extra` residual-stream states after the final feature:
    features [..., (1 + extra) * H]. Teacher-forced depth 1 only (no serving path reads them)."""

    def __init__(self, target_config, draft_vocab, extra: int):
        super().__init__(target_config, draft_vocab)
        hidden = target_config.hidden_size
        self.hidden = hidden
        self.aux = nn.Linear(extra * hidden, hidden, bias=False) if extra else None
        if self.aux is not None:
            nn.init.zeros_(self.aux.weight)

    def fuse(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        fused = super().fuse(tokens, features[..., :self.hidden])
        if self.aux is None or features.shape[-1] == self.hidden:
            return fused
        extra = features[..., self.hidden:].unflatten(-1, (-1, self.hidden))
        extra = F.rms_norm(extra, (self.hidden,))  # each layer's state at one scale
        return fused + self.aux(extra.flatten(-2))


class AuxFeatureTrainer(DrafterTrainer):
    """The library's loss, with the targets (the next final feature and its token distribution) read from the
    final feature only."""

    def loss(self, batch, weights, *, noise=True):
        hidden = self.drafter.hidden
        return super().loss(dataclasses.replace(batch, target_features=batch.target_features[..., :hidden]),
                            weights, noise=noise)


@torch.no_grad()
def residual_states(loaded, prompts, responses_, layers: list[int], batch_size: int = 8) -> list[torch.Tensor]:
    """Each sequence's [T, (1 + len(layers)) * H] states: the final normed hidden state (transformers'
    hidden_states[-1], the drafter's f_t) followed by the residual stream after each of `layers`
    (hidden_states[layer + 1]). One forward per `batch_size` sequences, right-padded (causal: padding after a
    sequence changes nothing of it)."""
    sequences = [list(p) + list(r) for p, r in zip(prompts, responses_)]
    out = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        ids = torch.zeros(len(chunk), max(map(len, chunk)), dtype=torch.long)
        for row, sequence in enumerate(chunk):
            ids[row, :len(sequence)] = torch.tensor(sequence)
        states = loaded.model.model(ids, output_hidden_states=True).hidden_states
        stacked = torch.cat([states[-1]] + [states[layer + 1] for layer in layers], dim=-1)
        out += [stacked[row, :len(sequence)].float() for row, sequence in enumerate(chunk)]
    return out


def buffer_of(prompts, sequences, states) -> FeatureBuffer:
    """The feature buffer of the sequences (training pairs from each prompt's last token on)."""
    buffer = FeatureBuffer(max_tokens=10_000_000, recency=0.0, seed=0)
    for prompt, sequence, state in zip(prompts, sequences, states):
        buffer.add_samples(torch.tensor([sequence]), state[None], [len(prompt) - 1], [len(sequence)], 0)
    return buffer


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--variants", nargs="+", default=["final", "final+2,15", "final+15,27"],
                        help="'final' or 'final+L1,L2,...' (0-based decoder layers)")
    parser.add_argument("--from-scratch", action="store_true", help="fresh drafters (torch seed 0) over the "
                        "committed drafter's draft vocabulary; default: fine-tune the committed drafter")
    add_response_args(parser)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-every", type=int, default=200)
    args = parser.parse_args(argv)
    loaded, prompts, responses_, held_from, forward = held_out_responses(args)
    variants = {text: [int(x) for x in text.partition("+")[2].split(",") if x] for text in args.variants}
    # every variant's layers in one forward per sequence batch; a variant reads its own slices
    every_layer = sorted({layer for layers in variants.values() for layer in layers})
    states = residual_states(loaded, prompts, responses_, every_layer)
    sequences = [list(p) + list(r) for p, r in zip(prompts, responses_)]
    hidden = loaded.model.config.hidden_size
    committed = EagleDrafter.load(COMMITTED, forward)
    results = {"from_scratch": args.from_scratch, "prompts": len(prompts), "held_out_responses": len(prompts) -
               held_from, "steps": args.steps, "lr": args.lr, "variants": {}, "environment": environment(),
               "complete": False}
    for variant, layers in variants.items():
        picked = [state[:, :hidden] for state in states]
        for layer in layers:
            at = (1 + every_layer.index(layer)) * hidden
            picked = [torch.cat([mine, state[:, at:at + hidden]], -1) for mine, state in zip(picked, states)]
        train = buffer_of(prompts[:held_from], sequences[:held_from], picked[:held_from])
        held = buffer_of(prompts[held_from:], sequences[held_from:], picked[held_from:])
        torch.manual_seed(0)
        drafter = AuxFeatureDrafter(loaded.model.config, committed.draft_to_target, len(layers)).attach(forward)
        if not args.from_scratch:
            drafter.load_state_dict(committed.state_dict(), strict=False)  # aux stays zero
        trainer = AuxFeatureTrainer(drafter, train, DrafterTrainConfig(lr=args.lr, seed=0))
        curve, started = [], time.perf_counter()
        for done in range(0, args.steps + 1, args.eval_every):
            if done:
                trainer.train_steps(args.eval_every)
            scores = trainer.evaluate(list(held.entries))
            curve.append({"step": done, "top1": scores["top1"], "accept_q": scores["accept_q"]})
            print(f"{variant} step {done}: top1 {scores['top1']:.4f} accept_q {scores['accept_q']:.4f}",
                  file=sys.stderr)
        results["variants"][variant] = {"layers": layers, "curve": curve, "train_s": time.perf_counter() - started,
                                        "top1": curve[-1]["top1"], "accept_q": curve[-1]["accept_q"]}
        write_json(args.json, results, echo=False)
    results["complete"] = True
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
