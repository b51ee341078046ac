"""The τ a drafter predicts, measured offline: the expected accepted length of its greedy draft chain.

On held-out (prompt, response) pairs, from every response position the drafter drafts a chain of `depth` tokens
the way the engine's chain strategy (S{depth}K1, target-only rule) does: depth 1 from the target's own features,
deeper from its own predicted features. One target forward then scores every chain (a mask shows each chain
token only its own prefix and chain), and the target-only rule gives each drafted token x its acceptance
probability: p_T(x) at temperature T > 0, 1 if x is the target's argmax (else 0) at T = 0. A chain reaches depth
d with probability Π_{i<=d} a_i, so a verify step emits τ = 1 + Σ_d Π_{i<=d} a_i tokens on average (the final,
corrected or bonus, token is always emitted).

Top-1 agreement with teacher forcing (depth 1 only, "is argmax q the target's argmax?") is no acceptance rate at
T > 0 and ignores that deeper drafts feed on the drafter's own features: it overstates τ several-fold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tlt.models.kv_cache import KVCache
from tlt.models.lean_forward import LeanForward

BRANCHES_PER_PASS = 128  # chains scored per target forward: bounds its [T, T] mask on long responses
LOGIT_ROWS = 256         # rows of full-vocabulary logits held at once


@dataclass(frozen=True)
class ChainAcceptance:
    depth: int
    temperature: float
    chains: int                  # response positions a chain was drafted from
    reach_by_depth: list[float]  # mean probability that a chain accepts at least d drafted tokens, d = 1..depth
    tau: float                   # 1 + sum(reach_by_depth): expected tokens per verify step

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def chain_acceptance(drafter, target: LeanForward, prompts: list[list[int]], responses: list[list[int]],
                     depth: int, temperature: float) -> ChainAcceptance:
    """Expected acceptance of greedy chains over every response position (prompts and responses in pairs)."""
    reach = [chain_reach(drafter, target, p, r, depth, temperature) for p, r in zip(prompts, responses)]
    reach = torch.cat(reach) if reach else torch.zeros(0, depth)
    means = reach.mean(0).tolist() if reach.shape[0] else [0.0] * depth
    return ChainAcceptance(depth, temperature, reach.shape[0], means, 1.0 + sum(means))


@torch.no_grad()
def chain_reach(drafter, target: LeanForward, prompt: list[int], response: list[int], depth: int,
                temperature: float) -> torch.Tensor:
    """[chains, depth]: probability that the chain drafted at each response position accepts >= d tokens.

    A chain starts wherever the engine would speculate: the pending token is a response token other than the
    last (after the last one the sequence has ended). Pair i is (x_{i+1}, f_i), as in the engine's catch-up."""
    sequence = torch.tensor(list(prompt) + list(response), device=target.device)
    n = sequence.shape[0]
    starts = torch.arange(len(prompt) - 1, n - 2, device=target.device)  # pair j: pending token x_{j+1}
    if starts.numel() == 0:
        return torch.zeros(0, depth)
    features = _forward(target, sequence, None, torch.arange(n, device=target.device)).hidden[0]
    parts = [_group_reach(drafter, target, sequence, features, group, depth, temperature)
             for group in starts.split(BRANCHES_PER_PASS)]
    return torch.cat(parts).cpu()


def _group_reach(drafter, target, sequence, features, starts, depth: int, temperature: float) -> torch.Tensor:
    drafts = _draft_chains(drafter, sequence, features, starts, depth)           # [G, depth] target ids
    n, groups = sequence.shape[0], starts.shape[0]
    # the target sees the sequence, then chain tokens d_1 .. d_{depth-1} of every start at positions j + 2 ...
    tokens = torch.cat([sequence, drafts[:, :-1].t().reshape(-1)])
    hidden = _forward(target, tokens, *_layout(n, starts + 1, depth - 1)).hidden[0]
    # d_1 is judged by the target's output at the pending token x_{j+1}, d_{l+1} by its output at d_l
    chain_rows = n + torch.arange(depth - 1, device=starts.device)[None, :] * groups + \
        torch.arange(groups, device=starts.device)[:, None]
    rows = torch.cat([(starts + 1)[:, None], chain_rows], 1)                    # [G, depth]
    accept = _acceptance(target, hidden[rows.reshape(-1)], drafts.reshape(-1), temperature)
    return accept.view(groups, depth).cumprod(-1)


