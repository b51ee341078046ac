"""TailTrainer: trains the drafter beside the rollout's long tail, on the same device (spot training on one GPU).

With one worker there is no idle worker to train the drafter, yet in the long tail the GPU is mostly idle: a batch
of 1-4 rows decodes with a sliver of its compute. So the worker hands this trainer the features of every sample as
it finishes (`RolloutEngine.generate(collect_features=...)`: the rollout's own hidden states, no extra forward)
and starts it when the rollout enters the tail; it trains on a background thread, on a second CUDA stream of the
rollout's device, and publishes versions that the decode loop hot-swaps between steps (as from a spot-training
worker). The thread takes the GIL only to launch kernels; the decode loop releases it while it waits for the GPU.

Lossless whatever it does: speculative sampling is exact for every drafter, so only the speed depends on it.
On the CPU the thread competes with decoding for the same cores; `run.tail_training=auto` turns it on there too,
because one worker on all cores is the CPU default (faster steps than two splitting them, mostly in the update:
docs/benchmarks.md section 12), and without it that worker would train no drafter at all.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from tlt.drafter.buffer import FeatureBuffer
from tlt.drafter.trainer import DrafterTrainer

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the thread sleeps when it has nothing to train on yet
# Python's GIL switch interval while a CUDA tail trains. A replayed decode step is ~2-3 ms of host work at
# batch 1-4; with the default 5 ms interval, the training thread (Python between its launches) can keep the GIL
# that long each time the decode loop wants it back, doubling the steps it overlaps. On the H100 (2026-11-27)
# the rollout took 1.15-1.22x with a tail trainer that ran for 30-40 ms and 0-1 drafter steps. (On the CPU a
# step's ops release the GIL for most of its 30+ ms: left as it is.)
CUDA_SWITCH_INTERVAL_S = 0.0005


# One high-priority decode stream per CUDA device for the process: memory the caching allocator frees on a stream is
# reused only by that stream, so a new stream per rollout would strand the last one's KV cache and temporaries.
_DECODE_STREAMS: dict[int, "torch.cuda.Stream"] = {}
_DECODE_STREAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def decoding_first(device: torch.device, enabled: bool = True):
    """Run the block (a rollout that a tail trainer shares the GPU with) on a CUDA stream of the device's highest
    priority. The trainer's kernels run on a stream of the default, lowest priority, and the GPU's block scheduler
    dispatches pending blocks of a higher-priority stream first: a decode step's small kernels then wait for the
    training blocks already running, not for the training kernels queued. (The default stream is of the lowest
    priority, so the training stream cannot be put below it: the decoding goes above.) Ordered after everything
    queued before it (the optimizer step that wrote the weights) and before everything queued after it (the
    update's forwards). A no-op off CUDA or when not enabled."""
    device = indexed_device(device)
    if device.type != "cuda" or not enabled:
        yield
        return
    with _DECODE_STREAMS_LOCK:
        stream = _DECODE_STREAMS.get(device.index)
        if stream is None:  # priority: lower is higher; out-of-range values map to the device's highest
            stream = _DECODE_STREAMS[device.index] = torch.cuda.Stream(device, priority=-100)
    outer = torch.cuda.current_stream(device)
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        outer.wait_stream(stream)


class Arrival(NamedTuple):
    """A finished sample's features on their way to the buffer (named: the CUDA path once queued its fields in
    another order than the drain read them, and every CUDA tail trained on nothing)."""

    tokens: torch.Tensor
    features: torch.Tensor
    step: int
    landed: "torch.cuda.Event | None" = None  # CUDA: set when the asynchronous copy to the host is done


def indexed_device(device) -> torch.device:
    """`device` with its index: "cuda" is the current CUDA device of the thread that builds the trainer
    (`torch.cuda.set_device` on the training thread refuses a device without one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class TailReport:
    """What one rollout's tail training did."""

    trained_steps: int = 0
    published: list[int] = field(default_factory=list)
    error: str | None = None
    started_s: float | None = None  # time.time() when training started (None: the rollout never reached the tail)
    stop_asked_s: float | None = None  # when the rollout's last step had run and stop() was called
    ended_s: float | None = None   # when training stopped and published its last version

    @property
    def stop_s(self) -> float:
        """What stopping cost the rollout (the last micro-step, the final publish): it waits for it."""
        if self.stop_asked_s is None or self.ended_s is None:  # never started
            return 0.0
        return max(0.0, self.ended_s - self.stop_asked_s)  # 0: it had ended on its own (a failure)
    loss: float | None = None
    top1: float | None = None


class TailTrainer:
    """trainer: a `DrafterTrainer` over a training drafter (not the one the engine serves) and its buffer.
    publish(final): called on the training thread after every `publish_every` optimizer steps (final=False) and
    once when stopped after any training (final=True); it hands the weights on (e.g. to the drafter hub) and
    returns the new version number (None for a final call whose weights the last version already has)."""

    def __init__(self, trainer: DrafterTrainer, publish: Callable[[bool], int], *, publish_every: int,
                 device: torch.device):
        self.trainer = trainer
        self.buffer: FeatureBuffer = trainer.buffer
        self.publish = publish
        self.publish_every = max(1, publish_every)
        self.device = indexed_device(device)
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._report = TailReport()
        self._stream = None  # the side CUDA stream, made on first use
        self._copies = None  # the CUDA stream that copies collected features to the host (`_to_host_async`)
        self._streams_lock = threading.Lock()
        self._switch_interval: float | None = None  # the process's, while start() has set CUDA's
        self._prepare: Callable[[], object] | None = None  # start()'s, run on the training thread
        self._decode_mark: "torch.cuda.Event | None" = None  # start(): recorded on the decode loop's stream

    # -- the decode loop's side (main thread) -------------------------------------------------------------

    def collect(self, step: int):
        """The `collect_features` callback for a rollout of RL step `step`: queues each finished sample's
        features. On the CPU they are copied at once (on a CPU fp32 engine they are views of cache rows, which
        the engine hands to the next admitted rows before the training thread reads them: samples trained on
        others' data). On CUDA, see `_to_host_async`."""
        if self.device.type == "cuda":
            self._copy_stream()  # made here, on the decode thread, before any thread could race to make it

        def add(tokens: torch.Tensor, features: torch.Tensor) -> None:
            if features.is_cuda:
                host_tokens, host_features, landed = self._to_host_async(tokens, features)
                self._incoming.put(Arrival(host_tokens, host_features, step, landed))
                return
            self._incoming.put(Arrival(tokens.to("cpu", copy=True), features.to("cpu", torch.float32, copy=True),
                                       step))
        return add

    def _to_host_async(self, tokens: torch.Tensor, features: torch.Tensor):
        """(host tokens, host features, an event set when they have landed). The decode stream only clones the
        rows (before it reuses them); the copy to pinned host memory runs on a copy stream of its own, beside the
        decoding. A copy to the host in the decode loop waited for the GPU once per finished sample (the H200's
        spot mode was 10% slower before its tail began), and clones kept on the device until the thread starts
        in the tail would pile up there (a 7B model's rollout: gigabytes)."""
        decode = torch.cuda.current_stream(features.device)
        tokens, features = tokens.clone(), features.clone()
        copies = self._copy_stream()
        copies.wait_stream(decode)
        host = (torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True),
                torch.empty(features.shape, dtype=features.dtype, pin_memory=True))
        with torch.cuda.stream(copies):
            for target, source in zip(host, (tokens, features)):
                target.copy_(source, non_blocking=True)
                if source.is_cuda:  # its memory goes back to the pool only after the copy has read it
                    source.record_stream(copies)
            landed = torch.cuda.Event()
            landed.record(copies)
        return (*host, landed)

    def _copy_stream(self) -> "torch.cuda.Stream":
        with self._streams_lock:
            if self._copies is None:
                self._copies = torch.cuda.Stream(self.device)
            return self._copies

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, prepare: Callable[[], object] | None = None) -> None:
        """Start training on the background thread (no-op when already running). `prepare`, if given, runs
        first on that thread (e.g. loading the latest drafter version and optimizer state into the training
        copy: copies the decode loop would otherwise wait for); if it fails, this tail trains nothing."""
        if self._thread is not None:
            return
        self._prepare = prepare
        self._stop.clear()
        self._report = TailReport(started_s=time.time())
        if self.device.type == "cuda":
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(CUDA_SWITCH_INTERVAL_S)
            # the decode loop's stream so far (`decoding_first`'s, not the default one): the thread waits for it too
            # (without a usable CUDA the thread fails at its own stream: a training error, not the rollout's)
            self._decode_mark = torch.cuda.Event() if torch.cuda.is_available() else None
            if self._decode_mark is not None:
                self._decode_mark.record(torch.cuda.current_stream(self.device))
        self._thread = threading.Thread(target=self._run, name="tlt-tail-trainer", daemon=True)
        self._thread.start()

    def stop(self) -> TailReport:
        """Stop within one micro-step, publish the last version, and report (also when never started: the
        features queued meanwhile still go into the buffer for the next rollout)."""
        if self._thread is not None:
            self._report.stop_asked_s = time.time()
            self._stop.set()
            try:
                self._thread.join()
            finally:
                self._thread = None
                if self._switch_interval is not None:
                    sys.setswitchinterval(self._switch_interval)
                    self._switch_interval = None
        try:  # what came after the thread's last drain (the longest samples finish last), or all of it
            self._drain()
        except Exception as exc:  # noqa: BLE001 - features the buffer refuses must not fail the rollout
            self._report.error = self._report.error or f"{type(exc).__name__}: {exc}"
            log.warning("tail training could not keep a sample's features: %s", exc)
        report, self._report = self._report, TailReport()
        return report

    # -- the training thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        history = []
        try:
            with self._side_stream():
                if self._prepare is not None:
                    self._prepare()
                while not self._stop.is_set():
                    self._drain()
                    if not len(self.buffer):
                        self._stop.wait(IDLE_WAIT_S)
                        continue
                    chunk = self.trainer.train_until(self._stop.is_set, self.publish_every)
                    history.extend(chunk)
                    if chunk and not self._stop.is_set():
                        version = self.publish(False)  # None: held back (drafter/gate.py)
                        if version is not None:
                            self._report.published.append(version)
                if history:
                    final = self.publish(True)  # None: the last chunk's version already has these weights
                    if final is not None:
                        self._report.published.append(final)
        except Exception as exc:  # noqa: BLE001 - the rollout keeps the last good drafter and goes on
            self._report.error = f"{type(exc).__name__}: {exc}"
            log.warning("tail training failed (SD keeps the last good drafter): %s\n%s", self._report.error,
                        traceback.format_exc())
        self._report.trained_steps = len(history)
        self._report.ended_s = time.time()
        if history:
            self._report.loss, self._report.top1 = history[-1]["loss"], history[-1]["top1"]

    def _drain(self) -> None:
        while True:
            try:
                arrival: Arrival = self._incoming.get_nowait()
            except queue.Empty:
                return
            if arrival.landed is not None:  # copied asynchronously (on CUDA): wait until they are in host memory
                arrival.landed.synchronize()
            self.buffer.add(arrival.tokens, arrival.features, arrival.step)

    @contextlib.contextmanager
    def _side_stream(self):
        """On CUDA, a stream of its own (on the rollout's device) so its kernels overlap the decode graphs
        instead of queueing behind them; the published weights are copied to the host on that stream, after
        the training kernels, so they are complete."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.set_device(self.device)
        if self._stream is None:  # one stream for the run's every tail
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        # after everything queued so far (the optimizer step that wrote the embedding and lm_head it reads, the
        # drafter state loaded for it): once per tail, not per micro-step
        stream.wait_stream(torch.cuda.default_stream(self.device))
        if self._decode_mark is not None:  # and what the decode loop had queued when start() was called
            stream.wait_event(self._decode_mark)
        with torch.cuda.stream(stream):
            try:
                yield
            finally:  # nothing of a dropped micro-step may still run when the decode thread loads weights next
                stream.synchronize()
