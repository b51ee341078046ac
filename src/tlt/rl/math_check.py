"""math-verify's check of one answer against its gold, safe on any thread.

math-verify bounds its parsing and comparison with `signal.alarm`, which only a process's main thread may set: on
the in-process backend's worker threads every call raised ValueError, and every answer scored 0. Without those
timeouts a sympy expression like 9^9^9^9 could hang the run. So off the main thread the check runs in a child
Python process (started once, kept; a plain subprocess, not multiprocessing, which would re-run an unguarded user
script), in its main thread with math-verify's own timeouts.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading

from tlt.errors import first_line

MATH_VERIFY_TIMEOUT_S = 5  # per parse and per verify: math-verify's own default
# the child's first call imports sympy (~2 s); past this a check is stuck beyond math-verify's own timeouts
MATH_VERIFY_HARD_TIMEOUT_S = 60.0


class _Shortened(logging.Filter):
    """math-verify logs a timeout with the whole text it parsed: a 100,000-character response made one log line
    of it per sample (found by a trial). Kept to its first MAX_LOGGED characters."""

    MAX_LOGGED = 200

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if len(text) > self.MAX_LOGGED:
            record.msg, record.args = f"{text[:self.MAX_LOGGED]}... ({len(text):,} characters)", ()
        return True


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_Shortened())


def math_equal(gold: str, answer: str) -> float:
    """1.0 when math-verify finds `answer` equal to `gold` (both LaTeX-ish text), else 0.0."""
    if threading.current_thread() is threading.main_thread():
        return _math_verify(gold, answer)
    return _MATH_VERIFY_PROCESS(gold, answer)


def _math_verify(gold: str, answer: str) -> float:
    """math-verify with its own timeouts (MATH_VERIFY_TIMEOUT_S per parse and per verify), which only the main
    thread of a process can use (signal.alarm)."""
    from math_verify import parse, verify

    return float(verify(parse(f"${gold}$", parsing_timeout=MATH_VERIFY_TIMEOUT_S),
                        parse(f"${answer}$", parsing_timeout=MATH_VERIFY_TIMEOUT_S),
                        timeout_seconds=MATH_VERIFY_TIMEOUT_S))


class _MathVerifyProcess:
    """math-verify in a child process (see the module's docstring). A call that outlives its timeouts (C code
    the alarm cannot interrupt) gets the child killed, to be restarted, and raises TimeoutError: a reward
    failure."""

    def __init__(self):
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one check at a time: the child is one process

    def __call__(self, gold: str, answer: str) -> float:
        with self._lock:
            child = self._child or self._start()
            try:
                child.stdin.write(json.dumps([gold, answer]) + "\n")
                child.stdin.flush()
            except OSError:  # it died (killed, out of memory): the next call starts another
                self._stop()
                raise RuntimeError("math-verify's process ended (its error, if any, is above)") from None
            ready, _, _ = select.select([child.stdout], [], [], MATH_VERIFY_HARD_TIMEOUT_S)
            line = child.stdout.readline() if ready else ""
            if not line:
                self._stop()
                raise TimeoutError(f"math-verify took over {MATH_VERIFY_HARD_TIMEOUT_S:g} s on {answer[:80]!r}"
                                   if not ready else "math-verify's process ended (its error, if any, is above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"math-verify raised {reply['error']}")
        return reply["value"]

    def _start(self) -> subprocess.Popen:
        # the parent's import path: tlt (and math-verify) import there as they do here
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._child = subprocess.Popen([sys.executable, "-c", "from tlt.rl.math_check import serve_math_verify; "
                                        "serve_math_verify()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=env)
        return self._child

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None


def serve_math_verify() -> None:
    """The child of _MathVerifyProcess: a JSON [gold, answer] per line in, a JSON result per line out; it ends
    when its parent closes the pipe (or exits)."""
    for line in sys.stdin:
        gold, answer = json.loads(line)
        try:
            reply = {"value": _math_verify(gold, answer)}
        except Exception as error:  # noqa: BLE001 - handed back to the parent, which counts a reward failure
            reply = {"error": f"{type(error).__name__}: {first_line(error)}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


_MATH_VERIFY_PROCESS = _MathVerifyProcess()
