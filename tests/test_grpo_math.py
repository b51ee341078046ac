"""GRPO advantages and losses against hand-computed values."""

import math

import pytest
import torch

from tlt.rl.grpo import group_advantages, k3_kl, policy_loss


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards, eps=0.0 + 1e-12)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-6)  # mean .5, std .5
    assert torch.equal(adv[1], torch.zeros(4))  # a solved group teaches nothing
    assert torch.allclose(group_advantages(rewards, scale_rewards=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("n", [4, 12, 21])
@pytest.mark.parametrize("value", [1.1, 0.1, 2.0])
def test_a_group_of_equal_rewards_has_exactly_zero_advantage(n, value):
    """1.1 (correct + the default format bonus) averaged over 12 samples is not 1.1 in float32: the residue over
    std + 1e-6 gave every sample of an all-correct group -0.107 (found by review). Negative control: the
    formula without the equal-group rule shows the residue at this n and value."""
    rewards = torch.full((2, n), value)
    rewards[1, 0] = 0.0  # a mixed group beside it keeps its advantages
    adv = group_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros(n)) and torch.equal(group_advantages(rewards, scale_rewards=False)[0],
                                                                torch.zeros(n))
    assert adv[1, 0] < 0 < adv[1, 1]


def test_the_equal_group_rule_is_needed():
    rewards = torch.full((1, 12), 1.1)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    assert (centered / (rewards.std(dim=1, keepdim=True, unbiased=False) + 1e-6)).abs().max() > 0.05


def setup():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.4, 0.9, 0.1]]))   # ratios: [2, 1, 1], [0.5, 1, 1]
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv = torch.tensor([1.0, -2.0])
    return logp, old, adv, mask


def test_ppo_clip_by_hand_each_aggregation():
    logp, old, adv, mask = setup()
    # token loss = -min(r * A, clip(r) * A). Row 0 (A = 1): r = 2 -> -min(2, 1.2) = -1.2; r = 1 -> -1 (third token
    # masked). Row 1 (A = -2): r = .5 -> -min(-1, -1.6) = 1.6; r = 1 -> 2; r = 1 -> 2.
    totals = {"sequences": 2, "tokens": 5, "max_tokens": 4}
    expected = {
        "grpo": ((-1.2 - 1.0) / 2 + (1.6 + 2 + 2) / 3) / 2,
        "dapo": (-1.2 - 1.0 + 1.6 + 2 + 2) / 5,
        "dr_grpo": (-1.2 - 1.0 + 1.6 + 2 + 2) / (2 * 4),
    }
    for name, value in expected.items():
        loss, parts = policy_loss(name, logp, old, adv, mask, totals, clip_low=0.2, clip_high=0.2)
        assert math.isclose(float(loss), value, rel_tol=1e-5), name
        assert math.isclose(parts["clip_fraction"], 2 / 5, rel_tol=1e-6)  # ratios 2 and .5 are outside


def test_clip_fraction_counts_the_tokens_whose_gradient_the_clip_stops():
    """A ratio out of range on the side the clip does not act on (A > 0 with ratio < 1 - low, A < 0 with ratio >
    1 + high) or with A = 0 keeps its gradient: it was counted as clipped (found by review; TRL's definition).
    Control: the setup's advantages, where both out-of-range tokens are clipped."""
    logp, old, _, mask = setup()  # ratios [2, 1, (masked)], [0.5, 1, 1]
    totals = {"sequences": 2, "tokens": 5, "max_tokens": 4}
    for advantages, expected in ((torch.tensor([1.0, -2.0]), 2 / 5), (torch.tensor([-1.0, 2.0]), 0.0),
                                 (torch.zeros(2), 0.0), (torch.tensor([1.0, 2.0]), 1 / 5)):
        _, parts = policy_loss("grpo", logp, old, advantages, mask, totals)
        assert math.isclose(parts["clip_fraction"], expected, abs_tol=1e-7), advantages


