"""How much to speculate in one step: draft depth S, branching K, tree size N, and the acceptance rule."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tlt.errors import TltError

RULES = ("target", "q")  # target-only tree sampling; speculative sampling with the drafter's probabilities q


class StrategyError(TltError):
    """A speculation strategy that cannot be built."""


@dataclass(frozen=True)
class SpecStrategy:
    """depth S: draft tokens along the longest path; branching K: children expanded per frontier node and
    frontier width per depth (EAGLE-2); tree_size N: draft nodes verified by the target (excluding the root).
    A chain is branching 1 with tree_size = depth.

    rule "target": children are the drafter's top-K, accepted with the target's probability p (the drafter's
    probabilities are unused). rule "q": children are sampled from the drafter's processed distribution q
    without replacement and verified by recursive rejection sampling, min(1, p/q) with the residual
    (p - q)+ after each rejected sibling; every node keeps all its sampled children (pruning siblings by their
    draft score would bias the draws), so N = K + (S - 1) * K^2 and is implied."""

    depth: int
    branching: int = 1
    tree_size: int | None = None
    rule: str = "target"

    def __post_init__(self):
        sizes = (self.depth, self.branching) + (() if self.tree_size is None else (self.tree_size,))
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
            raise StrategyError(f"depth, branching and tree_size must be integers, got depth={self.depth!r}, "
                                f"branching={self.branching!r}, tree_size={self.tree_size!r}")
        if self.rule not in RULES:
            raise StrategyError(f"acceptance rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.depth < 1 or self.branching < 1:
            raise StrategyError(f"depth and branching must be >= 1, got depth={self.depth}, "
                                f"branching={self.branching}")
        most = self.branching + (self.depth - 1) * self.branching ** 2  # candidates EAGLE-2 can produce
        default = most if self.rule == "q" else self.depth * self.branching
        size = default if self.tree_size is None else self.tree_size
        object.__setattr__(self, "tree_size", size)
        if self.rule == "q" and size != most:
            raise StrategyError(f"a q-sampling tree keeps every sampled child: tree_size must be {most} for depth "
                                f"{self.depth} and branching {self.branching}, got {size}")
        if not self.depth <= size <= most:
            raise StrategyError(f"tree_size must be in [{self.depth}, {most}] for depth {self.depth} and branching "
                                f"{self.branching}, got {size}")

    @classmethod
    def chain(cls, depth: int, rule: str = "target") -> "SpecStrategy":
        return cls(depth, 1, depth, rule)

    @classmethod
    def parse(cls, text: str) -> "SpecStrategy":
        """'S4K2N8' (target-only rule) or 'S4K2q' / 'S4K2N14q' (q-sampling)."""
        match = re.fullmatch(r"S([0-9]+)K([0-9]+)(?:N([0-9]+))?(q?)", str(text).strip())  # ASCII digits only
        if match is not None and match.group(3) is None and not match.group(4):
            depth, branching = int(match.group(1)), int(match.group(2))
            raise StrategyError(f"strategy {text!r} names no acceptance rule: S{depth}K{branching}N<tree size> for "
                                f"target-only (e.g. S{depth}K{branching}N{depth * branching}) or S{depth}K{branching}q "
                                f"for q-sampling")
        if match is None:
            cased = str(text).strip().upper()
            cased = cased[:-1] + "q" if cased.endswith("Q") else cased  # s4k2n8 -> S4K2N8, s4k2q -> S4K2q
            fits = cased != str(text).strip() and re.fullmatch(r"S[0-9]+K[0-9]+(?:N[0-9]+)?q?", cased)
            hint = f" (the letters are case-sensitive: {cased!r}?)" if fits else ""
            raise StrategyError(f"strategy must look like S4K2N8 (depth S, branching K, tree size N) or S4K2q "
                                f"(q-sampling), got {text!r}{hint}")
        depth, branching, size, q = match.groups()
        return cls(int(depth), int(branching), None if size is None else int(size), "q" if q else "target")

    @property
    def name(self) -> str:
        return f"S{self.depth}K{self.branching}N{self.tree_size}" + ("q" if self.rule == "q" else "")

    @property
    def cache_slots(self) -> int:
        """Cache slots a step writes past the committed tokens: the verified tree, or the drafter's frontier
        nodes ((S - 1) K) when those outnumber it (e.g. S4K3N5): what an engine's max_tree_size must hold."""
        return max(self.tree_size, (self.depth - 1) * self.branching)

    @property
    def uniforms_per_row(self) -> int:
        """Pre-drawn uniforms one step needs per row. Target-only: per depth, one for the children and one for
        the final sample. q-sampling: per depth, one per child and one for the final sample, plus one per
        sampled child (drafting)."""
        if self.rule == "target":
            return 2 * (self.depth + 1)
        return (self.depth + 1) * (self.branching + 1) + self.tree_size

    def __str__(self) -> str:
        return self.name
