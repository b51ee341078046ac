"""The publish gate: a spot-trained drafter version is published only when it beats the serving one on held-out
features (drafter/gate.py). Measured without it: a warmed drafter trained on a few RL steps' features at lr 1e-3
lost 10% of its held-out depth-1 acceptance (benchmarks/results/drafter_adaptation.json)."""

import pytest
import torch

from conftest import markov_model, random_prompts
from tlt.drafter.buffer import FeatureBuffer
from tlt.drafter.features import collect_features
from tlt.drafter.gate import PublishGate
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer
from tlt.models import LeanForward
from tlt.models.eagle import EagleDrafter
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams


@pytest.fixture(scope="module")
def setup():
    """A held-out buffer: every 4th sample of a Markov target's rollout kept out of training."""
    model, _ = markov_model(16, sharpness=3.0, context=0.05, seed=2)
    engine = RolloutEngine(model, max_batch_size=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(), seed=1)
    samples = engine.generate([Request(p, n=2, params=params)
                               for p in random_prompts([4] * 16, vocab_size=16, seed=3)]).samples
    buffer = FeatureBuffer(max_tokens=100_000, holdout_every=4, holdout_entries=6, holdout_first=2)
    collect_features(LeanForward(model), [list(s.prompt_ids) for s in samples], [s.token_ids for s in samples],
                     buffer, step=0)
    return model, buffer


def test_every_nth_entry_is_held_out_never_sampled_and_bounded(setup):
    _, buffer = setup
    assert len(buffer.held) == 6 and len(buffer) == 32 - 2 - 8  # the first 2 and entries 4, 8, ..., 32
    # held out; the newest 6 of those kept
    held = {id(entry) for entry in buffer.held}
    assert not held & {id(entry) for entry in buffer.sample(500)}
    assert buffer.tokens == sum(entry.tokens.shape[0] for entry in buffer.entries)  # outside the budget


def trained(model, buffer, steps: int, seed: int = 0) -> DrafterTrainer:
    torch.manual_seed(seed)
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer,
                             DrafterTrainConfig(lr=3e-3, entries_per_step=8, row_length=64, seed=seed))
    trainer.train_steps(steps)
    return trainer


def test_a_better_version_passes_and_a_worse_one_is_held_back(setup):
    model, buffer = setup
    trainer = trained(model, buffer, 60)
    gate = PublishGate(trainer)
    weaker = {k: v.clone() for k, v in trained(model, buffer, 5).drafter.state_dict().items()}
    gate.start(weaker)
    assert gate.allows(), gate.last  # 60 steps beat 5
    assert gate.last["candidate"] > gate.last["serving"]
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    gate.published(before)
    with torch.no_grad():  # the training copy gets worse: noise on its layer
        for param in trainer.drafter.layer.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    worse = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    assert not gate.allows() and gate.held_back == 1, gate.last
    after = trainer.drafter.state_dict()  # judging it left the training weights as they were
    assert all(torch.equal(after[k], worse[k]) for k in worse)


def test_an_untrained_serving_drafter_is_no_reference(setup):
    model, buffer = setup
    gate = PublishGate(trained(model, buffer, 1))
    gate.start(None)
    assert gate.allows()


def test_too_few_held_out_entries_keep_the_serving_version(setup):
    model, _ = setup
    small = FeatureBuffer(max_tokens=100_000, holdout_every=4, holdout_first=1)
    for _ in range(2):  # the first held out, the second for training
        small.add(torch.arange(10) % 16, torch.randn(10, model.config.hidden_size), 0)
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), small)
    gate = PublishGate(trainer)
    gate.start({k: v.clone() for k, v in trainer.drafter.state_dict().items()})
    assert len(small.held) == 1 and not gate.allows() and gate.last == {"held": 1}


def test_a_lone_worker_from_a_trained_drafter_publishes_only_what_beats_it(tmp_path):
    """End to end (a lone worker training in its own tail, the gate on by default): every version it published
    scored above the one serving before it on the held-out entries, and the versions it kept back are counted."""
    from test_distributed import long_tail_model, make_controller

    model = long_tail_model()
    buffer = FeatureBuffer(10_000)
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        buffer.add(torch.randint(4, 16, (40,), generator=g), torch.randn(40, 16, generator=g), 0)
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer)
    trainer.train_steps(2)
    trainer.save(tmp_path / "drafter")
    decisions = []
    allows = PublishGate.allows

    def recorded(gate):
        verdict = allows(gate)
        decisions.append((verdict, dict(gate.last)))
        return verdict
    PublishGate.allows = recorded
    try:
        controller = make_controller(tmp_path / "run", **{
            "run.workers": 1, "run.tail_training": "on", "run.publish_gate": True, "run.publish_every": 1,
            "run.drafter": str(tmp_path / "drafter"), "rollout.max_new_tokens": 200, "rollout.prompts_per_step": 8})
        lengths = [12] * 12 + [200] * 4
        metrics = [controller.train_step(lengths=lengths) for _ in range(2)]
        controller.close()
    finally:
        PublishGate.allows = allows
    assert all(m["spot_train_errors"] == 0 for m in metrics)
    assert decisions and sum(m["spot_train_steps"] for m in metrics) > 0
    published = sum(len(m["drafter_versions"]) for m in metrics)
    held_back = sum(m["drafter_versions_held_back"] for m in metrics)
    assert published == sum(verdict for verdict, _ in decisions) and held_back == len(decisions) - published
    for verdict, scores in decisions:  # judged on held-out entries, never with fewer than MIN_HELD
        assert scores["held"] >= 4 and verdict == (scores["candidate"] > scores["serving"]), scores
