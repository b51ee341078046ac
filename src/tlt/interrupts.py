"""Interrupts held over a block that must complete: a completed RL step's metrics, timeline and checkpoint."""

from __future__ import annotations

import contextlib
import os
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
    `notice`, if given, is printed to stderr when the first signal is held (a large checkpoint takes a while).
    A third signal ends the process at once, as it does outside the block (a worker that hangs in a checkpoint
    save held every Ctrl-C until its call's two-hour limit: found by QA). A signal the process inherited as
    ignored (`tlt train ... &` from a script) stays ignored here too: held, it said "stopping" and the run went
    on, and three of them aborted it (found by a trial)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        if notice is not None and not held:
            print(notice, file=sys.stderr, flush=True)
        held.append(signum)
        if len(held) == 2:
            print("tlt: still finishing the step; interrupt once more to abort at once (a checkpoint is written "
                  "whole or not at all: the last complete one stays)", file=sys.stderr, flush=True)
        if len(held) >= 3:  # as `tlt`'s own third interrupt: the block may wait hours on a worker that hangs
            print("tlt: aborted", file=sys.stderr, flush=True)
            os._exit(143 if signum == signal.SIGTERM else 130)

    previous = {signum: signal.signal(signum, hold) for signum in HELD_SIGNALS
                if signal.getsignal(signum) is not signal.SIG_IGN}
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
