"""Shared helpers for the benchmarks: environment record, memory bandwidth, prompt sets, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from tlt.threads import cpu_model

# Chat prompts whose natural answers range from one word to several paragraphs: a mixed-length rollout.
MIXED_PROMPTS = [
    "What is the capital of France? Answer with one word.",
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Is 17 a prime number? Answer yes or no.",
    "Explain how photosynthesis works, step by step.",
    "Name a primary color.",
    "Describe the water cycle in detail for a school report.",
    "What is 12 + 30? Reply with the number only.",
    "List ten ideas for a weekend trip and explain each one.",
    "Translate 'good morning' into Spanish.",
    "Write a long essay about the history of the printing press.",
    "Give a one-sentence definition of gravity.",
    "Explain, with examples, how to compute the area of a triangle, a circle and a trapezoid.",
    "What color is the sky on a clear day? One word.",
    "Write a recipe for pancakes with detailed instructions.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Explain the difference between a list and a tuple in Python, with code examples.",
]


def environment() -> dict:
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_model(),
           "python": platform.python_version(), "device": "cuda" if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name()
        # tlt's engines turn cuDNN's attention off for the process (attention.keep_cudnn_attention_out)
        env["cudnn_sdp"] = torch.backends.cuda.cudnn_sdp_enabled()
    return env


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, repeats: int, device="cpu") -> float:
    """Median seconds of fn() after one warm-up call; on CUDA each call is timed to its completion."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(megabytes: int = 256, repeats: int = 10, device="cpu") -> dict:
    """Copy and read bandwidth of a buffer far larger than the caches (GB/s, medians), on `device`."""
    src = torch.randn(megabytes * 2**20 // 4, device=device)
    dst = torch.randn_like(src)  # touched, so the copy really streams both buffers
    nbytes = src.numel() * 4

    copy_s = median_time(lambda: dst.copy_(src), repeats, device)
    read_s = median_time(lambda: src.sum(), repeats, device)
    return {"copy_gbs": nbytes / copy_s / 1e9,             # buffer bytes copied per second
            "copy_read_write_gbs": 2 * nbytes / copy_s / 1e9,  # STREAM convention: bytes read + written
            "read_gbs": nbytes / read_s / 1e9}


def unique_parameter_bytes(model) -> int:
    seen, total = set(), 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total


def write_json(path: str | None, payload: dict, *, echo: bool = True) -> None:
    """Write payload to path (and print it unless echo=False). Atomic: a benchmark killed at its time limit
    leaves the last complete write, never half a file; benchmarks write partial results as they go, marked
    `"complete": false` until the last write."""
    text = json.dumps(payload, indent=2)
    if echo:
        print(text)
    if path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_name(f".{target.name}.partial")
        scratch.write_text(text + "\n")
        os.replace(scratch, target)
