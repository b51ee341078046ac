"""The rollout/training mismatch: the rollout's own log-probs reach the update, are compared with the training
forward's (metrics), and weight the policy gradient by truncated importance sampling where the two differ
(grpo.rollout_is); and the update's other metrics (entropy, grad_norm) and options (mask_truncated)."""

import math

import pytest
import torch

from test_trainer import make_trainer
from tlt.rl.actor import PackedSamples
from tlt.rl.config import ConfigError, load_config
from tlt.rl.grpo import KL_CLAMP, k3_kl, policy_loss, truncated_importance_weights
from tlt.rl.phases import rollout_logprobs
from tlt.rollout.request import RolloutResult, SampleOutput


def test_rollout_logprobs_are_laid_out_as_the_training_logprobs():
    samples = [SampleOutput(0, 0, (5, 6, 7), [8, 9], [-0.5, -1.5], "stop"),
               SampleOutput(0, 1, (5,), [10, 11, 12], [-0.1, -0.2, -0.3], "length")]
    packed = PackedSamples.build([list(s.prompt_ids) for s in samples], [s.token_ids for s in samples], 0)
    out = rollout_logprobs(RolloutResult(samples, [], 0.0), packed)
    assert out.shape == packed.response_mask.shape
    assert out[0].tolist() == [0, 0, -0.5, -1.5] and out[1].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0])
    assert (out[~packed.response_mask] == 0).all()


def test_fp32_rollout_matches_the_training_forward_and_is_not_reweighted(tmp_path):
    """On the CPU the rollout decodes the training weights themselves: the gap is rounding, and "auto" leaves the
    gradient unweighted. Entropy and grad_norm are logged (grad_norm also without clipping)."""
    trainer = make_trainer(tmp_path, **{"optim.grad_clip": 0})
    metrics = trainer.train_step()
    assert metrics["train/rollout_logprob_gap"] < 1e-5 and abs(metrics["train/rollout_kl"]) < 1e-8
    assert "train/is_capped" not in metrics
    assert 0 < metrics["train/entropy"] <= math.log(16) + 1e-5  # at most log V
    assert metrics["train/grad_norm"] > 0


def test_a_bf16_rollout_is_reweighted_and_its_gap_measured(tmp_path):
    """The CUDA default emulated on the CPU: a bf16 rollout copy samples, the fp32 master trains."""
    trainer = make_trainer(tmp_path, **{"rollout.dtype": "bfloat16"})
    batch = trainer.score(examples := trainer.task.sample(4, seed=0), trainer.rollout(examples))
    assert batch.is_cap == 2.0 and batch.rollout_logprobs is not None
    metrics = trainer.update(batch)
    assert metrics["rollout_logprob_gap"] > 1e-5 and metrics["rollout_kl"] > 0
    assert 0 <= metrics["is_capped"] < 0.5
    off = make_trainer(tmp_path / "off", **{"rollout.dtype": "bfloat16", "grpo.rollout_is": "off"})
    assert off.score(examples, off.rollout(examples)).is_cap is None


