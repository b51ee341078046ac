"""A preallocated KV cache with per-row lengths, explicit commit, rollback and row moves.

Row r's tokens live in slots [0, lengths[r]) of every layer; a forward pass writes T new tokens at slots
[lengths[r], lengths[r] + T) but does not commit them: the caller decides what to keep with `advance`
(keep all, e.g. plain decoding), `keep` (keep a subset, e.g. the accepted path of a speculation tree)
or nothing at all (the next write simply overwrites them). Running rows are kept dense at the front of
the buffers so a batch is a zero-copy slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tlt.models.spec import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, max_rows: int, max_len: int, *, num_layers: int | None = None,
                 device=None, dtype=torch.float32):
        layers = spec.num_layers if num_layers is None else num_layers
        # One buffer [2 (K, V), L, R, Hkv, S, D]; keys[l] and values[l] are views [R, Hkv, S, D] of it. Moving
        # slots (a tree's accepted path, a row) is then one indexed copy for every layer at once instead of
        # two per layer: on a GPU, where a step is launch-bound, 2 kernels instead of 4 per layer.
        self.kv = torch.zeros(2, layers, max_rows, spec.num_kv_heads, max_len, spec.head_dim, device=device,
                              dtype=dtype)
        # detached: views autograd does not track, so they can be written in place whatever the grad mode in which
        # the cache was made and is written (unbind's or plain views refuse some such writes)
        self.keys = [self.kv[0, layer].detach() for layer in range(layers)]
        self.values = [self.kv[1, layer].detach() for layer in range(layers)]
        # Host copy of the lengths: the scheduler reads them every step, a device tensor would force syncs.
        self.lengths = torch.zeros(max_rows, dtype=torch.long)
        self.max_rows = max_rows
        self.max_len = max_len
        self.device = self.kv.device
        # Per-slot side data that follows the KV through every row move and `keep` (e.g. the token ids and
        # the target's hidden states of committed tokens, from which a drafter's state can be rebuilt).
        self.slot_data: dict[str, torch.Tensor] = {}

    def add_slot_data(self, name: str, trailing_shape: tuple = (), dtype=torch.float32) -> torch.Tensor:
        """Allocate a [R, S, *trailing_shape] buffer aligned with the cache slots."""
        self.slot_data[name] = torch.zeros(self.max_rows, self.max_len, *trailing_shape, dtype=dtype,
                                           device=self.device)
        return self.slot_data[name]

    def rows(self, start: int, count: int) -> "CacheRows":
        if start < 0 or start + count > self.max_rows:
            raise IndexError(f"rows [{start}, {start + count}) outside a cache of {self.max_rows} rows")
        return CacheRows(self, start, count)

    @property
    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src's committed tokens onto row dst (used to keep running rows dense)."""
        n = int(self.lengths[src])
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]  # every layer's K and V at once
        for data in self.slot_data.values():
            data[dst, :n] = data[src, :n]
        self.lengths[dst] = n

    def copy_prefix(self, src: int, dsts: list[int]) -> None:
        """Give rows dsts the same committed tokens as row src (samples that share one prompt)."""
        if not dsts:
            return
        n = int(self.lengths[src])
        index = torch.tensor(dsts, device=self.device)
        self.kv[:, :, index, :, :n] = self.kv[:, :, src, None, :, :n]
        for data in self.slot_data.values():
            data[index, :n] = data[src, :n]
        self.lengths[dsts] = n


