"""A lean batched inference forward for Llama / Qwen2 / Qwen3 over a KVCache.

It reads the transformers module's own parameter tensors at every call, so an optimizer that updates the
policy in place is seen by the very next rollout step (on CPU in fp32 through packed copies of the weights,
re-packed when a weight's version counter moves: PackedOneDNNLinear). Compared with the transformers forward
it skips per-call mask and cache objects, computes logits only where asked, and returns the final normed
hidden states that the EAGLE drafter consumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tlt.models import kernels
from tlt.models.attention import (aligned_span, attention_mask, grouped_attention_bias, grouped_query_attention,
                                  mask_capacity)
from tlt.models.constants import made_once
from tlt.models.kernel_choice import KERNEL_MAX_NEW_TOKENS, kernels_problem, resolve_kernels
from tlt.models.kv_cache import CacheRows
from tlt.models.onednn_linear import pick_linear
from tlt.models.spec import ModelSpec


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, T', V] at the requested positions (None if none were asked)
    hidden: torch.Tensor         # [B, T, H] final normed hidden states of every input position


# RoPE types whose frequencies transformers recomputes from the longest position of each forward
# (dynamic_rope_update): computed per forward, not looked up in a table. Within the context tlt serves (`rope`'s
# clamp) dynamic's never change; longrope's would, past its short span, which tlt does not serve
# (spec.context_positions): it takes the table.
BATCH_DEPENDENT_ROPE = ("dynamic",)


def rms_norm(x: torch.Tensor, norm_module) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm_module.weight, norm_module.variance_epsilon)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, once per forward: rotate_half(x) * sin == swap_halves(x) * signed_sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in three kernels (mul, cat, addcmul) instead of five (no negation per
    call): a decode step is launch-bound on a GPU, and this runs twice per layer. cos/sin_signed [B, 1, T, D]
    broadcast over heads."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # contiguous [B, heads, T, D]
    # the contiguous operand first: the result takes its layout, so reshaping q for attention stays a view
    # (x is a transposed view of the QKV GEMM's output; with it first, every T > 1 forward copied q per layer)
    return torch.addcmul(swapped * sin_signed, x, cos)


# rollout.compile's values -> torch.compile modes. Never "reduce-overhead": the graph runner captures the step
# itself, with its own static buffers, and Inductor's own CUDA graphs would nest inside that capture.
COMPILE_MODES = {"inductor": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def compile_static(function, mode: str):
    """`function` Inductor-compiled with dynamic shapes (`rollout.compile`), traced without duck sizing: Dynamo
    otherwise assumes that sizes equal when first met stay equal (a decode batch and the cache's rows, both 4
    at first), so the first smaller bucket compiled the forward again (3 graphs instead of 2 where the CPU test
    counts them: ~25 s per compile on an H100)."""
    import torch.fx.experimental._config as fx_config

    compiled = torch.compile(function, mode=COMPILE_MODES[mode], dynamic=True)

    def run(*args, **kwargs):
        if torch.compiler.is_compiling():  # inlined into an enclosing compiled step: its trace's settings hold
            return compiled(*args, **kwargs)
        with fx_config.patch(use_duck_shape=False):  # read when a trace starts: guards never tie sizes
            return compiled(*args, **kwargs)
    return run


def _raise_dynamo_limit(names: tuple[str, ...], floor: int) -> None:
    """Raise a Dynamo limit to at least `floor`, under the first of its names this torch has."""
    config = torch._dynamo.config
    for name in names:
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), floor))
            return


class LeanForward:
    """Inference forward of a transformers Llama/Qwen2/Qwen3 causal LM, sharing its parameters."""

    def __init__(self, model, fused=None):
        """fused: per decoder layer, a `FusedLayer` whose fused q/k/v and gate/up weights the layer's own
        projection parameters are views of (a `RolloutCopy`): one GEMM instead of three, and two."""
        self.model = model
        self.spec = ModelSpec.from_config(model.config)
        self.decoder = model.model  # LlamaModel / Qwen2Model / Qwen3Model
        self.lm_head = model.lm_head
        self.linear = pick_linear(self.device, self.dtype)
        # CUDA: the two projections that feed the residual stream (o_proj, down_proj) add into it inside their
        # GEMM (`add_projection`): one kernel where a linear and an add were two, 60 of a SmolLM2 step's ~540
        self.residual_gemm = self.device.type == "cuda"
        self._fused = {} if fused is None else {id(layer): f for layer, f in zip(self.decoder.layers, fused)}
        self._compiled_run = None  # set by `compile`: the static-shape forward, Inductor-compiled
        self.compile_mode: str | None = None
        self.kernels = "torch"  # `use_kernels`
        self._rope_tables: dict[tuple, torch.Tensor] = {}  # `_rope_table`

    def use_kernels(self, choice: str) -> None:
        """"triton": RoPE with the KV write, attention and SiLU-and-multiply as one fused Triton kernel each
        (models/kernels.py) in forwards of up to KERNEL_MAX_NEW_TOKENS new tokens a row without gradients, and
        no norm kernel where the layer's `FusedLayer` has its norms folded in; "torch": torch's kernels. Triton
        needs CUDA (or its interpreter, for tests). The model runner draws with the fused sampler too. "auto":
        `resolve_kernels`."""
        compiled = self._compiled_run is not None
        problem = kernels_problem(choice, self.device, compiled=compiled)
        if problem is not None:
            raise ValueError(problem)
        self.kernels = resolve_kernels(choice, self.device, compiled=compiled, dtype=self.dtype)

    def _fused_kernels(self, num_new: int) -> bool:
        return self.kernels == "triton" and num_new <= KERNEL_MAX_NEW_TOKENS and not torch.is_grad_enabled()

    def compile(self, mode: str = "inductor") -> None:
        """Inductor-compile the static-shape forward: `run` with a fixed kv_len, which is what the graph runner
        captures (decode steps, verify forwards). Fusion cuts the kernels a step launches (measured on an H100,
        batch 1: 776 -> 394, 2.19 -> 1.31 ms per captured forward, docs/benchmarks.md §9); the graph runner
        still captures the step, so the compiled kernels replay without launch cost. Calls without kv_len
        (prefill, eager plain steps) stay eager. Compiling costs ~25 s per shape family on the first steps: shapes
        that change (batch bucket, KV span) make Dynamo recompile once with them dynamic."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {sorted(COMPILE_MODES)}, got {mode!r}")
        if self.kernels != "torch":
            raise ValueError("compile and kernels='triton' are alternatives: Inductor fuses its own kernels")
        # PackedOneDNNLinear keeps its packs in host-side caches Dynamo cannot trace; Inductor lowers F.linear
        # to its own GEMMs (on CUDA F.linear is the linear in use anyway).
        self.linear = F.linear
        # Each forward instance, and each shape family (decode, tree verify per tree size, padded buckets) is a
        # cache entry of the one code object `_static_run`: past Dynamo's default limit (8) it would silently run
        # eagerly. A process holds a few engines (benchmarks build one per arm), so allow many.
        _raise_dynamo_limit(("recompile_limit", "cache_size_limit"), 256)  # the older name before torch 2.7
        _raise_dynamo_limit(("accumulated_recompile_limit", "accumulated_cache_size_limit"), 1024)
        # dynamic=True: with Dynamo's default (specialize, then recompile what changed) each new KV span and batch
        # cost a compile of 23-30 s on the H100 before the shapes went dynamic (about 4 per arm, found by review
        # with Dynamo on the CPU); graphs capture one shape per key either way.
        self._compiled_run = compile_static(self._static_run, mode)
        self.compile_mode = mode

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and the KV cache (a rollout copy may keep its lm_head in fp32)."""
        return self.decoder.embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.decoder.embed_tokens.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project(hidden, self.lm_head.weight, self.lm_head.bias)

    def project(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """hidden @ weight.T in the weight's dtype: an fp32 lm_head gives fp32 logits from bf16 hidden states."""
        return self.linear(hidden.to(weight.dtype), weight, bias)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: CacheRows, *, positions: torch.Tensor | None = None,
                 new_token_mask: torch.Tensor | None = None, logits_at: str | torch.Tensor | None = "all"
                 ) -> ForwardOutput:
        """Run T new tokens per row; write their KV at slots lengths[b] + t (uncommitted: see KVCache).

        input_ids: [B, T]; positions: [B, T] RoPE positions (default: the slots, i.e. a plain continuation);
        logits_at: "all", "last", None, or a LongTensor [B] (or [B, K]) of indices into T.
        """
        return self.run(input_ids, cache, cache.lengths, positions=positions, new_token_mask=new_token_mask,
                        logits_at=logits_at)

    def run(self, input_ids: torch.Tensor, cache: CacheRows, lengths: torch.Tensor, *,
            positions: torch.Tensor | None = None, new_token_mask: torch.Tensor | None = None,
            logits_at: str | torch.Tensor | None = "all", kv_len: int | None = None) -> ForwardOutput:
        """The forward over explicit row lengths [B]: with device lengths and a fixed kv_len it launches the same
        kernels on the same shapes every call and never reads a device value on the host (CUDA-graph safe);
        such calls run compiled after `compile`."""
        if self._compiled_run is not None and kv_len is not None:
            logits, hidden = self._compiled_run(input_ids, cache, lengths, positions, new_token_mask, logits_at,
                                                kv_len)
            return ForwardOutput(logits, hidden)
        return self._forward(input_ids, cache, lengths, positions, new_token_mask, logits_at, kv_len)

    def _static_run(self, input_ids, cache, lengths, positions, new_token_mask, logits_at, kv_len):
        out = self._forward(input_ids, cache, lengths, positions, new_token_mask, logits_at, kv_len)
        return out.logits, out.hidden  # plain tensors out of the compiled region

    def _forward(self, input_ids: torch.Tensor, cache: CacheRows, lengths: torch.Tensor, positions, new_token_mask,
                 logits_at, kv_len: int | None) -> ForwardOutput:
        device = self.device
        num_new = input_ids.shape[1]
        slots = lengths.to(device)[:, None] + torch.arange(num_new, device=device)[None, :]
        if positions is None:
            positions = slots
        bias = self.attention_bias(lengths, num_new, new_token_mask, kv_len, mask_capacity(cache), self.dtype)
        x = self.embed(input_ids.to(device))
        cos, sin = self.rope(x, positions.to(device))
        rows = torch.arange(input_ids.shape[0], device=device)[:, None]  # the KV writes' row index, once
        for index, layer in enumerate(self.decoder.layers):
            fused = self._fused.get(id(layer))
            normed = self._norm_input(x, layer.input_layernorm, fused is not None and fused.qkv_norm_folded)
            x = self.layer(layer, index, x, normed, cos, sin, cache, slots, bias, rows=rows, fused=fused)
        hidden = rms_norm(x, self.decoder.norm)
        return ForwardOutput(self._logits_at(hidden, logits_at), hidden)

    def attention_bias(self, lengths: torch.Tensor, num_new: int, new_token_mask: torch.Tensor | None,
                       kv_len: int | None, capacity: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The additive attention bias of a forward (`attention_mask`, `grouped_attention_bias`); on the Triton
        kernels one launch (`kernels.attention_bias`), where the torch ops are ~12 a forward."""
        groups = self.spec.num_heads // self.spec.num_kv_heads
        if not self._fused_kernels(num_new):
            mask = attention_mask(lengths, num_new, new_token_mask, self.device, kv_len, capacity=capacity)
            return grouped_attention_bias(mask, groups, dtype)
        if kv_len is None:
            kv_len = int(lengths.max()) + num_new
        lengths = lengths.to(self.device)
        if lengths.dtype != torch.long:
            lengths = lengths.long()
        return kernels.attention_bias(lengths, num_new, new_token_mask, aligned_span(kv_len, capacity), groups,
                                      dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        """cos, signed sin [B, 1, T, D] (`signed_sin`, what `apply_rope` takes) for RoPE positions [B, T], from the
        model's own rotary embedding.

        Positions are clamped to the model's context. Only a speculative tree (or its draft) of a row near the
        limit reaches past it, with nodes whose outputs are never used (they predict tokens past the row's
        budget); unclamped, a dynamic RoPE scaling would rescale the frequencies of the whole batch's forward, and
        a longrope one switch them to its long factors (the context of a longrope model is its short span)."""
        positions = positions.clamp(max=self.spec.max_positions - 1)
        table = self._rope_table(x.device, x.dtype)
        if table is None:
            cos, sin = self.decoder.rotary_emb(x, positions)
            return cos[:, None], signed_sin(sin[:, None])
        both = F.embedding(positions, table)[:, None]                                 # [B, 1, T, 2D]
        dim = table.shape[-1] // 2
        return both[..., :dim], both[..., dim:]

    def _rope_table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """[P, 2D]: cos and signed sin of every position of the model's context, from its rotary embedding, made
        once per (device, dtype): a forward then looks its positions up in one operation, where computing them
        took ten (a GPU step is launch-bound; an SD step has three forwards). The same values: the rotary
        embedding is elementwise in the positions. None (computed per forward) for a RoPE whose frequencies
        depend on the batch's longest position (dynamic) and under torch.compile (Inductor fuses it)."""
        rotary = self.decoder.rotary_emb
        if getattr(rotary, "rope_type", "default") in BATCH_DEPENDENT_ROPE or torch.compiler.is_compiling():
            return None
        def make() -> torch.Tensor:
            cos, sin = rotary(torch.empty(0, dtype=dtype, device=device),
                              torch.arange(self.spec.max_positions, device=device)[None])
            return torch.cat([cos[0], signed_sin(sin[0])], -1)
        return made_once(self._rope_tables, (str(device), dtype), make)

    def layer(self, layer, index: int, residual: torch.Tensor, normed: torch.Tensor | None, cos, sin,
              cache: CacheRows, slots: torch.Tensor, bias: torch.Tensor, *, rows: torch.Tensor | None = None,
              fused=None) -> torch.Tensor:
        """One decoder layer: residual + attention(normed), then + MLP. The EAGLE drafter reuses it with an
        identity input norm (normed = residual), its own cache and its own `FusedLayer` (fused; default: this
        model's, if it has one); bias comes from `grouped_attention_bias`; cos, sin from `rope`;
        rows: arange(B)[:, None] on the device (see `CacheRows.write`). normed None: `_norm_input`'s, the
        projection reads the residual and the fused kernel after it normalizes."""
        fused = self._fused.get(id(layer)) if fused is None else fused
        attn, mlp = layer.self_attn, layer.mlp
        x = self.add_projection(residual, self._attention(layer, index, normed, cos, sin, cache, slots, bias, rows,
                                                          fused, residual), attn.o_proj.weight, attn.o_proj.bias)
        norm = layer.post_attention_layernorm
        mlp_in = self._norm_input(x, norm, fused is not None and fused.gate_up_norm_folded)
        return self.add_projection(x, self._mlp(mlp, mlp_in, fused, x, norm), mlp.down_proj.weight,
                                   mlp.down_proj.bias)

    def _norm_input(self, x: torch.Tensor, norm, folded: bool) -> torch.Tensor | None:
        """What the projection behind RMSNorm `norm` reads: rms_norm(x) with its weight, or, the weight folded into
        the projection (`FusedLayer.*_norm_folded`), without it; None where a fused Triton kernel after the
        projection scales by 1 / rms(x) itself (the projection then reads x: no norm kernel at all)."""
        if not folded:
            return rms_norm(x, norm)
        if self._fused_kernels(x.shape[1]):
            return None
        return F.rms_norm(x, (x.shape[-1],), None, norm.variance_epsilon)

    def add_projection(self, residual: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """residual + hidden @ weight.T. With `residual_gemm` (CUDA), no bias and no autograd: in place, in
        residual's storage, as one GEMM with beta = 1 (cuBLAS reads the addend in its epilogue), and rounded
        once. A layer's residual is always its own (the embedding's output, the previous layer's, the drafter's
        fused input), and every read of it (the input norm, the q/k/v GEMM) comes before this write."""
        if (self.residual_gemm and bias is None and not torch.is_grad_enabled() and residual.is_contiguous()
                and residual.dtype == weight.dtype == hidden.dtype):
            residual.view(-1, residual.shape[-1]).addmm_(hidden.reshape(-1, hidden.shape[-1]), weight.t())
            return residual
        return residual + self.linear(hidden, weight, bias)

    def _attention(self, layer, index: int, h: torch.Tensor | None, cos, sin, cache: CacheRows, slots, bias, rows,
                   fused=None, residual: torch.Tensor | None = None):
        attn, spec = layer.self_attn, self.spec
        norm_input = residual if h is None else None  # the norm is folded: the kernel below scales by 1 / rms
        h = residual if h is None else h
        batch, num_new, _ = h.shape
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if fused is not None:
            qkv = self.linear(h, fused.qkv_weight, fused.qkv_bias).view(batch, num_new, heads + 2 * kv_heads, dim)
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
        else:
            q = self.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(batch, num_new, heads, dim)
            k = self.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(batch, num_new, kv_heads, dim)
            v = self.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(batch, num_new, kv_heads, dim)
        qk_norm = getattr(attn, "q_norm", None) is not None  # the layer's: a Qwen3 target's drafter has a Llama one
        if qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q, k = rms_norm(q, attn.q_norm), rms_norm(k, attn.k_norm)
        kv_len = bias.shape[-1]
        if self._fused_kernels(num_new):  # two kernels for what follows: RoPE + KV write, attention
            eps = 0.0 if norm_input is None else layer.input_layernorm.variance_epsilon  # (a drafter's: Identity)
            kernels.rope_and_store(q, k, v, cos, sin, slots, cache.keys(index), cache.values(index),
                                   norm_input=norm_input, eps=eps)
            return kernels.attention(q, cache.keys(index)[:, :, :kv_len], cache.values(index)[:, :, :kv_len], bias,
                                     attn.scaling)
        if fused is not None and not qk_norm:
            # q and k are adjacent heads of one GEMM's output: rotate them together (half the RoPE kernels)
            qk = apply_rope(qkv[:, :, :heads + kv_heads].transpose(1, 2), cos, sin)   # [B, H + Hkv, T, D]
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = apply_rope(q.transpose(1, 2), cos, sin)   # [B, H, T, D]
            k = apply_rope(k.transpose(1, 2), cos, sin)   # [B, Hkv, T, D]
        cache.write(index, slots, k, v.transpose(1, 2), rows=rows)
        out = grouped_query_attention(q, cache.keys(index)[:, :, :kv_len], cache.values(index)[:, :, :kv_len],
                                      bias, attn.scaling)
        return out.transpose(1, 2).reshape(batch, num_new, spec.num_heads * spec.head_dim)  # o_proj: the caller

    def _mlp(self, mlp, h: torch.Tensor | None, fused=None, residual: torch.Tensor | None = None,
             norm=None) -> torch.Tensor:
        """h None: the post-attention norm is folded into gate/up (`_norm_input`), the fused kernel normalizes."""
        if fused is not None and fused.gate_up_weight is not None:
            gate_up = self.linear(residual if h is None else h, fused.gate_up_weight, None)
            if self._fused_kernels(gate_up.shape[1]):
                return kernels.silu_and_mul(gate_up, norm_input=residual if h is None else None,
                                            eps=norm.variance_epsilon if h is None else 0.0)
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up  # down_proj: the caller's `add_projection`
        gate = F.silu(self.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
        return gate * self.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)

    def _logits_at(self, hidden: torch.Tensor, logits_at) -> torch.Tensor | None:
        if logits_at is None:
            return None
        if isinstance(logits_at, str):
            if logits_at == "all":
                return self.logits(hidden)
            if logits_at == "last":
                return self.logits(hidden[:, -1:])
            raise ValueError(f"logits_at must be 'all', 'last', None or an index tensor, got {logits_at!r}")
        index = logits_at.to(hidden.device)
        if index.dim() == 1:
            index = index[:, None]
        picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.logits(picked)
