"""Fused Triton kernels for the speculative step's draws: a drafter's children sampled without replacement.

On a GPU a speculative step of a small model is launch-bound like a plain step (docs/benchmarks.md §9: ~2.8 us a
kernel on the H100), and past the verify forward most of its launches are bookkeeping at [B, F, Vd] or smaller:
drawing the K children of each expanded node from q (`q_sampling.draw_without_replacement`) took 14 operations a
depth with the fused sampler (a clone, K draws each with its greedy argmax and score gather, the scatter that
removes a drawn token, two stacks). `draw_without_replacement` here is one launch a depth, one program per
expanded node, drawing its K children in turn by the same two-level float64 inverse CDF as
`sampling.sample_from_logprobs` over q with the earlier draws removed.

Off CUDA it runs under Triton's interpreter (TRITON_INTERPRET=1), which is how the CPU tests check it against the
torch path, token for token.
"""

from __future__ import annotations

import torch

from tlt.models.kernels import _on_device_of, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _remaining_mass(Base, b, VOCAB, drawn, BLOCK: tl.constexpr):
        """One block's probabilities with the tokens already drawn removed, and their float64 sum."""
        cols = b * BLOCK + tl.arange(0, BLOCK)
        logq = tl.load(Base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
        removed = tl.sum((cols[:, None] == drawn[None, :]).to(tl.int32), 1) > 0
        p = tl.where(removed, 0.0, tl.exp(logq))
        return p, tl.sum(p.to(tl.float64), 0)

    @triton.jit
    def _draw_kernel(LogQ, Uniforms, Greedy, Scores, Ids, lq_s, u_sb, u_sf, FRONTIER, VOCAB, BLOCKS,
                     K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        # one program per expanded node (row b * FRONTIER + f): its K children in turn
        row = tl.program_id(0).to(tl.int64)
        b = row // FRONTIER
        base = LogQ + row * lq_s
        greedy = tl.load(Greedy + b) != 0
        slots = tl.arange(0, KP)
        drawn = tl.full([KP], -1, tl.int64)  # the tokens drawn so far (-1: none yet)
        shrink = 2.220446049250313e-16       # x * (1 - 2^-52) < x: the torch path's nextafter(x, 0)
        for i in tl.static_range(K):
            if greedy:  # the first index of the largest remaining log q, as torch.argmax
                best = tl.full([], float("-inf"), tl.float32)
                token = tl.zeros([], tl.int64)
                for blk in range(0, BLOCKS):
                    cols = blk * BLOCK + tl.arange(0, BLOCK)
                    logq = tl.load(base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
                    removed = tl.sum((cols[:, None] == drawn[None, :]).to(tl.int32), 1) > 0
                    logq = tl.where(removed | (cols >= VOCAB), float("-inf"), logq)
                    top = tl.max(logq, 0)
                    first = tl.min(tl.where(logq == top, cols, 2147483647), 0)
                    better = top > best
                    token = tl.where(better, first.to(tl.int64), token)
                    best = tl.where(better, top, best)
            else:  # inverse CDF at two levels, as sampling.sample_from_logprobs
                total = tl.zeros([], tl.float64)
                for blk in range(0, BLOCKS):
                    _, mass = _remaining_mass(base, blk, VOCAB, drawn, BLOCK)
                    total += mass
                u = tl.load(Uniforms + b * u_sb + (row % FRONTIER) * u_sf + i).to(tl.float64)
                target = tl.minimum(u * total, total - total * shrink)
                cumulative = tl.zeros([], tl.float64)
                before = tl.zeros([], tl.float64)
                block = tl.zeros([], tl.int32)
                for blk in range(0, BLOCKS):
                    _, mass = _remaining_mass(base, blk, VOCAB, drawn, BLOCK)
                    cumulative += mass
                    passed = cumulative <= target
                    block += passed.to(tl.int32)
                    before = tl.where(passed, cumulative, before)
                block = tl.minimum(block, BLOCKS - 1)
                p, _ = _remaining_mass(base, block, VOCAB, drawn, BLOCK)
                inner = tl.cumsum(p.to(tl.float64), 0)
                last = tl.max(inner, 0)
                offset = tl.minimum(tl.maximum(target - before, 0.0), last - last * shrink)
                within = tl.minimum(tl.sum((inner <= offset).to(tl.int32), 0), BLOCK - 1)
                token = tl.minimum(block * BLOCK + within, VOCAB - 1).to(tl.int64)
            # log q of the drawn token; -inf for a token drawn before (a draw made after q ran out of mass)
            again = tl.sum((drawn == token).to(tl.int32), 0) > 0
            score = tl.where(again, float("-inf"), tl.load(base + token).to(tl.float32))
            tl.store(Scores + row * K + i, score.to(Scores.dtype.element_ty))
            tl.store(Ids + row * K + i, token)
            drawn = tl.where(slots == i, token, drawn)


def draw_without_replacement(logq: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor):
    """`q_sampling.draw_without_replacement` in one launch: logq [B, F, V], uniforms [B, F, K], greedy [B] ->
    (log q of each drawn token [B, F, K], -inf for a draw made after q ran out of mass; token ids [B, F, K]).
    The same draws as torch's up to float64 rounding at a token's boundary (its sums run in another order)."""
    batch, frontier, vocab = logq.shape
    k = uniforms.shape[-1]
    logq = logq if logq.stride(-1) == 1 and logq.stride(1) == vocab else logq.contiguous()
    if uniforms.stride(-1) != 1:
        uniforms = uniforms.contiguous()
    scores = torch.empty(batch, frontier, k, dtype=logq.dtype, device=logq.device)
    ids = torch.empty(batch, frontier, k, dtype=torch.long, device=logq.device)
    block = 256  # sampling.CDF_BLOCK
    with _on_device_of(logq):
        _draw_kernel[(batch * frontier,)](logq, uniforms, greedy, scores, ids, logq.stride(1), uniforms.stride(0),
                                          uniforms.stride(1), frontier, vocab, triton.cdiv(vocab, block), K=k,
                                          KP=triton.next_power_of_2(k), BLOCK=block, num_warps=4)
    return scores, ids