@dataclass
class CacheRows:
    """A contiguous block of rows of a KVCache: what one forward pass reads and writes."""

    cache: KVCache
    start: int
    count: int
    lengths: torch.Tensor = field(init=False, repr=False, compare=False)  # host [B], a view: writes go through

    def __post_init__(self):
        # made once: a step reads it ~10 times, and each new slice was a few µs of host work the device waits on
        self.lengths = self.cache.lengths[self.start:self.start + self.count]

    def keys(self, layer: int) -> torch.Tensor:  # [B, Hkv, S, D]
        return self.cache.keys[layer][self.start:self.start + self.count]

    def values(self, layer: int) -> torch.Tensor:
        return self.cache.values[layer][self.start:self.start + self.count]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              rows: torch.Tensor | None = None) -> None:
        """Store new keys/values k, v [B, Hkv, T, D] at per-row slots [B, T] (uncommitted). rows: the
        arange(B)[:, None] index on the device, made once per forward by a caller writing every layer (one
        kernel fewer per layer in a launch-bound GPU step)."""
        if rows is None:
            rows = torch.arange(self.count, device=slots.device)[:, None]
        self.keys(layer)[rows, :, slots] = k.transpose(1, 2)  # indexed view is [B, T, Hkv, D]
        self.values(layer)[rows, :, slots] = v.transpose(1, 2)

    def slots(self, name: str) -> torch.Tensor:  # [B, S, ...] view of a slot-data buffer
        return self.cache.slot_data[name][self.start:self.start + self.count]

    def write_slots(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store per-slot values [B, T, ...] at per-row slots [B, T] (uncommitted, like `write`)."""
        rows = torch.arange(self.count, device=slots.device)[:, None]
        self.slots(name)[rows, slots] = values

    def write_drafter_inputs(self, lengths: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store the token ids [B, T] and target features [B, T, H] of the tokens just written past the committed
        lengths [B] (on the device) in the "tokens" and "features" slot data, from which a drafter is fed."""
        slots = lengths[:, None] + torch.arange(ids.shape[1], device=lengths.device)[None, :]
        self.write_slots("tokens", slots, ids)
        self.write_slots("features", slots, hidden)

    def advance(self, counts: torch.Tensor | int) -> None:
        """Commit the first `counts` written tokens of each row."""
        self.lengths.add_(counts if isinstance(counts, int) else counts.to("cpu", torch.long))

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll rows back to the given lengths (drops committed tokens past them)."""
        if bool((lengths > self.lengths).any()):
            raise ValueError("truncate cannot lengthen a row")
        self.lengths.copy_(lengths)

    def keep(self, offsets: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit, per row, the written tokens at relative offsets[b, :counts[b]] (in order), dropping the rest.

        offsets: [B, M] positions in the last write (padding entries beyond counts[b] are ignored).
        Used after tree verification: the accepted path is moved to the front of the written block.
        """
        device = self.cache.device
        self.gather_written(self.lengths.to(device), offsets.to(device), counts.to(device))
        self.advance(counts)

    def gather_written(self, lengths: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor) -> None:
        """The device half of `keep`: move the written tokens at offsets[b, :counts[b]] to the front of the
        written block of rows whose committed lengths are `lengths` [B] (device); commits nothing, reads nothing
        on the host (CUDA-graph safe). The caller advances the host lengths by counts afterwards."""
        base = lengths[:, None]
        m = offsets.shape[1]
        dst = base + torch.arange(m, device=base.device)
        src = base + offsets
        valid = torch.arange(m, device=base.device)[None, :] < counts[:, None]
        # Invalid entries copy a row's slot onto itself: harmless, and keeps the copy one batched op.
        src = torch.where(valid, src, dst)
        rows = torch.arange(self.count, device=base.device)[:, None]
        if torch.compiler.is_compiling():
            # Inductor sees the whole buffer and the per-layer views the verify wrote as aliased inputs and
            # copies the whole cache around the write (found by review, CPU Inductor): per layer, on the views
            for layer in range(len(self.cache.keys)):
                for view in (self.keys(layer), self.values(layer)):
                    view[rows, :, dst] = view[rows, :, src]
        else:
            kv = self.cache.kv[:, :, self.start:self.start + self.count]   # [2, L, B, Hkv, S, D]: every layer
            kv[:, :, rows, :, dst] = kv[:, :, rows, :, src]                # one op (eager and captured alike)
        for name in self.cache.slot_data:
            data = self.slots(name)
            data[rows, dst] = data[rows, src]
