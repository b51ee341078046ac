"""oneDNN's linear over packed weights: the CPU's fast exact fp32 linear for decoding.

A oneDNN primitive is made per input shape and kept in oneDNN's primitive cache (1,024 entries) and ideep's LRU
cache: ~0.65 MB and ~1.4 ms to make each, for SmolLM2's shapes on the 2-core dev machines. A prefill or scoring
forward of another length each RL step made new ones every step, so a CPU run's memory grew by ~1-2 MB a step for
hundreds of steps until the caches filled (a soak trial: +300 MB over 300 steps; both caches capped at 16: flat).
So inputs of more than ROUNDED_ABOVE rows are padded to a row count of a few values per octave (at most 1/8 more
rows): the shapes a run meets stay a small set, each made once.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

ROUNDED_ABOVE = 64  # up to here every row count is its own shape: decode batches and verify trees, made once each
STEPS_PER_OCTAVE = 8  # above it: row counts rounded up to 8 values per power of two (<= 12.5% more rows)


def padded_rows(rows: int) -> int:
    """The row count an input of `rows` rows is computed at (itself up to ROUNDED_ABOVE)."""
    if rows <= ROUNDED_ABOVE:
        return rows
    step = 1 << (rows.bit_length() - STEPS_PER_OCTAVE.bit_length())  # 8 per octave: 65-128 by 8, 129-256 by 16
    return -(-rows // step) * step


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear; `weight` plain (re-laid out on every call) or packed by PackedOneDNNLinear."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class PackedOneDNNLinear:
    """oneDNN's linear over weights reordered once into its blocked layout, re-packed when a weight changes.

    Unpacked, oneDNN re-lays out the weight on every call: harmless for one row, but a verify forward of a few
    rows then pays that for every matrix (measured on the 2-core AMD EPYC dev machines, per layer of SmolLM2:
    1 row 1.05 ms, 4 rows 1.61 ms unpacked; 0.87 ms and 0.97 ms packed). A pack is keyed by the weight's identity,
    storage and version counter, so an in-place policy update (optimizer step, load_state_dict, a hot-swapped
    drafter) is seen at the next call; the packs cost one more copy of the weights in memory. Only under
    no_grad (with gradients on, F.linear: neither packed weights nor oneDNN's pointwise op give a weight gradient)."""

    ROWS_HINT = 4  # the batch the layout is tuned for: decode rows and verify trees are a handful of rows

    def __init__(self):
        self._packs: dict[int, tuple] = {}

    def __deepcopy__(self, memo) -> PackedOneDNNLinear:
        return PackedOneDNNLinear()  # packs are a cache of the weights: a copy re-packs its own

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(x, weight, bias)  # oneDNN's pointwise linear has no gradient for the weight
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        padded = padded_rows(rows)
        if padded == rows:
            return _onednn_linear(x, self._packed(weight), bias)
        flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))  # zero rows below the input's
        return _onednn_linear(flat, self._packed(weight), bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])

    def _packed(self, weight: torch.Tensor) -> torch.Tensor:
        key = id(weight)
        entry = self._packs.get(key)
        if entry is None or entry[0]() is not weight or entry[1] != (weight.data_ptr(), weight._version):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.ROWS_HINT)
            drop = lambda _ref, packs=self._packs, key=key: packs.pop(key, None)
            entry = (weakref.ref(weight, drop), (weight.data_ptr(), weight._version), packed)
            self._packs[key] = entry
        return entry[2]


def pick_linear(device: torch.device, dtype: torch.dtype):
    """The fastest exact fp32 linear for this device.

    On CPU, torch's F.linear goes to MKL, whose GEMV runs a slow generic path on some CPUs (measured on the
    2-core AMD EPYC dev machines: 15 GB/s, vs 24 GB/s through oneDNN; lm_head 8.1 ms vs 3.7 ms), and oneDNN is
    faster still over packed weights (PackedOneDNNLinear).
    """
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        try:
            probe, weight = torch.ones(1, 2), torch.ones(3, 2)
            packed = PackedOneDNNLinear()
            with torch.no_grad():
                if torch.allclose(packed(probe, weight, torch.zeros(3)), torch.full((1, 3), 2.0)):
                    return packed
        except (RuntimeError, AttributeError):
            pass
    return F.linear


