"""Fused Triton kernels for the rollout's forward on CUDA: fewer, larger launches per decoder layer.

A batch-1 decode step of a small model is launch-bound on a GPU: the H100 replayed 540 kernels in 1.79 ms for
SmolLM2-135M (~3.3 us each) against ~0.09 ms of weight streaming (docs/benchmarks.md §9). Per layer, torch ran
RoPE as three kernels (cat, mul, addcmul), the KV write as two index_puts, attention as cuDNN's kernel plus a
memset plus a copy of its strided output, and SiLU-and-multiply as two. Here each group is one kernel:

- `rope_and_store`: rotate q (in place) and k, write k and v into the cache at each row's slots;
- `attention`: masked attention of T new tokens over the cache with grouped KV heads, written straight into
  the [B, T, H * D] layout o_proj reads (the KV span split over more programs when the batch gives too few to
  fill the device, each query block's parts merged by its last split to arrive, in the same launch);
- `attention_bias`: a forward's additive attention bias (committed slots, causal or tree-masked new tokens),
  where `attention_mask` + `grouped_attention_bias` took ~12 torch operations;
- `silu_and_mul`: the MLP's activation from the fused gate/up GEMM's output.

The sampler (a draw by inverse CDF, one program per row) is in `sample_kernels.py`, the speculative step's
bookkeeping in `draft_kernels.py` and `tree_kernels.py`.

The first two and SiLU also take the un-normalized residual when a rollout copy folds the norms into its
projections (`RolloutCopy(fold_norms=True)`) and scale by 1 / rms(x) themselves: a layer launches no norm kernel.

Each computes in fp32 and rounds once (torch's bf16 path rounds between its kernels: results agree to bf16
rounding, not bit for bit; the PPO ratio's log-probs come from the training forward either way). Attention's two
products run on tensor cores in TF32 for bf16/fp16 caches (bf16 inputs are exact in TF32; only the softmax
weights lose bits, below bf16's rounding) and in IEEE fp32 for an fp32 cache. They run only where nothing needs
a gradient. Off CUDA they run under Triton's interpreter (`TRITON_INTERPRET=1`, set before
this module is imported), which is how the CPU tests check them against the torch path.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:  # optional: the CUDA wheels of torch bring Triton; the CPU machines install it for the interpreter tests
    import triton
    import triton.language as tl
    MISSING = None
except (ImportError, OSError, RuntimeError) as error:  # absent, or an install that cannot load here
    triton = None
    MISSING = (f"Triton cannot be imported ({type(error).__name__}: {error}); pip install triton (CUDA builds of "
               "torch bring it)")

KV_SPLIT_CHUNK = 128        # KV slots per program when attention splits the span (`attention_splits`; a guess
                            # until the H100 measures it: batch 1 of SmolLM2 has 3 KV heads, so 3 programs unsplit)
TARGET_PROGRAMS = 128       # about one program per SM of an H100 (132): fewer leaves the device idle


# Triton fixes interpreter mode when a kernel is defined (below, at import): what counts is the variable then
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` (None: they can)."""
    if triton is None:
        return MISSING
    if torch.device(device).type != "cuda" and not INTERPRETED:
        return (f"the Triton kernels run on CUDA (or, for tests, under TRITON_INTERPRET=1 set before tlt is "
                f"imported), not on {device}")
    return None


