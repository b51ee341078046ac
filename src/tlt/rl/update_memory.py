"""Will the update's largest micro-batch fit in memory? A warning before it runs, not a refusal.

A training forward keeps every layer's activations for the backward, so its memory grows with the micro-batch's
padded tokens. Past what the machine has, a CUDA device raises (the worker's error then says what needs less), but
a CPU process is killed by the kernel's out-of-memory killer, with no message at all: a CLI trial's 8k-token
prompt ended `tlt train` that way. This estimates the activations and says so first, naming the settings that
need less. It is an estimate (measured below), so it warns and lets the step run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Bytes a token's activations take, per layer, in units of the element size. Measured on the CPU in fp32 with
# SmolLM2-135M (30 layers, hidden 576, intermediate 1536), forward and backward of one row
# (benchmarks/update_memory.py): 1.69 MB a token at 2,048 tokens, 1.77 at 4,096, against 30 x (12 x 576 + 4 x 1536)
# x 4 B = 1.57 MB by this rule (the rest: the weights' gradients, a fixed 0.54 GB). With gradient checkpointing
# 0.99 and 0.76 MB a token: about half.
HIDDEN_FACTOR, INTERMEDIATE_FACTOR = 12, 4
CHECKPOINTED_SHARE = 0.5
WARNED: set = set()  # (rows, length bucket) already warned about in this process


def activation_bytes(config, tokens: int, *, element_size: int, checkpointed: bool) -> int:
    """Estimated activation bytes of a training forward and backward over `tokens` padded tokens."""
    per_layer = HIDDEN_FACTOR * config.hidden_size + INTERMEDIATE_FACTOR * getattr(config, "intermediate_size", 0)
    estimate = config.num_hidden_layers * per_layer * element_size * tokens
    return int(estimate * (CHECKPOINTED_SHARE if checkpointed else 1.0))


def available_bytes(device: torch.device) -> int | None:
    """Memory free for a new allocation: the device's on CUDA, the kernel's MemAvailable on Linux, else None."""
    if device.type == "cuda":  # the device's free memory and what torch's allocator holds unused (the rollout's)
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def warn_if_it_may_not_fit(model, rows: int, width: int, *, element_size: int, checkpointed: bool) -> None:
    """Log once per (rows, length bucket) when the estimate passes what is available."""
    needed = activation_bytes(model.config, rows * width, element_size=element_size, checkpointed=checkpointed)
    free = available_bytes(next(model.parameters()).device)
    key = (rows, width.bit_length())  # one warning per row count and power-of-two length
    if free is None or needed <= free or key in WARNED:
        return
    WARNED.add(key)
    fixes = ("optim.grad_checkpointing=true, " if not checkpointed else "") + \
        "a smaller optim.micro_batch_size, or shorter prompts and rollout.max_new_tokens"
    log.warning("the update's largest micro-batch (%d row(s) of %d tokens) needs about %.1f GiB of activations, "
                "and %.1f GiB are free: it may run out of memory (on the CPU the system then kills the process "
                "without a message); %s need less", rows, width, needed / 2**30, free / 2**30, fixes)
