"""Rollout workers, spot drafter training on idle workers, drafter hot-swap, and the worker timeline."""

from tlt.distributed.controller import DistributedGRPO
from tlt.distributed.hub import DrafterHub

__all__ = ["DistributedGRPO", "DrafterHub"]
