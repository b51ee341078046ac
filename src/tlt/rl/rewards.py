"""Verifiable rewards: extract the final answer, check it, optionally reward the format.

Exact integer match for the built-in task; math-verify (symbolic/numeric equivalence) for general math answers;
or any function `fn(completion, example) -> float` given by dotted path. A reward function that raises (or
returns no finite number) gives that sample reward 0; the failures are counted and reported, and the run goes
on, unless every sample of several steps in a row failed (a bug, not hard samples: distributed/run.py stops it).
"""

from __future__ import annotations

import importlib
import logging
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tlt.errors import TltError, first_line
from tlt.tasks.example import TaskExample

BOXED = re.compile(r"\\boxed\{")
# "the answer is X" / "answer: X" without a box: X is the rest of the sentence (to a full stop or the line's
# end), judged whole: taking its leading number rewarded "5/8", "2^10" and "12 - 7 = 5" as 5, 2 and 12
ANSWER_LINE = re.compile(r"answer\s*(?:is|:)\s*(.+?)\s*(?:\.(?=\s|$)|$)", re.I | re.M)
MARKUP = re.compile(r"^(?:\*\*|\$|\\\(|\\\[)+|(?:\*\*|\$|\\\)|\\\])+$")  # **X**, $X$, \(X\), \[X\] around it
INTEGER = re.compile(r"^[-+]?\d+$")
UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
MATH_VERIFY_TIMEOUT_S = 5  # per parse and per verify: math-verify's own default
# the child's first call imports sympy (~2 s); past this a check is stuck beyond math-verify's own timeouts
MATH_VERIFY_HARD_TIMEOUT_S = 60.0
log = logging.getLogger(__name__)


class RewardError(TltError):
    """A reward function that cannot be loaded."""


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces."""
    starts = [m.end() for m in BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start:index].strip()
    return None


def extract_answer(text: str) -> str | None:
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    lines = ANSWER_LINE.findall(text)
    return MARKUP.sub("", lines[-1]).strip() or None if lines else None


def integer_match(completion: str, example: TaskExample) -> float:
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    answer = answer.replace(",", "").replace(" ", "").replace("$", "").rstrip(".")  # 1,234 / -$5 / 42.
    return float(bool(INTEGER.match(answer)) and int(answer) == int(example.answer))


def math_verify_match(completion: str, example: TaskExample) -> float:
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    answer = UNESCAPED_DOLLAR.sub("", answer)  # "-$5": a currency sign would end the $...$ math-verify reads
    if threading.current_thread() is threading.main_thread():
        return _math_verify(example.answer, answer)
    return _MATH_VERIFY_PROCESS(example.answer, answer)


def _math_verify(gold: str, answer: str) -> float:
    """math-verify with its own timeouts (MATH_VERIFY_TIMEOUT_S per parse and per verify), which only the main
    thread of a process can use (signal.alarm)."""
    from math_verify import parse, verify

    return float(verify(parse(f"${gold}$", parsing_timeout=MATH_VERIFY_TIMEOUT_S),
                        parse(f"${answer}$", parsing_timeout=MATH_VERIFY_TIMEOUT_S),
                        timeout_seconds=MATH_VERIFY_TIMEOUT_S))


class _MathVerifyProcess:
    """math-verify off the main thread. Its timeouts use signal.alarm, which only a main thread may set: on the
    in-process backend's worker threads every call raised ValueError, and every answer scored 0. Without them a
    sympy expression like 9^9^9^9 could hang the run, so the check runs in a child Python process (started once,
    kept; a plain subprocess, not multiprocessing, which would re-run an unguarded user script), in its main
    thread with math-verify's own timeouts. A call that outlives them (C code the alarm cannot interrupt) gets
    the child killed, to be restarted, and raises TimeoutError: a reward failure."""

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
        self._child = subprocess.Popen([sys.executable, "-c", "from tlt.rl.rewards import serve_math_verify; "
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


def load_reward_function(path: str) -> Callable[[str, TaskExample], float]:
    """'pkg.module:function' or 'pkg.module.function'."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise RewardError(f"reward {path!r} must be a dotted path like 'my_pkg.rewards:score'")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except Exception as error:  # noqa: BLE001 - importing user code: a syntax error or its own exception too
        hint = ""
        top = module_name.split(".")[0]
        if isinstance(error, ModuleNotFoundError) and error.name == top and Path(f"{top}.py").exists():
            # `tlt` is a console script: the current directory is not on its import path (as it is for python -m)
            hint = f" ({top}.py is in the current directory, which tlt does not import from: run with PYTHONPATH=.)"
        raise RewardError(f"cannot load reward function {path!r}: {type(error).__name__}: {error}{hint}") from None
    if not callable(function):
        raise RewardError(f"reward {path!r} is not callable")
    return function


@dataclass
class RewardScores:
    rewards: list[float]   # correctness + format bonus
    correct: list[bool]
    failures: int          # reward function calls that raised or returned NaN/inf (those samples got 0)


class Reward:
    def __init__(self, check: Callable[[str, TaskExample], float], format_reward: float = 0.0):
        self.check, self.format_reward = check, format_reward
        self._told = False  # the first failure's exception is logged (once: a broken function raises on all)

    def score(self, completions: list[str], examples: list[TaskExample]) -> RewardScores:
        rewards, correct, failures = [], [], 0
        for completion, example in zip(completions, examples):
            try:
                value = _finite(self.check(completion, example))
            except Exception as error:  # noqa: BLE001 — a user's reward bug must not kill a long run; counted
                value, failures = 0.0, failures + 1
                if not self._told:
                    self._told = True
                    what = first_line(error) if isinstance(error, BadReward) else \
                        f"raised {type(error).__name__}: {first_line(error)}"
                    log.warning("the reward function %s %s (that sample scores 0; the run goes on and counts such "
                                "samples as reward_failures)", getattr(self.check, "__name__", "?"), what)
            bonus = self.format_reward if extract_answer(completion) is not None else 0.0
            rewards.append(value + bonus)
            correct.append(value >= 1.0)
        return RewardScores(rewards, correct, failures)


class BadReward(ValueError):
    """A reward function returned something that is not a finite number."""


def _finite(value) -> float:
    """A reward as a float; a NaN/inf advantage would turn every weight into NaN in one update."""
    if isinstance(value, (str, bytes)):  # float("1.0") would hide a function returning its extracted answer
        raise BadReward(f"returned {value!r}, a string, not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadReward(f"returned {value!r}, not a number") from None
    if not math.isfinite(number):
        raise BadReward(f"returned {number}, not a finite number")
    return number


def build_reward(config) -> Reward:
    """From a `TaskConfig`: 'auto' = exact integer match for the built-in task, math-verify otherwise."""
    if config.reward == "auto":
        check = integer_match if config.name == "arithmetic" else math_verify_match
    elif config.reward == "integer":
        check = integer_match
    elif config.reward == "math_verify":
        check = math_verify_match
    else:
        check = load_reward_function(config.reward)
    return Reward(check, config.format_reward)