def _draft_chains(drafter, sequence, features, starts, depth: int) -> torch.Tensor:
    """Each start's greedy chain: depth 1 from the pair at the start, depth l + 1 from the drafter's own output
    at depth l fed back with the token it drafted (the engine's draft_tree with K = 1)."""
    pairs = sequence.shape[0] - 1
    tokens, feats = sequence[1:], features[:-1]
    hidden = _draft_pass(drafter, tokens, feats, *_layout(pairs, starts, 0))[starts]
    drafts = [_argmax_draft(drafter, hidden)]
    chain_tokens, chain_feats = [], []
    for level in range(1, depth):
        chain_tokens.append(drafts[-1])
        chain_feats.append(hidden)
        out = _draft_pass(drafter, torch.cat([tokens, *chain_tokens]), torch.cat([feats, *chain_feats]),
                          *_layout(pairs, starts, level))
        hidden = out[-starts.shape[0]:]
        drafts.append(_argmax_draft(drafter, hidden))
    return torch.stack(drafts, 1)


def _layout(main: int, limits: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(new-token mask [T, T], positions [T]) for `main` causal tokens followed by `levels` chain tokens per
    start, grouped by level: chain token l of start b sees the main tokens up to limits[b] and its own chain's
    tokens 1..l, at position limits[b] + l."""
    device, groups = limits.device, limits.shape[0]
    size = main + groups * levels
    mask = torch.zeros(size, size, dtype=torch.bool, device=device)
    mask[:main, :main] = torch.ones(main, main, dtype=torch.bool, device=device).tril()
    positions = torch.cat([torch.arange(main, device=device)] + [limits + l for l in range(1, levels + 1)])
    sees_main = torch.arange(main, device=device)[None, :] <= limits[:, None]
    own = torch.eye(groups, dtype=torch.bool, device=device)
    for level in range(levels):
        rows = slice(main + level * groups, main + (level + 1) * groups)
        mask[rows, :main] = sees_main
        for earlier in range(level + 1):
            mask[rows, main + earlier * groups:main + (earlier + 1) * groups] = own
    return mask, positions


def _forward(target: LeanForward, tokens, mask, positions):
    cache = KVCache(target.spec, 1, tokens.shape[0], device=target.device, dtype=target.dtype)
    return target(tokens[None], cache.rows(0, 1), positions=positions[None],
                  new_token_mask=None if mask is None else mask[None], logits_at=None)


def _draft_pass(drafter, tokens, features, mask, positions) -> torch.Tensor:
    cache = drafter.new_cache(1, tokens.shape[0])
    return drafter.step(tokens[None], features[None], cache.rows(0, 1), positions[None], new_token_mask=mask[None])[0]


def _argmax_draft(drafter, hidden) -> torch.Tensor:
    return drafter.to_target_ids(drafter.draft_logits(hidden).argmax(-1))


def _acceptance(target: LeanForward, hidden, drafts, temperature: float) -> torch.Tensor:
    """The target-only rule's acceptance of each drafted token, over the full vocabulary (a draft vocabulary
    renormalized would overstate it), a few hundred rows of logits at a time."""
    out = []
    for rows, tokens in zip(hidden.split(LOGIT_ROWS), drafts.split(LOGIT_ROWS)):
        logits = target.logits(rows).float()
        if temperature > 0:
            logprobs = torch.log_softmax(logits / temperature, -1)
            out.append(logprobs.gather(1, tokens[:, None])[:, 0].exp())
        else:
            out.append((logits.argmax(-1) == tokens).float())
    return torch.cat(out)


@torch.no_grad()
def draft_logits_along(drafter, target: LeanForward, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[len(response), Vd]: the drafter's logits over its draft vocabulary for each response token, teacher-forced
    (pair (x_{j-1}, f_{j-2}) drafts x_j from the target's own features: the first draft of a speculative step).
    A response token with no pair before it (a one-token prompt's first) gets zeros (a uniform q)."""
    sequence = torch.tensor(list(prompt) + list(response), device=target.device)
    n, first = sequence.shape[0], len(prompt)
    out = torch.zeros(len(response), drafter.draft_vocab_size, device=target.device)
    if n < 3:
        return out
    features = _forward(target, sequence, None, torch.arange(n, device=target.device)).hidden[0]
    pairs = n - 1
    hidden = _draft_pass(drafter, sequence[1:], features[:-1], *_layout(pairs, torch.arange(pairs,
                                                                                       device=target.device), 0))
    # pair i drafts x_{i+2}: response token j (absolute index first + j) by pair first + j - 2
    drafted = torch.arange(max(0, 2 - first), len(response), device=target.device)
    out[drafted] = drafter.draft_logits(hidden[first + drafted - 2]).float()
    return out
