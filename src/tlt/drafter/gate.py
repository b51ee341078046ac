"""PublishGate: a spot-trained drafter version is published only when it drafts better than the one serving.

Why: going on training a warmed drafter on a few RL steps' features can make it worse. Measured
(`benchmarks/drafter_adaptation.py`, the committed SmolLM2 drafter, fresh T=1 responses of prompts its warm-up
never drew, a fresh AdamW as a run whose --drafter has no optimizer state starts): held-out depth-1 acceptance
(sum min(p, q)) 0.636 -> 0.571 after 10 steps at lr 1e-3 (0.583 after 40), 0.618 at 3e-4, 0.631 at 1e-4. A lone
worker's tail trainer published such versions into its own decode loop: in a CPU run (S5K1q, 4 RL steps) the
spot-trained drafter's tau was 2.07 against 2.25 frozen (medians). Speculative sampling stays exact with any
drafter, so this costs speed, not correctness: the gate keeps the speed.

How: the trainer's buffer keeps every 8th entry out of training (`FeatureBuffer.holdout_every`, the newest 16
kept). Before a version would be published, the training weights and the weights serving now are scored on those
entries, teacher-forced at the rollout temperature: sum min(p, q) at depth 1, what q-sampling accepts (and a
proxy for the target-only rule's). Only a higher score publishes. Training goes on either way: a later version
may pass. An untrained serving drafter (a run without run.drafter) is no reference: anything trained replaces it.
"""

from __future__ import annotations

import torch

HOLDOUT_EVERY = 8
MIN_HELD = 4  # fewer held-out entries judge nothing: the serving version stays


class PublishGate:
    def __init__(self, trainer, *, min_held: int = MIN_HELD):
        self.trainer, self.min_held = trainer, min_held
        self.reference: dict | None = None  # the serving weights (host copies); None: untrained, no reference
        self.held_back = 0                  # versions not published since start()
        self.last: dict = {}                # the last decision's scores

    def start(self, serving: dict | None) -> None:
        """A training session begins from the weights serving now (None: an untrained drafter)."""
        self.reference, self.held_back, self.last = serving, 0, {}

    def published(self, weights: dict) -> None:
        self.reference = weights

    def allows(self) -> bool:
        """Whether the training weights score higher than the reference on the held-out features."""
        if self.reference is None:
            return True
        held = list(self.trainer.buffer.held)
        if len(held) < self.min_held:
            self.last = {"held": len(held)}
            self.held_back += 1
            return False
        drafter = self.trainer.drafter
        candidate = {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()}
        ours = self.trainer.evaluate(held)["accept_q"]
        with torch.no_grad():  # in place: the tensors a captured micro-step reads stay where they are
            drafter.load_state_dict(self.reference, strict=False)
            theirs = self.trainer.evaluate(held)["accept_q"]
            drafter.load_state_dict(candidate)
        self.last = {"held": len(held), "candidate": ours, "serving": theirs}
        if ours > theirs:
            return True
        self.held_back += 1
        return False
