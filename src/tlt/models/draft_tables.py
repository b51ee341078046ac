"""The tables a drafter's passes read in one speculative step (`EagleDrafter.chain_tables`, `.tree_tables`):
slots, additive attention bias and RoPE, made once per step so that a pass only takes views of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class ChainTables:
    """Slots [B, P], additive attention bias [B, 1, P, S], RoPE cos / signed sin [B, 1, P, D] of a chain's P
    drafting passes, and each pass's attention span (`EagleDrafter.chain_tables`)."""

    slots: torch.Tensor
    bias: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    spans: list[int]

    def at(self, p: int) -> tuple:
        """`EagleDrafter.step`'s tables for pass p: views, no kernels."""
        return (self.slots[:, p:p + 1], self.bias[:, :, p:p + 1, :self.spans[p]],
                self.cos[:, :, p:p + 1], self.sin[:, :, p:p + 1])


@dataclass
class TreeTables:
    """What a tree's drafting passes need besides their pairs, made once per step (`EagleDrafter.tree_tables`).

    The passes feed the M = (S - 1) K frontier nodes in the order they were chosen (K per pass, pass p feeding
    the first (p + 1) K): each node's slot [B, M] and RoPE cos / signed sin [B, 1, M, D] are known up front;
    its row of the additive attention bias [B, M, S] (0 at the committed slots, its ancestors and itself, -inf
    elsewhere) is written once its parent is chosen: the root's children's by `tree_tables`, a later frontier's
    by `add_nodes`, or by the Triton kernel that chooses it (`draft_kernels.expand_frontier`). A pass's bias is
    then a view of the rows so far on the Triton kernels, which read one row for all query heads of a KV head
    (one expansion over them on torch's), where building it from the lengths, a growing node-visibility matrix
    and RoPE took ~30 operations a pass, and a boolean mask's conversion 4 (2026-11-27)."""

    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    bias: torch.Tensor        # [B, M, S] additive, a node's row written when it is chosen
    spans: list[int]          # each pass's attention span
    groups: int               # query heads per KV head (`grouped_attention_bias`)
    reads_rows: Callable[[int], bool]  # whether a pass of T tokens runs the Triton attention (`_fused_kernels`)

    def add_nodes(self, first: int, k: int, parents: torch.Tensor) -> None:
        """Rows of nodes first .. first + K - 1, the children of the K nodes before them (parents [B, K]: each
        one's index among those K): the parent's row, and the node's own slot."""
        span = self.bias.shape[-1]
        rows = self.bias.gather(1, (first - k + parents)[..., None].expand(-1, -1, span))
        rows.scatter_(2, self.slots[:, first:first + k, None], 0.0)  # each node sees itself
        self.bias[:, first:first + k] = rows

    def at(self, count: int, p: int) -> tuple:
        """`EagleDrafter.step`'s tables for pass p, which feeds the first `count` nodes."""
        bias = self.bias[:, None, :count, :self.spans[p]]                              # a view
        if self.groups > 1 and not self.reads_rows(count):  # torch's attention: rows g * T + t
            bias = bias[:, :, None].expand(-1, -1, self.groups, -1, -1).reshape(
                bias.shape[0], 1, self.groups * count, bias.shape[-1])
        return self.slots[:, :count], bias, self.cos[:, :, :count], self.sin[:, :, :count]