if triton is not None:

    @triton.jit
    def _inverse_rms(X, HIDDEN, eps, BLOCK_HIDDEN: tl.constexpr):
        """1 / rms(x) of one token's hidden state, as RMSNorm computes it (fp32 mean of squares, + eps)."""
        cols = tl.arange(0, BLOCK_HIDDEN)
        x = tl.load(X + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
        return tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)

    @triton.jit
    def _rope_and_store_kernel(Q, K, V, Cos, Sin, Slots, KCache, VCache, X,
                               q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh,
                               c_sb, c_st, s_sb, s_st, slot_sb, slot_st,
                               kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss, x_sb, x_st,
                               T, HEADS, KV_HEADS, CAPACITY, HIDDEN, eps,
                               HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                               BLOCK_HIDDEN: tl.constexpr):
        # one program per (row, new token) x head of q, k or v
        token = tl.program_id(0)
        head = tl.program_id(1)
        b = (token // T).to(tl.int64)  # int64 row offsets: a large cache's row stride times B passes 2^31
        t = token % T
        i = tl.arange(0, BLOCK)
        inside = i < HALF
        slot = tl.load(Slots + b * slot_sb + t * slot_st)
        writable = inside & (i * 0 + slot < CAPACITY)  # a slot past the cache is dropped, never written past it
        if NORM:  # the input norm's weight is folded into the projection: scale its output by 1 / rms(x) here
            scale = _inverse_rms(X + b * x_sb + t * x_st, HIDDEN, eps, BLOCK_HIDDEN)
        else:
            scale = 1.0
        if head < HEADS + KV_HEADS:
            if head < HEADS:
                x_ptr = Q + b * q_sb + t * q_st + head * q_sh
            else:
                x_ptr = K + b * k_sb + t * k_st + (head - HEADS) * k_sh
            x1 = tl.load(x_ptr + i, mask=inside, other=0.0).to(tl.float32) * scale
            x2 = tl.load(x_ptr + HALF + i, mask=inside, other=0.0).to(tl.float32) * scale
            cos = Cos + b * c_sb + t * c_st
            sin = Sin + b * s_sb + t * s_st  # signed: rotate_half(x) * sin == swap_halves(x) * signed sin
            y1 = x1 * tl.load(cos + i, mask=inside, other=0.0).to(tl.float32) \
                + x2 * tl.load(sin + i, mask=inside, other=0.0).to(tl.float32)
            y2 = x2 * tl.load(cos + HALF + i, mask=inside, other=0.0).to(tl.float32) \
                + x1 * tl.load(sin + HALF + i, mask=inside, other=0.0).to(tl.float32)
            if head < HEADS:  # q in place: attention reads it from the projection's output
                tl.store(x_ptr + i, y1.to(Q.dtype.element_ty), mask=inside)
                tl.store(x_ptr + HALF + i, y2.to(Q.dtype.element_ty), mask=inside)
            else:
                out = KCache + b * kc_sb + (head - HEADS) * kc_sh + slot * kc_ss
                tl.store(out + i, y1.to(KCache.dtype.element_ty), mask=writable)
                tl.store(out + HALF + i, y2.to(KCache.dtype.element_ty), mask=writable)
        else:
            kv_head = head - HEADS - KV_HEADS
            x_ptr = V + b * v_sb + t * v_st + kv_head * v_sh
            out = VCache + b * vc_sb + kv_head * vc_sh + slot * vc_ss
            v1 = tl.load(x_ptr + i, mask=inside, other=0.0).to(tl.float32) * scale
            v2 = tl.load(x_ptr + HALF + i, mask=inside, other=0.0).to(tl.float32) * scale
            tl.store(out + i, v1.to(VCache.dtype.element_ty), mask=writable)
            tl.store(out + HALF + i, v2.to(VCache.dtype.element_ty), mask=writable)

    @triton.jit
    def _query_block(row_head, T, GROUPS, KV_HEADS, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr):
        """Program (row b, KV head) = row_head, block program_id(1) of its G x T query rows: b, the KV head, each
        row's group g, token t, whether it exists, its query head, and the head dimension's lanes."""
        b = (row_head // KV_HEADS).to(tl.int64)
        kv_head = row_head % KV_HEADS
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        g = m // T
        d = tl.arange(0, BLOCK_D)
        return b, kv_head, g, m % T, m < GROUPS * T, kv_head * GROUPS + g, d, d < HEAD_DIM

    @triton.jit
    def _attention_kernel(Q, K, V, Bias, Out, PartAcc, PartMax, PartSum, Arrivals,
                          q_sb, q_sh, q_st, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
                          bias_sb, bias_sg, bias_st, o_sb, o_st, o_sh,
                          T, GROUPS, KV_HEADS, KV_LEN, CHUNK, SPLITS, scale,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                          LAST_COMBINES: tl.constexpr):
        # program (row b, KV head), a block of its G x T query rows (query head kv * G + g, new token t), a split
        row_head = tl.program_id(0)
        b, kv_head, g, t, rows_ok, head, d, d_ok = _query_block(row_head, T, GROUPS, KV_HEADS, HEAD_DIM, BLOCK_D,
                                                                 BLOCK_M)
        split = tl.program_id(2)
        q = tl.load(Q + b * q_sb + head[:, None] * q_sh + t[:, None] * q_st + d[None, :],
                    mask=rows_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        q = q * scale
        bias_rows = Bias + b * bias_sb + g[:, None] * bias_sg + t[:, None] * bias_st
        keys = K + b * k_sb + kv_head * k_sh
        values = V + b * v_sb + kv_head * v_sh
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, KV_LEN)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            k_t = tl.load(keys + n[None, :] * k_ss + d[:, None], mask=d_ok[:, None] & n_ok[None, :],
                          other=0.0).to(tl.float32)                                         # [D, N]
            if IEEE:
                scores = tl.dot(q, k_t, input_precision="ieee")
            else:
                scores = tl.dot(q, k_t)
            scores += tl.load(bias_rows + n[None, :], mask=rows_ok[:, None] & n_ok[None, :],
                              other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing visible yet: no NaN
            rescale = tl.exp(running_max - base)
            p = tl.exp(scores - base[:, None])
            running_sum = running_sum * rescale + tl.sum(p, 1)
            v = tl.load(values + n[:, None] * v_ss + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)                                           # [N, D]
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p, v)
            running_max = new_max
        if SPLIT:  # partial results of this split: `_combine_kernel`, or the block's last split, merges them
            part = (b * KV_HEADS * GROUPS + head) * T + t                                   # [M] (row, head, token)
            tl.store(PartMax + part * SPLITS + split, running_max, mask=rows_ok)
            tl.store(PartSum + part * SPLITS + split, running_sum, mask=rows_ok)
            tl.store(PartAcc + (part[:, None] * SPLITS + split) * BLOCK_D + d[None, :], acc,
                     mask=rows_ok[:, None])
            if LAST_COMBINES:
                # One arrival count per query block: the split that arrives last (acq_rel: it sees the others'
                # partials, stored before their arrival) merges them and resets the count for the next launch,
                # where a separate combine kernel was one more launch per attention (30 a SmolLM2 step)
                block = row_head * tl.num_programs(1) + tl.program_id(1)
                # the barriers: every thread's partial stores before the (one-thread) release, and every
                # thread's partial loads after the acquire
                tl.debug_barrier()
                arrived = tl.atomic_add(Arrivals + block, 1, sem="acq_rel")
                tl.debug_barrier()
                if arrived == SPLITS - 1:
                    _combine_block(PartAcc, PartMax, PartSum, Out, part, b, head, t, rows_ok, d, d_ok,
                                   o_sb, o_st, o_sh, SPLITS, BLOCK_D, BLOCK_M)
                    tl.atomic_xchg(Arrivals + block, 0)
        else:
            out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
            tl.store(Out + b * o_sb + t[:, None] * o_st + head[:, None] * o_sh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=rows_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _combine_block(PartAcc, PartMax, PartSum, Out, part, b, head, t, rows_ok, d, d_ok, o_sb, o_st, o_sh,
                       SPLITS, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """A query block's SPLITS partials merged (.cg: from L2, where the other programs' stores landed): by the
        block's last split to arrive, or by `_combine_kernel`."""
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for s in range(0, SPLITS):
            top = tl.maximum(top, tl.load(PartMax + part * SPLITS + s, mask=rows_ok, other=float("-inf"),
                                          cache_modifier=".cg"))
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in range(0, SPLITS):
            maxes = tl.load(PartMax + part * SPLITS + s, mask=rows_ok, other=float("-inf"), cache_modifier=".cg")
            weight = tl.where(maxes > float("-inf"), tl.exp(maxes - tl.where(top > float("-inf"), top, 0.0)), 0.0)
            total += weight * tl.load(PartSum + part * SPLITS + s, mask=rows_ok, other=0.0, cache_modifier=".cg")
            acc += weight[:, None] * tl.load(PartAcc + (part[:, None] * SPLITS + s) * BLOCK_D + d[None, :],
                                             mask=rows_ok[:, None], other=0.0, cache_modifier=".cg")
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(Out + b * o_sb + t[:, None] * o_st + head[:, None] * o_sh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=rows_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _combine_kernel(PartAcc, PartMax, PartSum, Out, o_sb, o_st, o_sh, T, GROUPS, KV_HEADS, SPLITS,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """The split partials of a query block merged in a launch of their own (no arrival counts to hand)."""
        row_head = tl.program_id(0)
        b, kv_head, g, t, rows_ok, head, d, d_ok = _query_block(row_head, T, GROUPS, KV_HEADS, HEAD_DIM, BLOCK_D,
                                                                 BLOCK_M)
        part = (b * KV_HEADS * GROUPS + head) * T + t
        _combine_block(PartAcc, PartMax, PartSum, Out, part, b, head, t, rows_ok, d, d_ok, o_sb, o_st, o_sh,
                       SPLITS, BLOCK_D, BLOCK_M)

    @triton.jit
    def _attention_bias_kernel(Lengths, NewMask, Bias, nm_sb, nm_st, b_sb, b_sr, T, KV_LEN,
                               BLOCK: tl.constexpr, TREE: tl.constexpr):
        """Row r (new token t = r % T of a query head group) of row b's additive bias: 0 where it sees the slot
        (committed, or a new token it attends to), -inf elsewhere; `attention.attention_mask`'s rule."""
        b = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1)
        t = r % T
        length = tl.load(Lengths + b)
        for s0 in range(0, KV_LEN, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            rel = s - length
            if TREE:
                seen = tl.load(NewMask + b * nm_sb + t * nm_st + tl.minimum(tl.maximum(rel, 0), T - 1),
                               mask=s < KV_LEN, other=0) != 0
                new = (rel >= 0) & (rel < T) & seen
            else:
                new = (rel >= 0) & (rel <= t)
            visible = (rel < 0) | new
            tl.store(Bias + b * b_sb + r * b_sr + s, tl.where(visible, 0.0, float("-inf")).to(Bias.dtype.element_ty),
                     mask=s < KV_LEN)

    @triton.jit
    def _silu_and_mul_kernel(GateUp, Out, X, INTERMEDIATE, gu_s, o_s, x_s, HIDDEN, eps, BLOCK: tl.constexpr,
                             NORM: tl.constexpr, BLOCK_HIDDEN: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = j < INTERMEDIATE
        gate = tl.load(GateUp + row * gu_s + j, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(GateUp + row * gu_s + INTERMEDIATE + j, mask=inside, other=0.0).to(tl.float32)
        if NORM:  # the post-attention norm's weight is folded into gate/up: 1 / rms(x) scales both here
            scale = _inverse_rms(X + row * x_s, HIDDEN, eps, BLOCK_HIDDEN)
            gate = gate * scale
            up = up * scale
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(Out + row * o_s + j, out.to(Out.dtype.element_ty), mask=inside)


def _on_device_of(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' (an eager step of a worker on another GPU)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}: the kernels read the last dimension contiguously, got strides {tensor.stride()}")


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                   slots: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
                   norm_input: torch.Tensor | None = None, eps: float = 0.0) -> None:
    """RoPE on q in place and on k, then k and v into the cache: one kernel.

    q [B, T, H, D], k and v [B, T, Hkv, D] (views of the q/k/v projection's output); cos and signed sin
    [B, 1, T, D] (`LeanForward.rope`); slots [B, T] on the device; key_cache / value_cache [B, Hkv, S, D] views
    of one layer's cache rows. A slot past S is not written (torch's index_put would fault the device).
    norm_input [B, T, hidden]: the projection read this un-normalized (its norm weight folded into it,
    `RolloutCopy(fold_norms=True)`): q, k and v are first scaled by 1 / rms(norm_input) (RMSNorm's eps)."""
    _check_last_dim_contiguous(q=q, k=k, v=v, cos=cos, sin=sin_signed, key_cache=key_cache, value_cache=value_cache)
    if norm_input is not None:
        _check_last_dim_contiguous(norm_input=norm_input)
    x = q if norm_input is None else norm_input  # (q: a placeholder the kernel never reads)
    grid = (q.shape[0] * q.shape[1], q.shape[2] + 2 * k.shape[2])  # (row, token) x the heads of q, k and v
    with _on_device_of(q):
        _launch_rope_and_store(grid, q, k, v, cos, sin_signed, slots, key_cache, value_cache, x, eps)


def _launch_rope_and_store(grid, q, k, v, cos, sin_signed, slots, key_cache, value_cache, x, eps) -> None:
    batch, num_new, heads, dim = q.shape
    kv_heads, half = k.shape[2], dim // 2
    _rope_and_store_kernel[grid](
        q, k, v, cos, sin_signed, slots, key_cache, value_cache, x,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        cos.stride(0), cos.stride(2), sin_signed.stride(0), sin_signed.stride(2), slots.stride(0), slots.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), x.stride(0), x.stride(1),
        num_new, heads, kv_heads, key_cache.shape[2], x.shape[-1], eps,
        HALF=half, BLOCK=triton.next_power_of_2(half), NORM=x is not q,
        BLOCK_HIDDEN=triton.next_power_of_2(x.shape[-1]), num_warps=1)


def attention_splits(programs: int, kv_len: int) -> int:
    """How many parts the KV span is split into: enough programs to fill the device, chunks of >= KV_SPLIT_CHUNK.
    Static for a given shape, so a CUDA graph captures one launch configuration."""
    if programs >= TARGET_PROGRAMS or kv_len <= KV_SPLIT_CHUNK:
        return 1
    return max(1, min(-(-kv_len // KV_SPLIT_CHUNK), -(-TARGET_PROGRAMS // programs)))


def attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, bias: torch.Tensor,
              scale: float, *, splits: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v for T new tokens of each row over its cache rows, grouped KV heads.

    q [B, T, H, D] (any strides but the last); key_cache / value_cache [B, Hkv, S, D]; bias the additive
    [B, 1, R, S] of `grouped_attention_bias` (R = T, or G * T expanded over the G query heads of a KV head,
    or 1 for T = 1). Returns [B, T, H * D], the layout o_proj reads. splits: parts of the KV span run by
    separate programs (default `attention_splits`)."""
    _check_last_dim_contiguous(q=q, key_cache=key_cache, value_cache=value_cache, bias=bias)
    batch, num_new, heads, dim = q.shape
    kv_heads, kv_len = key_cache.shape[1], key_cache.shape[2]
    groups = heads // kv_heads
    if bias.shape[-1] != kv_len:
        raise ValueError(f"attention: bias spans {bias.shape[-1]} slots, the cache view {kv_len}")
    rows = bias.shape[2]
    if rows == groups * num_new and groups > 1 and num_new > 1:   # expanded: row g * T + t
        bias_sg, bias_st = num_new * bias.stride(2), bias.stride(2)
    elif rows == num_new:
        bias_sg, bias_st = 0, bias.stride(2)
    elif rows == 1:
        bias_sg, bias_st = 0, 0
    else:
        raise ValueError(f"attention: bias has {rows} query rows for {num_new} tokens and {groups} groups")
    out = torch.empty(batch, num_new, heads, dim, dtype=q.dtype, device=q.device)
    block_m = 16  # tl.dot's smallest tile
    m_blocks = -(-(groups * num_new) // block_m)
    splits = attention_splits(batch * kv_heads * m_blocks, kv_len) if splits is None else splits
    chunk = -(-kv_len // splits)
    block_n = 64 if dim <= 64 else 32
    chunk = -(-chunk // block_n) * block_n
    splits = -(-kv_len // chunk)
    block_d = max(16, triton.next_power_of_2(dim))
    if splits > 1:
        parts = batch * heads * num_new * splits
        part_acc = torch.empty(parts, block_d, dtype=torch.float32, device=q.device)
        part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(parts, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out  # unused
    with _on_device_of(q):
        arrivals = _arrival_counts(q.device, batch * kv_heads * m_blocks) if splits > 1 else None
        _launch_attention((batch * kv_heads, m_blocks, splits), q, key_cache, value_cache, bias, out, part_acc,
                          part_max, part_sum, arrivals, bias_sg, bias_st, groups, chunk, splits, scale, block_d,
                          block_m, block_n)
    return out.view(batch, num_new, heads * dim)


# The arrival counts of split attention's query blocks: zero between launches (each block's last split resets its
# own), one buffer per (device, stream), kept for the process (a captured graph holds its address). Splits only
# happen below TARGET_PROGRAMS blocks.
ARRIVAL_SLOTS = 1024
_ARRIVALS: dict = {}


def _arrival_counts(device: torch.device, blocks: int) -> torch.Tensor | None:
    """This stream's arrival counts, or None (the split partials then merge in `_combine_kernel`, one more
    launch): more blocks than slots, or a first use inside a CUDA graph capture (a buffer made there would
    belong to the graph's pool and its zeroing to the graph: the graph runner's warm-up runs make it before)."""
    if blocks > ARRIVAL_SLOTS:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    counts = _ARRIVALS.get(key)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _ARRIVALS[key] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    return counts


def _launch_attention(grid, q, key_cache, value_cache, bias, out, part_acc, part_max, part_sum, arrivals, bias_sg,
                      bias_st, groups, chunk, splits, scale, block_d, block_m, block_n) -> None:
    batch, num_new, heads, dim = q.shape
    kv_heads, kv_len = key_cache.shape[1], key_cache.shape[2]
    last_combines = arrivals is not None
    _attention_kernel[grid](
        q, key_cache, value_cache, bias, out, part_acc, part_max, part_sum, arrivals if last_combines else out,
        q.stride(0), q.stride(2), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        bias.stride(0), bias_sg, bias_st, out.stride(0), out.stride(1), out.stride(2),
        num_new, groups, kv_heads, kv_len, chunk, splits, scale,
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=splits > 1,
        IEEE=q.dtype == torch.float32, LAST_COMBINES=last_combines, num_warps=4)
    if splits > 1 and not last_combines:
        _combine_kernel[grid[:2]](
            part_acc, part_max, part_sum, out, out.stride(0), out.stride(1), out.stride(2), num_new, groups, kv_heads,
            splits, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=4)


def attention_bias(lengths: torch.Tensor, num_new: int, new_token_mask: torch.Tensor | None, kv_len: int, groups: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """`grouped_attention_bias(attention_mask(...))` in one launch, where the two took ~12 operations: the
    additive [B, 1, R, kv_len] bias (R = groups * T for trees of several tokens, else T) of rows whose committed
    lengths are `lengths` [B] (device), causal or with new_token_mask [B, T, T]."""
    batch = lengths.shape[0]
    rows = groups * num_new if groups > 1 and num_new > 1 else num_new
    bias = torch.empty(batch, 1, rows, kv_len, dtype=dtype, device=lengths.device)
    tree = new_token_mask is not None
    new_mask = new_token_mask.to(lengths.device).contiguous() if tree else lengths
    with _on_device_of(lengths):
        _attention_bias_kernel[(batch, rows)](
            lengths, new_mask, bias, new_mask.stride(0) if tree else 0, new_mask.stride(1) if tree else 0,
            bias.stride(0), bias.stride(2), num_new, kv_len, BLOCK=min(1024, triton.next_power_of_2(kv_len)),
            TREE=tree, num_warps=4)
    return bias


def silu_and_mul(gate_up: torch.Tensor, *, norm_input: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """silu(gate) * up from the fused [..., 2I] gate/up projection output, in one kernel: [..., I]. norm_input
    [..., hidden]: gate/up read it un-normalized (the norm's weight folded in): both are first scaled by
    1 / rms(norm_input)."""
    _check_last_dim_contiguous(gate_up=gate_up)
    intermediate = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    norm = norm_input is not None
    x = norm_input.reshape(-1, norm_input.shape[-1]) if norm else flat
    out = torch.empty(flat.shape[0], intermediate, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(intermediate))
    with _on_device_of(gate_up):
        _silu_and_mul_kernel[(flat.shape[0], triton.cdiv(intermediate, block))](
            flat, out, x, intermediate, flat.stride(0), out.stride(0), x.stride(0), x.shape[-1], eps, BLOCK=block,
            NORM=norm, BLOCK_HIDDEN=triton.next_power_of_2(x.shape[-1]), num_warps=4)
    return out.view(*gate_up.shape[:-1], intermediate)