def test_top_p_sampling_keeps_no_rollout_logprobs_and_refuses_truncation(tmp_path):
    trainer = make_trainer(tmp_path, **{"rollout.top_p": 0.9, "rollout.dtype": "bfloat16"})
    batch = trainer.score(examples := trainer.task.sample(4, seed=0), trainer.rollout(examples))
    assert batch.rollout_logprobs is None and batch.is_cap is None
    assert "rollout_kl" not in trainer.update(batch)
    with pytest.raises(ConfigError, match="grpo.rollout_is=truncate needs unfiltered sampling"):
        load_config(None, ["grpo.rollout_is=truncate", "rollout.top_k=20"])
    for bad, message in (("grpo.rollout_is=yes", "grpo.rollout_is must be one of"),
                         ("grpo.rollout_is_cap=0.5", "grpo.rollout_is_cap must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [bad])


def test_truncated_importance_weights_scale_the_policy_gradient_only():
    """d loss / d logp = -w * A / tokens per token (dapo, ratio 1 on-policy), w = min(exp(old - rollout), cap);
    the KL term is not weighted. Negative control: unweighted, the gradient differs."""
    generator = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(2, 5, generator=generator)).requires_grad_()
    rollout = logprobs.detach() + torch.tensor([[0.0, 0.3, -0.3, -1.5, 0.1]] * 2)  # token 3: weight e^1.5 > 2
    advantages, mask = torch.tensor([1.0, -2.0]), torch.ones(2, 5, dtype=torch.bool)
    totals = {"tokens": 10.0, "sequences": 2.0, "max_tokens": 5.0}
    weights = truncated_importance_weights(logprobs, rollout, 2.0)
    assert weights[0, 3] == 2.0 and weights[0, 1] == pytest.approx(math.exp(-0.3))
    grads = {}
    for cap in (2.0, None):
        loss, parts = policy_loss("dapo", logprobs, logprobs.detach(), advantages, mask, totals,
                                  rollout_logprobs=rollout, is_cap=cap)
        grads[cap], = torch.autograd.grad(loss, logprobs)
    assert torch.allclose(grads[2.0], -weights * advantages[:, None] / 10)
    assert not torch.allclose(grads[None], grads[2.0])  # the control: the weights did something
    assert torch.allclose(grads[None], -advantages[:, None].expand(2, 5) / 10)
    _, parts = policy_loss("dapo", logprobs, logprobs.detach(), advantages, mask, totals, rollout_logprobs=rollout,
                           is_cap=2.0)
    assert parts["is_capped"] == pytest.approx(0.2)  # token 3 of each row
    log_ratio = -(rollout - logprobs.detach())
    assert parts["rollout_kl"] == pytest.approx(float((log_ratio.exp() - 1 - log_ratio).mean()), rel=1e-5)


def test_the_k3_kl_is_clamped():
    logprobs = torch.tensor([-30.0, -1.0, -100.0], requires_grad=True)
    kl = k3_kl(logprobs, torch.tensor([-0.1, -1.2, -0.01]))
    assert kl[0] == KL_CLAMP and 0 < kl[1] < 0.1 and kl[2] == KL_CLAMP
    grad, = torch.autograd.grad(kl.sum(), logprobs)
    assert torch.isfinite(grad).all()  # ref - logp = 100: exp overflowed, a NaN gradient (found by review)


def test_mask_truncated_drops_cut_responses_from_the_loss(tmp_path):
    trainer = make_trainer(tmp_path, **{"grpo.mask_truncated": True, "rollout.max_new_tokens": 2})
    examples = trainer.task.sample(4, seed=0)
    rollout = trainer.rollout(examples)
    batch = trainer.score(examples, rollout)
    cut = torch.tensor([s.finish_reason == "length" for s in rollout.samples])
    assert cut.any() and not batch.packed.response_mask[cut].any()
    assert batch.packed.response_mask[~cut].sum(-1).tolist() == [len(s.token_ids) for s in rollout.samples
                                                                  if s.finish_reason != "length"]
    assert math.isfinite(trainer.update(batch)["loss"])


def test_a_step_whose_every_response_is_masked_says_it_trained_on_nothing(tmp_path, capsys):
    """With grpo.mask_truncated and a budget no response finishes within, a run was a silent no-op (review)."""
    from conftest import tiny_model
    from tlt.distributed.run import train

    model = tiny_model("llama", vocab_size=16, eos_token_id=None)
    trainer = make_trainer(tmp_path / "masked", model=model, **{"grpo.mask_truncated": True, "run.steps": 1})
    trainer.engine.eos_token_ids = []  # (the tiny tokenizer's EOS too) no stop token: every response is cut
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history = train(trainer.config, trainer=trainer)
    assert history[0]["train/tokens"] == 0
    assert "this step trained on 0 tokens" in capsys.readouterr().out
    # no optimizer step: AdamW's decay and momentum would still have moved them (found by review)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    control = make_trainer(tmp_path / "control", model=model, **{"run.steps": 1})
    control.engine.eos_token_ids = []
    assert train(control.config, trainer=control)[0]["train/tokens"] > 0
    assert "trained on 0 tokens" not in capsys.readouterr().out


def test_resume_refuses_a_model_whose_weights_changed_when_it_is_the_kl_reference(tmp_path):
    """The reference is the model as loaded from model.path: changed weights there silently pulled a resumed run
    toward another initial policy (found by review); a changed dataset was already refused."""
    from tlt.rl.checkpoint import CheckpointError, latest_checkpoint

    trainer = make_trainer(tmp_path / "run", **{"grpo.kl_coef": 0.1})
    trainer.train_step()
    trainer.save(tmp_path / "run")
    checkpoint = latest_checkpoint(tmp_path / "run")
    same = make_trainer(tmp_path / "same", **{"grpo.kl_coef": 0.1})
    same.resume(checkpoint)  # the same weights loaded anew: accepted
    assert same.step == 1
    changed = make_trainer(tmp_path / "changed", seed=1, **{"grpo.kl_coef": 0.1})
    with pytest.raises(CheckpointError, match="is not the one the run .* started from"):
        changed.resume(checkpoint)
    without_kl = make_trainer(tmp_path / "nokl", seed=1)  # no reference: the checkpoint holds the whole policy
    without_kl.resume(checkpoint)


def test_the_overlong_penalty_rises_over_the_buffer():
    """DAPO's soft overlong punishment: 0 before the buffer, linear in it, the whole penalty at the budget."""
    from tlt.rl.phases import overlong_penalties

    config = load_config(None, ["rollout.max_new_tokens=100", "grpo.overlong_buffer=20", "grpo.overlong_penalty=0.5"])
    assert overlong_penalties([10, 80, 90, 100], config).tolist() == [0.0, 0.0, 0.25, 0.5]
    with pytest.raises(ConfigError, match=r"grpo.overlong_buffer must be in \[0, rollout.max_new_tokens=100\]"):
        load_config(None, ["rollout.max_new_tokens=100", "grpo.overlong_buffer=101"])


def test_the_overlong_penalty_reaches_the_rewards_and_advantages(tmp_path):
    """Every response of this tiny task is cut at max_new_tokens=6 or stops earlier: with a 6-token buffer each
    loses penalty * length / 6 (the control: none without it)."""
    trainer = make_trainer(tmp_path, **{"grpo.overlong_buffer": 6, "grpo.overlong_penalty": 0.6})
    examples = trainer.task.sample(4, seed=0)
    rollout = trainer.rollout(examples)
    batch = trainer.score(examples, rollout)
    plain = make_trainer(tmp_path / "plain").score(examples, rollout)
    lengths = torch.tensor([len(s.token_ids) for s in rollout.samples], dtype=torch.float32)
    assert torch.allclose(plain.rewards - batch.rewards, 0.6 * lengths / 6)
