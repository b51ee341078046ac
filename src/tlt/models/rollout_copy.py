"""The policy in the rollout's precision: a bf16 (or other dtype) inference copy refreshed from the master weights.

Training keeps fp32 master weights; decoding reads a copy in the rollout dtype (bf16 on CUDA halves the bytes
every decode step streams). The copy is laid out for inference: each layer's q/k/v projections are views of one
fused [q; k; v] weight and gate/up of one [gate; up] weight, so a decode step runs one GEMM where the master runs
three (or two); `refresh()` copies the master into these views in place (no reallocation, so captured CUDA graphs
stay valid).

With fold_norms, the RMSNorm weight g in front of each fused GEMM is folded into its columns: rms_norm(x, g) @ W^T
== r(x) * (x @ (W diag g)^T), r(x) = 1 / rms(x) a scalar per token, so the forward can apply r after the GEMM
(inside the fused Triton kernel that consumes the GEMM's output) and a layer launches no norm kernel. Folded
weights are computed from the fp32 master at every refresh and rounded once. Not for a q/k/v bias (it must not
scale by r) nor Qwen3's q/k norms (which would see r x q): those layers keep their input norm.

The lm_head stays fp32: bf16 logits are quantized to 1/8 at magnitudes 16-32, which would move sampling
probabilities by several percent against the fp32 log-probs the PPO ratio is computed from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FusedLayer:
    """One decoder layer's fused projection weights (rows in the order of the separate projections)."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor | None  # None when the MLP has biases (kept as separate projections)
    qkv_norm_folded: bool = False        # qkv_weight holds W diag(g) of the input norm (RolloutCopy fold_norms)
    gate_up_norm_folded: bool = False    # gate_up_weight holds W diag(g) of the post-attention norm


class RolloutCopy:
    """An inference copy of a transformers causal LM in `dtype`, with fused projections and an fp32 lm_head."""

    def __init__(self, master: nn.Module, dtype: torch.dtype, *, fold_norms: bool = False):
        self.master = master
        self.dtype = dtype
        device = master.lm_head.weight.device
        with torch.device("meta"):
            model = type(master)(master.config)
        model = model.to(dtype).to_empty(device=device)
        model.model.rotary_emb = master.model.rotary_emb  # fp32 buffers computed at init: share, never train
        model.lm_head.weight = nn.Parameter(torch.empty_like(master.lm_head.weight, dtype=torch.float32))
        self.fused = [fuse_layer(layer) for layer in model.model.layers]
        if fold_norms:
            qk_norm = getattr(model.model.layers[0].self_attn, "q_norm", None) is not None
            for fused in self.fused:
                fused.qkv_norm_folded = fused.qkv_bias is None and not qk_norm
                fused.gate_up_norm_folded = fused.gate_up_weight is not None
        model.requires_grad_(False).eval()
        self.model = model
        self._pairs = self._match_parameters()
        self.refresh()

    def _match_parameters(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(master tensor, copy tensor, the master's norm weight folded into it or None) for every parameter name
        of the copy; a tied master pairs its one embedding tensor with both the copy's embedding and its separate
        fp32 lm_head."""
        master = dict(self.master.named_parameters(remove_duplicate=False))
        folded = self._folded_norms(master)
        pairs = []
        for name, tensor in self.model.named_parameters(remove_duplicate=False):
            source = master.get(name)
            if source is None and name == "lm_head.weight":
                source = self.master.get_output_embeddings().weight
            if source is None or source.shape != tensor.shape:
                raise ValueError(f"rollout copy: no master parameter matches {name} {tuple(tensor.shape)}")
            pairs.append((source, tensor, folded.get(name)))
        return pairs

    def _folded_norms(self, master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy parameter name -> the master norm weight its columns are scaled by (fold_norms)."""
        folded = {}
        for index, fused in enumerate(self.fused):
            prefix = f"model.layers.{index}."
            if fused.qkv_norm_folded:
                for name in ("q_proj", "k_proj", "v_proj"):
                    folded[f"{prefix}self_attn.{name}.weight"] = master[f"{prefix}input_layernorm.weight"]
            if fused.gate_up_norm_folded:
                for name in ("gate_proj", "up_proj"):
                    folded[f"{prefix}mlp.{name}.weight"] = master[f"{prefix}post_attention_layernorm.weight"]
        return folded

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the master weights into the copy (device to device, converting dtype), in place; folded
        projections as W diag(g), computed at the master's precision and rounded once."""
        for source, target, norm in self._pairs:
            target.copy_(source if norm is None else source * norm, non_blocking=True)


def fuse_layer(layer: nn.Module) -> FusedLayer:
    """Re-point q/k/v and gate/up parameters at slices of one fused tensor each (in place on the copy). The
    fused tensors are new and uninitialized: load the weights into the parameters after (they are views)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
    qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "bias") if attn.q_proj.bias is not None else None
    gate_up = _fuse([mlp.gate_proj, mlp.up_proj], "weight") if mlp.gate_proj.bias is None else None
    return FusedLayer(qkv, qkv_bias, gate_up)


def _fuse(modules: list[nn.Linear], name: str) -> torch.Tensor:
    parts = [getattr(m, name) for m in modules]
    fused = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                        device=parts[0].device)
    row = 0
    for module, part in zip(modules, parts):
        setattr(module, name, nn.Parameter(fused[row:row + part.shape[0]], requires_grad=False))
        row += part.shape[0]
    return fused
