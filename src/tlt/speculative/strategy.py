"""How much to speculate in one step: draft depth S, branching K, tree size N."""

from __future__ import annotations

from dataclasses import dataclass

from tlt.errors import TltError


class StrategyError(TltError):
    """A speculation strategy that cannot be built."""


@dataclass(frozen=True)
class SpecStrategy:
    """depth S: draft tokens along the longest path; branching K: children expanded per frontier node and
    frontier width per depth (EAGLE-2); tree_size N: draft nodes verified by the target (excluding the root).
    A chain is branching 1 with tree_size = depth."""

    depth: int
    branching: int = 1
    tree_size: int | None = None

    def __post_init__(self):
        size = self.depth * self.branching if self.tree_size is None else self.tree_size
        object.__setattr__(self, "tree_size", size)
        if self.depth < 1 or self.branching < 1:
            raise StrategyError(f"depth and branching must be >= 1, got depth={self.depth}, "
                                f"branching={self.branching}")
        most = self.branching + (self.depth - 1) * self.branching ** 2  # candidates EAGLE-2 can produce
        if not self.depth <= size <= most:
            raise StrategyError(f"tree_size must be in [depth, {most}] for depth {self.depth} and branching "
                                f"{self.branching}, got {size}")

    @classmethod
    def chain(cls, depth: int) -> "SpecStrategy":
        return cls(depth, 1, depth)

    @property
    def name(self) -> str:
        return f"S{self.depth}K{self.branching}N{self.tree_size}"

    def __str__(self) -> str:
        return self.name
