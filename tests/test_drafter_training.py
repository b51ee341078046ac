"""Training the drafter on a tiny target's features lowers its loss and raises τ measured by the SD engine."""

import time

import pytest
import torch

from conftest import markov_model, random_prompts
from tlt.drafter.buffer import FeatureBuffer
from tlt.drafter.features import collect_features
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer
from tlt.models import LeanForward
from tlt.models.eagle import DrafterError, EagleDrafter
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.rollout.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy


def measured_tau(model, drafter, prompts):
    engine = RolloutEngine(model, max_batch_size=8, drafter=drafter, speculation=SpecStrategy(4, 2, 8),
                           max_tree_size=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=(), seed=5)
    return engine.generate([Request(p, n=2, params=params) for p in prompts]).speculation_summary()["tau"]


@pytest.fixture(scope="module")
def setup():
    model, _ = markov_model(16, sharpness=3.0, context=0.05, seed=2)
    lean = LeanForward(model)
    engine = RolloutEngine(model, max_batch_size=16)
    prompts = random_prompts([4] * 16, vocab_size=16, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(), seed=1)
    result = engine.generate([Request(p, n=2, params=params) for p in prompts])
    buffer = FeatureBuffer(max_tokens=100_000)
    collect_features(lean, [list(s.prompt_ids) for s in result.samples], [s.token_ids for s in result.samples],
                     buffer, step=0)
    return model, buffer


def test_training_lowers_loss_and_raises_tau(setup):
    model, buffer = setup
    torch.manual_seed(0)
    drafter = EagleDrafter(model.config).attach(model)
    trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(lr=3e-3, entries_per_step=8, row_length=64))
    train, held = buffer.split_holdout(0.2)
    held_prompts = random_prompts([4] * 4, vocab_size=16, seed=9)
    before, tau_before = trainer.evaluate(held), measured_tau(model, drafter, held_prompts)
    trainer.train_steps(150)
    after, tau_after = trainer.evaluate(held), measured_tau(model, drafter, held_prompts)
    assert after["loss"] < 0.5 * before["loss"]
    assert after["top1"] > before["top1"] + 0.3
    assert tau_after > tau_before + 0.8, (tau_before, tau_after)
    print(f"held-out loss {before['loss']:.3f} -> {after['loss']:.3f}, top1 {before['top1']:.2f} -> {after['top1']:.2f}, tau {tau_before:.2f} -> {tau_after:.2f}")


def test_train_until_stops_within_one_step(setup):
    model, buffer = setup
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer)
    deadline = time.perf_counter() + 0.3
    started = time.perf_counter()
    history = trainer.train_until(lambda: time.perf_counter() >= deadline, max_steps=10_000)
    overshoot = time.perf_counter() - deadline
    longest = max(h["step_s"] for h in history)
    assert 0 < len(history) < 10_000
    assert overshoot <= longest + 0.05  # at most the step in flight when the stop came
    assert time.perf_counter() - started < 5


def test_micro_steps_accumulate_the_whole_batch_gradient(setup):
    model, buffer = setup
    grads = []
    for rows in (1, 100):
        torch.manual_seed(0)
        drafter = EagleDrafter(model.config).attach(model)
        config = DrafterTrainConfig(entries_per_step=6, row_length=32, rows_per_micro_step=rows, grad_clip=0, seed=4)
        trainer = DrafterTrainer(drafter, buffer, config)
        trainer.buffer._rng.seed(11)  # the same entries for both
        trainer.optimizer.step = lambda: None  # keep the gradient for inspection
        trainer._step()
        grads.append(torch.cat([p.grad.reshape(-1) for p in drafter.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_a_stop_inside_a_step_drops_it_without_an_update(setup):
    model, buffer = setup
    drafter = EagleDrafter(model.config).attach(model)
    trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(entries_per_step=8, row_length=16,
                                                                 rows_per_micro_step=1))
    before = [p.detach().clone() for p in drafter.parameters()]
    checks = iter([False, False, True])  # before the step, first micro-step, then stop mid-step
    assert trainer.train_until(lambda: next(checks), max_steps=5) == []
    assert trainer.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, drafter.parameters()))


def test_save_load_and_shape_mismatch(setup, tmp_path):
    model, buffer = setup
    drafter = EagleDrafter(model.config, draft_vocab=torch.arange(8)).attach(model)
    trainer = DrafterTrainer(drafter, buffer)
    trainer.train_steps(2)
    trainer.save(tmp_path / "d")
    names = set(__import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(tmp_path / "d" / "drafter.safetensors")))
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's tensors are never saved
    loaded = EagleDrafter.load(tmp_path / "d", model)
    for a, b in zip(loaded.parameters(), drafter.parameters()):
        assert torch.equal(a, b)
    resumed = DrafterTrainer(loaded, buffer)
    resumed.load_optimizer(tmp_path / "d")
    assert resumed.steps == 2
    other, _ = markov_model(8)
    with pytest.raises(DrafterError, match="do not fit"):
        EagleDrafter.load(tmp_path / "d", other)


def test_evaluation_reports_acceptance_per_rule_not_just_agreement(setup):
    """An exact drafter (q = p) is accepted with probability 1 by q-sampling, but by the target-only rule only
    with the target's top-1 mass; its top-1 agreement is 1 either way, which is why agreement overstates τ."""
    from conftest import oracle_drafter

    model, transition = markov_model(16, sharpness=1.0, seed=1)
    engine = RolloutEngine(model, max_batch_size=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(), seed=1)
    result = engine.generate([Request(p, n=2, params=params) for p in random_prompts([4] * 8, vocab_size=16)])
    buffer = FeatureBuffer(max_tokens=100_000)
    collect_features(LeanForward(model), [list(s.prompt_ids) for s in result.samples],
                     [s.token_ids for s in result.samples], buffer, step=0)
    report = DrafterTrainer(oracle_drafter(model).attach(model), buffer).evaluate(list(buffer.entries))
    assert report["top1"] == 1.0
    assert report["accept_q"] == pytest.approx(1.0, abs=1e-5)
    top1_mass = torch.softmax(transition, -1).max(-1).values  # per current token
    assert 0.2 < report["accept_target_only"] < 0.95
    assert top1_mass.min() - 1e-5 <= report["accept_target_only"] <= top1_mass.max() + 1e-5
    assert report["implied_tau_q"] == pytest.approx(6.0, abs=1e-3)  # 1 + 1 + ... at eval_depth 5
