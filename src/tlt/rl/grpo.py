"""GRPO math: group-normalized advantages and the policy losses, as short named functions.

Each loss returns the contribution of one micro-batch to the full-batch loss; `totals` (sequences, tokens,
max_tokens of the whole step) fixes the normalizer, so gradient accumulation over micro-batches gives exactly
the gradient of the full batch (micro 1 x accumulation 8 == micro 8 x accumulation 1).
"""

from __future__ import annotations

import torch

from tlt.device_values import metrics_to_host


def group_advantages(rewards: torch.Tensor, *, scale_rewards: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P, n] (n samples of each of P prompts) -> advantages [P, n].

    GRPO: (r - mean_group) / (std_group + eps), with the population std (TRL and verl divide by the sample std, n - 1:
    a constant factor sqrt(n / (n - 1)) on every advantage, which the lr absorbs; the population std is defined for
    groups of one). Dr. GRPO (scale_rewards=False): r - mean_group, since dividing by the std up-weights prompts
    that are nearly always solved or failed. A group of equal rewards gets exactly 0: its float mean may differ
    from the rewards by rounding (1.1 averaged over 12 samples), which the division by a ~0 std blew up to ±0.1.
    """
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    centered = centered.masked_fill((rewards == rewards[:, :1]).all(dim=1, keepdim=True), 0.0)
    if not scale_rewards:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


IMPORTANCE_LEVELS = ("token", "sequence")


def importance_ratio(logprobs, old_logprobs, mask, level: str = "token"):
    """pi / pi_old per token [B, T]. "token": PPO's, each token's own. "sequence": GSPO's (Zheng et al. 2025), the
    sequence's length-normalised ratio s = exp(mean over its tokens of log pi - log pi_old), carried per token as
    sg[s] * pi(y_t) / sg[pi(y_t)] (the paper's GSPO-token form): every token's value is s, its gradient
    s * grad log pi(y_t), so the clipped losses' sequence mean is GSPO's objective and gradient, and the clip acts
    on whole sequences."""
    if level == "token":
        return torch.exp(logprobs - old_logprobs)
    mask = mask.to(logprobs.dtype)
    log_ratio = ((logprobs.detach() - old_logprobs) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
        min=1)
    return torch.exp(log_ratio + logprobs - logprobs.detach())


def clipped_token_losses(logprobs, old_logprobs, advantages, clip_low: float, clip_high: float, mask=None,
                         level: str = "token"):
    """PPO-clip per token: -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A); A broadcast over tokens; the ratio
    of `importance_ratio` at `level` (mask: the response tokens, which a sequence's ratio averages over)."""
    ratio = importance_ratio(logprobs, old_logprobs, mask, level)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), ratio


KL_CLAMP = 10.0  # verl's bound on its low-variance KL: one token the policy all but left cannot swamp the step
LOG_RATIO_CLAMP = 20.0  # ... and on the log-ratio inside it: exp(89) overflows float32, its gradient was NaN


def k3_kl(logprobs, ref_logprobs):
    """Low-variance, non-negative KL(pi || ref) estimator per token: exp(ref - logp) - (ref - logp) - 1, with
    ref - logp within +-LOG_RATIO_CLAMP and the result at most KL_CLAMP (both as verl's)."""
    delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(delta) - delta - 1).clamp(max=KL_CLAMP)


def truncated_importance_weights(old_logprobs, rollout_logprobs, cap: float):
    """min(pi_old / pi_rollout, cap) per token (detached): the policy gradient of samples the rollout drew from
    slightly other numerics, re-weighted toward the training forward's policy (truncated IS, as TRL and verl)."""
    return torch.exp(old_logprobs.detach() - rollout_logprobs).clamp(max=cap)