def test_asymmetric_clip_and_unclipped_side():
    logp, old, adv, mask = setup()
    loss, _ = policy_loss("dapo", logp, old, adv, mask, {"sequences": 2, "tokens": 5, "max_tokens": 4},
                          clip_low=0.2, clip_high=0.28)
    assert math.isclose(float(loss), (-1.28 - 1.0 + 1.6 + 2 + 2) / 5, rel_tol=1e-5)


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, requires_grad=True)
    old = torch.randn(4, 6) * 0.1 - 1
    adv = torch.randn(4)
    mask = torch.rand(4, 6) > 0.3
    totals = {"sequences": 4, "tokens": float(mask.sum()), "max_tokens": 6}
    for name in ("grpo", "dapo", "dr_grpo"):
        full = torch.autograd.grad(policy_loss(name, logits * 0.1 - 1, old, adv, mask, totals)[0], logits)[0]
        parts = sum(policy_loss(name, logits[i:i + 1] * 0.1 - 1, old[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                                totals)[0] for i in range(4))
        assert torch.allclose(torch.autograd.grad(parts, logits)[0], full, atol=1e-7), name


def gspo_reference(logp, old, adv, mask, clip_low, clip_high):
    """GSPO's objective as the paper writes it: s_i = exp(mean_t(log pi - log pi_old)) with its gradient, the
    sequence's loss -min(s_i A_i, clip(s_i) A_i), averaged over sequences."""
    m = mask.float()
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    return -torch.minimum(s * adv, s.clamp(1 - clip_low, 1 + clip_high) * adv).mean()


def test_sequence_level_ratio_is_gspos_objective_and_gradient():
    """grpo.importance_level=sequence with the sequence-mean loss: GSPO's loss and gradient, against the paper's
    form computed independently. Control: the token-level ratio on the same inputs has another gradient."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6, requires_grad=True)
    logp = logits * 0.05 - 1
    old = logp.detach() + torch.randn(4, 6) * 0.02  # a second pass: near, not equal
    adv, mask = torch.randn(4), torch.rand(4, 6) > 0.3
    mask[:, 0] = True
    totals = {"sequences": 4, "tokens": float(mask.sum()), "max_tokens": 6}
    for clip in (0.2, 3e-3):  # wide: nothing clipped; narrow: some sequences clipped whole
        loss, parts = policy_loss("grpo", logp, old, adv, mask, totals, clip_low=clip, clip_high=clip,
                                  importance_level="sequence")
        assert (parts["clip_fraction"] > 0) == (clip < 0.1)
        expected = gspo_reference(logp, old, adv, mask, clip, clip)
        assert math.isclose(loss.item(), expected.item(), rel_tol=1e-5)
        ours, theirs = (torch.autograd.grad(value, logits, retain_graph=True)[0] for value in (loss, expected))
        torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=1e-5)
        token = policy_loss("grpo", logp, old, adv, mask, totals, clip_low=clip, clip_high=clip)[0]
        assert not torch.allclose(torch.autograd.grad(token, logits, retain_graph=True)[0], theirs, atol=1e-5)


def test_a_sequence_ratio_out_of_range_stops_every_token_of_it():
    """The clip acts on the whole sequence: row 0's sequence ratio is sqrt(2) (its tokens': 2 and 1), past 1.2
    with A > 0, so none of its tokens has a gradient, though one token's own ratio is in range; row 1's, 2^(-1/3)
    = 0.79 (tokens 0.5, 1, 1), is within 1 - 0.25 with A < 0, so all of its tokens have one, though one token's own
    ratio is out. With one update a step (old = logp) the two levels give one gradient."""
    logp, old, adv, mask = setup()
    logp = logp.clone().requires_grad_(True)
    totals = {"sequences": 2, "tokens": 5, "max_tokens": 4}
    loss, parts = policy_loss("grpo", logp, old, adv, mask, totals, clip_low=0.25, importance_level="sequence")
    grad = torch.autograd.grad(loss, logp)[0]
    assert not grad[0].any() and grad[1].abs().min() > 0
    assert math.isclose(parts["clip_fraction"], 2 / 5, rel_tol=1e-6)  # row 0's two tokens
    same = [torch.autograd.grad(policy_loss("grpo", logp, logp.detach(), adv, mask, totals,
                                            importance_level=level)[0], logp)[0] for level in ("token", "sequence")]
    torch.testing.assert_close(*same)


def test_k3_kl_by_hand_and_in_the_loss():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    delta = math.log(0.5)
    assert torch.allclose(k3_kl(logp, ref), torch.tensor([[0.5 - delta - 1, 0.0]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    base, _ = policy_loss("dapo", logp, logp, torch.zeros(1), mask, {"sequences": 1, "tokens": 2, "max_tokens": 2})
    with_kl, parts = policy_loss("dapo", logp, logp, torch.zeros(1), mask,
                                 {"sequences": 1, "tokens": 2, "max_tokens": 2}, ref_logprobs=ref, kl_coef=0.1)
    assert math.isclose(float(with_kl - base), 0.1 * (0.5 - delta - 1) / 2, rel_tol=1e-5)
    assert parts["kl"] > 0


def test_unknown_loss_is_rejected():
    logp, old, adv, mask = setup()
    with pytest.raises(ValueError, match="unknown loss"):
        policy_loss("ppo2", logp, old, adv, mask, {"sequences": 2, "tokens": 5, "max_tokens": 4})


def test_an_updates_metrics_are_read_once_and_equal_the_per_micro_batch_floats():
    """The update keeps each micro-batch's metrics on the device and reads them in one copy at the end (each
    float() was a sync on a GPU): the same numbers as policy_loss's host metrics."""
    from tlt.rl.grpo import metrics_to_host

    torch.manual_seed(0)
    logp, old = -torch.rand(3, 5), -torch.rand(3, 5)
    adv, mask = torch.randn(3), torch.rand(3, 5) > 0.3
    totals = {"sequences": 3, "tokens": float(mask.sum()), "max_tokens": 5}
    kwargs = dict(ref_logprobs=-torch.rand(3, 5), kl_coef=0.1, rollout_logprobs=-torch.rand(3, 5), is_cap=2.0,
                  entropy=torch.rand(3, 5))
    _, host = policy_loss("grpo", logp, old, adv, mask, totals, **kwargs)
    _, device = policy_loss("grpo", logp, old, adv, mask, totals, **kwargs, host_metrics=False)
    assert all(isinstance(v, torch.Tensor) for v in device.values())
    assert set(host) == {"loss", "clip_fraction", "ratio_mean", "tokens", "entropy", "kl", "rollout_kl",
                         "rollout_logprob_gap", "is_capped"}
    assert all(isinstance(v, float) for v in host.values())
    read = metrics_to_host([device, {"tokens": 2.0}, {}])
    assert read[0] == pytest.approx(host, rel=1e-12) and read[1:] == [{"tokens": 2.0}, {}]
