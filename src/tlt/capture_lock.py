"""One CUDA-graph capture at a time in a process.

A capture's start synchronizes the device and empties the allocator's cache (torch.cuda.graph), and a device-wide
synchronize from one thread can invalidate a capture underway on another (thread_local mode notwithstanding:
reported for CUDA by NVIDIA/TensorRT#2888 and llama.cpp#14033). Captures come from several threads: in-process
workers on several GPUs, and on one GPU the decode loop's graph runner beside the drafter's tail trainer
(drafter/step_graph.py). Every capture holds this lock; captures are rare (a new bucket, a moved tensor).
"""

from __future__ import annotations

import threading

CAPTURING = threading.Lock()