def aggregate_sequence_mean(token_losses, mask, totals):
    """GRPO: mean over each sequence's tokens, then mean over the step's sequences."""
    per_sequence = (token_losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sequence.sum() / totals["sequences"]


def aggregate_token_mean(token_losses, mask, totals):
    """DAPO: every token of the step weighs the same (long responses are not down-weighted)."""
    return (token_losses * mask).sum() / max(totals["tokens"], 1.0)


def aggregate_constant(token_losses, mask, totals):
    """Dr. GRPO: a constant normalizer (sequences x generation budget), free of length bias."""
    return (token_losses * mask).sum() / (totals["sequences"] * totals["max_tokens"])


AGGREGATIONS = {"grpo": aggregate_sequence_mean, "dapo": aggregate_token_mean, "dr_grpo": aggregate_constant}


def policy_loss(name: str, logprobs, old_logprobs, advantages, mask, totals: dict, *, clip_low: float = 0.2,
                clip_high: float = 0.2, ref_logprobs=None, kl_coef: float = 0.0, rollout_logprobs=None,
                is_cap: float | None = None, entropy=None, host_metrics: bool = True, importance_level: str = "token"):
    """One micro-batch's share of the step loss, plus metrics. logprobs etc. [B, T]; mask [B, T] bool.
    rollout_logprobs: the sampler's own log-probs (metrics of the rollout/training mismatch; with is_cap, the
    policy-gradient term is weighted by `truncated_importance_weights`). entropy [B, T]: logged only.
    host_metrics=False: the metrics stay 0-d device tensors (`metrics_to_host` reads a whole update's at once:
    on a GPU each read is a sync that stops the host from queueing the backward). importance_level: the PPO
    ratio's, per token or per sequence (GSPO; `importance_ratio`)."""
    if name not in AGGREGATIONS:
        raise ValueError(f"unknown loss {name!r}: one of {', '.join(AGGREGATIONS)}")
    if importance_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"unknown importance level {importance_level!r}: one of {', '.join(IMPORTANCE_LEVELS)}")
    mask = mask.float()
    token_losses, ratio = clipped_token_losses(logprobs, old_logprobs, advantages, clip_low, clip_high, mask,
                                               importance_level)
    parts = {}
    if rollout_logprobs is not None:
        parts.update(rollout_mismatch(old_logprobs, rollout_logprobs, mask, is_cap))
        if is_cap is not None:
            token_losses = token_losses * truncated_importance_weights(old_logprobs, rollout_logprobs, is_cap)
    if entropy is not None:
        parts["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
    if ref_logprobs is not None and kl_coef > 0:
        kl = k3_kl(logprobs, ref_logprobs)
        token_losses = token_losses + kl_coef * kl
        parts["kl"] = (kl.detach() * mask).sum() / mask.sum().clamp(min=1)
    loss = AGGREGATIONS[name](token_losses, mask, totals)
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        # tokens whose gradient the clip stops: past the bound on the advantage's side (TRL's definition; a
        # ratio out of range on the other side, or with A = 0, still has its gradient: review)
        adv = advantages[:, None]
        clipped = (((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))).float()
        parts.update(loss=loss.detach(), clip_fraction=(clipped * mask).sum() / count,
                     ratio_mean=(ratio * mask).sum() / count, tokens=mask.sum())
    return loss, (metrics_to_host([parts])[0] if host_metrics else parts)


def rollout_mismatch(old_logprobs, rollout_logprobs, mask, is_cap: float | None) -> dict:
    """How far the rollout's sampling policy is from the training forward's, per response token (mask-weighted
    means): rollout_kl, the k3 estimate of KL(pi_rollout || pi_old) from the rollout's own samples;
    rollout_logprob_gap, mean |log pi_old - log pi_rollout|; with a cap, is_capped, the share of tokens whose
    importance weight was cut to it."""
    with torch.no_grad():
        log_ratio = old_logprobs.detach() - rollout_logprobs  # log(pi_old / pi_rollout)
        count = mask.sum().clamp(min=1)
        kl = torch.expm1(log_ratio) - log_ratio
        parts = {"rollout_kl": (kl * mask).sum() / count,
                 "rollout_logprob_gap": (log_ratio.abs() * mask).sum() / count}
        if is_cap is not None:
            parts["is_capped"] = ((log_ratio.exp() > is_cap).float() * mask).sum() / count
    return parts  # 0-d tensors: `policy_loss` reads them with its own
