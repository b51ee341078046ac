"""Interrupts held over a block that must complete: a completed RL step's metrics, timeline and checkpoint."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held_interrupts(notice: str | None = None):
    """Ctrl-C (SIGINT) and SIGTERM received inside the block are held and raised again when it ends, to the
    handlers in place before it (KeyboardInterrupt, `tlt`'s SIGTERM handling): a run stopped just after a step
    finished lost that step (its metrics logged, its checkpoint not written). Not when the block fails: its
    own error is the one to report. Only the main thread may set handlers; elsewhere this holds nothing.
    `notice`, if given, is printed to stderr when the first signal is held (a large checkpoint takes a while)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        if notice is not None and not held:
            print(notice, file=sys.stderr, flush=True)
        held.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in HELD_SIGNALS}
    try:
        yield
    except BaseException:
        _restore(previous)
        raise
    _restore(previous)
    for signum in dict.fromkeys(held):  # each once, in the order received
        signal.raise_signal(signum)


def _restore(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
