"""The fused sampler on CUDA: a token per row by inverse CDF, one Triton program per row (22 torch operations a
draw), and the block search it shares with the drafter's draws (`draft_kernels.py`).

The CDF is built as `sampling.sample_from_logprobs` builds it, in float64 per 256-token block; a program reads 16
blocks a step. Off CUDA it runs under Triton's interpreter (TRITON_INTERPRET=1), which is how the CPU tests check it
against the torch path.
"""

from __future__ import annotations

import torch

from tlt.models.kernels import _on_device_of, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _block_mass(Base, b, VOCAB, BLOCK: tl.constexpr):
        """The probabilities of one block of a row's log-probabilities, and their float64 sum."""
        cols = b * BLOCK + tl.arange(0, BLOCK)
        p = tl.exp(tl.load(Base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32))
        return p, tl.sum(p.to(tl.float64), 0)

    @triton.jit
    def _tile_columns(t, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        """The token ids [GROUP, BLOCK] of tile t: GROUP consecutive blocks, one per row. A program reads a whole
        tile per step: one 256-token block per step left a row's draw to ~400 dependent steps at 49k tokens."""
        return (t * GROUP + tl.arange(0, GROUP))[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]

    @triton.jit
    def _find_block(masses, cumulative, before, block, target):
        """One tile's step of the search for the block holding `target`: masses [GROUP] float64 are its blocks'
        sums; counts the blocks whose CDF is <= target and keeps the CDF before the first that is not."""
        cdf = cumulative + tl.cumsum(masses, 0)
        passed = cdf <= target
        block += tl.sum(passed.to(tl.int32), 0)
        before = tl.maximum(before, tl.max(tl.where(passed, cdf, 0.0), 0))
        return tl.max(cdf, 0), before, block

    @triton.jit
    def _draw_in_block(p, before, target, block, VOCAB, BLOCK: tl.constexpr):
        """The token of block `block` (probabilities p [BLOCK]) where the CDF passes target."""
        shrink = 2.220446049250313e-16  # x * (1 - 2^-52) < x: the torch path's nextafter(x, 0)
        inner = tl.cumsum(p.to(tl.float64), 0)
        last = tl.max(inner, 0)
        offset = tl.minimum(tl.maximum(target - before, 0.0), last - last * shrink)
        within = tl.minimum(tl.sum((inner <= offset).to(tl.int32), 0), BLOCK - 1)
        return tl.minimum(block * BLOCK + within, VOCAB - 1).to(tl.int64)

    @triton.jit
    def _sample_kernel(LogProbs, Uniforms, Out, lp_s, VOCAB, BLOCKS, TILES, GROUP: tl.constexpr,
                       BLOCK: tl.constexpr):
        # one program per row: inverse-CDF sampling at two levels (blocks of BLOCK tokens, then inside the block),
        # the CDF in float64 as `sampling.sample_from_logprobs` builds it, GROUP blocks a step
        row = tl.program_id(0).to(tl.int64)
        base = LogProbs + row * lp_s
        total = tl.zeros([], tl.float64)
        for t in range(0, TILES):
            cols = _tile_columns(t, GROUP, BLOCK)
            p = tl.exp(tl.load(base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32))
            total += tl.sum(tl.sum(p.to(tl.float64), 1), 0)
        shrink = 2.220446049250313e-16
        target = tl.minimum(tl.load(Uniforms + row).to(tl.float64) * total, total - total * shrink)
        cumulative = tl.zeros([], tl.float64)
        before = tl.zeros([], tl.float64)
        block = tl.zeros([], tl.int32)
        for t in range(0, TILES):
            cols = _tile_columns(t, GROUP, BLOCK)
            p = tl.exp(tl.load(base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32))
            cumulative, before, block = _find_block(tl.sum(p.to(tl.float64), 1), cumulative, before, block, target)
        block = tl.minimum(block, BLOCKS - 1)
        p, _ = _block_mass(base, block, VOCAB, BLOCK)
        tl.store(Out + row, _draw_in_block(p, before, target, block, VOCAB, BLOCK))


SAMPLE_GROUP = 16  # 256-token blocks a program reads per step (4,096 tokens): a row's draw in ~24 steps at 49k


def sample_from_logprobs(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`sampling.sample_from_logprobs` in one kernel: a token per row of logprobs [B, V] from uniforms [B] in
    [0, 1), by the same two-level float64 inverse CDF (256-token blocks). Its sums run in another order, so a draw
    may differ from torch's only where a uniform falls within float64 rounding of a token's boundary; a token of
    probability 0 is never drawn."""
    logprobs = logprobs if logprobs.stride(-1) == 1 else logprobs.contiguous()
    batch, vocab = logprobs.shape
    out = torch.empty(batch, dtype=torch.long, device=logprobs.device)
    uniforms = uniforms.to(logprobs.device, torch.float64).contiguous()
    block = 256  # sampling.CDF_BLOCK (not imported: models/ sits below sampling)
    blocks = triton.cdiv(vocab, block)
    with _on_device_of(logprobs):
        _sample_kernel[(batch,)](logprobs, uniforms, out, logprobs.stride(0), vocab, blocks,
                                 triton.cdiv(blocks, SAMPLE_GROUP), GROUP=SAMPLE_GROUP, BLOCK=block, num_warps=8)
    return out
