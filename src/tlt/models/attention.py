"""Attention over a KV cache in torch: the boolean mask of committed slots and new tokens, its additive bias for
grouped queries, grouped-query SDPA, and the span a CUDA graph's attention reads (`LeanForward`'s torch path; the
Triton kernels of models/kernels.py follow the same mask rule)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tlt.models.kv_cache import CacheRows

ATTENTION_ALIGN = 16  # SDPA's memory-efficient kernel pads (copies) a mask whose last dim is not a multiple of 16


def aligned_span(kv_len: int, capacity: int | None) -> int:
    """kv_len rounded up to a multiple of ATTENTION_ALIGN, but not past the cache's `capacity` slots (None:
    kv_len as is). The extra slots are masked out (exact zeros in the softmax), yet a longer reduction may sum
    in another order: the result can differ in the last bit, so only CUDA, where SDPA would pad, asks for it."""
    if capacity is None:
        return kv_len
    return min(-(-kv_len // ATTENTION_ALIGN) * ATTENTION_ALIGN, max(capacity, kv_len))


def mask_capacity(cache: CacheRows) -> int | None:
    """The capacity `attention_mask` may round a span up to: the cache's, on CUDA (None elsewhere: CPU results
    stay bit-identical to exact spans, and CPU SDPA does not pad)."""
    return cache.cache.max_len if cache.cache.device.type == "cuda" else None


def attention_mask(lengths: torch.Tensor, num_new: int, new_token_mask: torch.Tensor | None,
                   device, kv_len: int | None = None, capacity: int | None = None) -> torch.Tensor:
    """Boolean [B, 1, T, S] mask: every committed slot of the row, plus the new tokens it may see.

    new_token_mask [B, T, T] says which new tokens each new token attends to (a tree mask for verification);
    None means causal. New token t of row b sits at slot lengths[b] + t. kv_len (S) defaults to the longest
    row + T, read from host lengths; a CUDA graph passes a fixed S and device lengths (no host sync). With the
    cache's capacity given, S is rounded up to a multiple of ATTENTION_ALIGN within it (`aligned_span`).
    """
    if kv_len is None:
        kv_len = int(lengths.max()) + num_new
    kv_len = aligned_span(kv_len, capacity)
    lengths = lengths.to(device)
    rel = torch.arange(kv_len, device=device)[None, :] - lengths[:, None]          # [B, S]
    committed = (rel < 0)[:, None, :]                                                 # [B, 1, S]
    t = torch.arange(num_new, device=device)[None, :, None]                          # [1, T, 1]
    rel = rel[:, None, :]                                                             # [B, 1, S]
    if new_token_mask is None:
        new = (rel >= 0) & (rel <= t)
    else:
        in_block = (rel >= 0) & (rel < num_new)
        gathered = new_token_mask.to(device).gather(
            2, rel.clamp(0, num_new - 1).expand(-1, num_new, -1))                   # [B, T, S]
        new = in_block & gathered
    return (committed | new)[:, None]                                                 # [B, 1, T, S]


def grouped_attention_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Turn a boolean [B, 1, T, S] mask into the additive bias of `grouped_query_attention`, once per forward
    (SDPA would otherwise convert the boolean mask in every layer: measured 6% of a batch-64 decode step)."""
    batch, _, num_new, kv_len = mask.shape
    if groups > 1 and num_new > 1:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * num_new, kv_len)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))


def grouped_query_attention(q, k, v, bias, scale: float) -> torch.Tensor:
    """SDPA for GQA without expanding K/V: the G query heads that share a KV head become G x T queries
    of that head (q [B, H, T, D], k/v [B, Hkv, S, D], bias from `grouped_attention_bias` -> [B, H, T, D]).

    Measured ~20% faster than SDPA's enable_gqa at batch 64 on CPU, and it never copies the cache.
    """
    batch, heads, num_new, dim = q.shape
    kv_heads = k.shape[1]
    if heads > kv_heads:
        q = q.reshape(batch, kv_heads, heads // kv_heads * num_new, dim)  # head h = kv * G + g, as in repeat_kv
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return out.reshape(batch, heads, num_new, dim)  # SDPA's output may be strided on CUDA


def keep_cudnn_attention_out(device: torch.device) -> None:
    """On CUDA, take cuDNN out of SDPA's backends for this process.

    torch 2.11 with cuDNN >= 9.15 puts cuDNN first for masked bf16 attention on Hopper and newer, and cuDNN
    builds an execution plan for every (batch, length) it has not seen: ~0.4 s forward and ~0.55 s backward per
    new shape reported with torch 2.11 (modelscope/FunASR#3704). The update's and the log-probs' micro-batches
    are padded to new lengths at every step, so each step would pay that in every micro-batch; the
    memory-efficient kernel that takes over has no plan to build. The rollout's graphs never used cuDNN
    (`graph_runner.CAPTURED_ATTENTION`); its prefills (a new prompt length each) and the drafter's training did.
    Every engine on CUDA calls this (and so every replica, `tlt generate`, the drafter's warm-up). Process-wide
    rather than an `sdpa_kernel` context per forward: that sets global flags too, and in-process workers on
    threads would race over restoring them."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
