"""Which kernels a forward runs: torch's, or the fused Triton kernels of models/kernels.py (`rollout.kernels`)."""

from __future__ import annotations

import torch

from tlt.models import kernels

# rollout.kernels' values: torch's own kernels, the fused Triton kernels of models/kernels.py (CUDA), or "auto":
# Triton's where they run (`resolve_kernels`). Measured on an H200 (2026-11-27, benchmarks/results/
# rollout_throughput_h200.json): the graphed bf16 decode step 2.05 -> 1.06 ms at batch 1, 2.48 -> 1.44 at batch 64.
KERNEL_CHOICES = ("auto", "torch", "triton")
# The Triton kernels' floor: bf16 tensor-core dots (Ampere and later), what they were built and tested for
KERNEL_MIN_CAPABILITY = (8, 0)
# The Triton kernels serve forwards of at most this many new tokens a row (decode steps, trees, drafter passes);
# a prompt's prefill keeps SDPA, whose flash kernels are made for long query blocks.
KERNEL_MAX_NEW_TOKENS = 64


def resolve_kernels(choice: str, device: torch.device, *, compiled: bool, dtype: torch.dtype | None = None) -> str:
    """The kernels a forward on `device` runs for rollout.kernels=`choice`: "auto" is "triton" on a CUDA device
    of compute capability 8.0 or more with Triton installed, no Inductor compile (its alternative) and a bf16 or
    fp32 rollout (`dtype`, when known: the precisions the GPU tests ran), "torch" elsewhere (the CPU: oneDNN's
    linears; Triton's interpreter is for tests only); other choices are kept (and checked by `kernels_problem`)."""
    if choice != "auto":
        return choice
    device = torch.device(device)
    usable = (device.type == "cuda" and not compiled and kernels.triton is not None
              and dtype in (None, torch.bfloat16, torch.float32)
              and torch.cuda.get_device_capability(device) >= KERNEL_MIN_CAPABILITY)
    return "triton" if usable else "torch"


def kernels_problem(choice: str, device: torch.device, *, compiled: bool) -> str | None:
    """Why a forward on `device` cannot use kernels=`choice` (None: it can); compiled: it is, or will be,
    Inductor-compiled (`LeanForward.compile`), the alternative to the Triton kernels."""
    if choice not in KERNEL_CHOICES:
        return f"kernels must be one of {KERNEL_CHOICES}, got {choice!r}"
    if choice in ("auto", "torch"):  # auto: whatever `resolve_kernels` picks runs
        return None
    reason = kernels.unavailable_reason(device)
    if reason is not None:
        return f"kernels='triton': {reason}"
    if compiled:
        return "kernels='triton' and compile are alternatives: Inductor fuses its own kernels"
    return None
