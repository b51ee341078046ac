"""Verifiable rewards: extract the final answer, check it, optionally reward the format.

Exact integer match for the built-in task; math-verify (symbolic/numeric equivalence) for general math answers;
or any function `fn(completion, example) -> float` given by dotted path. A reward function that raises (or
returns no finite number) gives that sample reward 0, format bonus included; the failures are counted and
reported, and the run goes on, unless every sample of several steps in a row failed (a bug, not hard samples:
distributed/run.py stops it).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tlt.errors import TltError, first_line
from tlt.rl.math_check import math_equal
from tlt.tasks.answer_text import number_without_words, without_thousands_separators
from tlt.tasks.example import TaskExample

BOXED = re.compile(r"\\boxed\{")
# "the answer is X" / "answer: X" / "**Answer**: X" without a box: X is the rest of its sentence, or the next line
# when the cue ends its line ("The answer is:\n42", a "**Final Answer**" heading). The line is taken whole and cut
# in Python: a lazy group before `\s*` took time quadratic in a run of spaces. ("isn't" is no cue.)
ANSWER_CUE = re.compile(r"answer(?:\*\*|__|\*)?[ \t]*(?:is\b(?!')[ \t]*:?|:)(?:\*\*|__)?"
                        r"|^[ \t#>*_]*(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t*_]*$", re.I | re.M)
NEXT_LINE = re.compile(r"[ \t*_]*\n\s*([^\n]*)")  # (blank lines between a heading and its answer too)
SENTENCE_END = re.compile(r"\.(?=\s|$)")
# where a sentence goes on past its answer in words: ", which is even", "; done", " (forty-two)", "42?" (a trial:
# each scored a correct 42 as 0). Not at " - " or "=" ("12 - 7 = 5" is no answer of 12), ", and 3" (a list),
# "(x+1)" (a product), nor "!": "5!" stays a factorial (120), so that no wrong answer scores; "42!" meaning 42
# scores 0. Every branch starts at one character, so a run of spaces is scanned once (a review: `\s+\(` took
# 29 s on 100,000 spaces)
CLAUSE_END = re.compile(r",\s+(?!(?:and|or)\b)(?=[A-Za-z]{2})|;|(?<=\s)\((?=[A-Za-z]{2,}[\s)-])|\?(?=\s|$)")
OPENING_MARKUP = ("**", "$", "\\(", "\\[")   # **X**, $X$, \(X\), \[X\] around an answer
CLOSING_MARKUP = ("**", "$", "\\)", "\\]")
INTEGER = re.compile(r"^[-+]?\d+$")
TEXT_MACRO = re.compile(r"^\\(?:text|textbf|mathrm|mathbf)\{(.*)\}$")  # \textbf{42}
UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
log = logging.getLogger(__name__)


class RewardError(TltError):
    """A reward function that cannot be loaded, or that cannot be used (it exits the process)."""


def extract_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...}, with nested braces (a response cut off inside a later box keeps
    the answer it had boxed before); None when no box closes or the closing one is empty. One pass over the text:
    a response of many unclosed boxes must not cost a scan per box."""
    starts = [m.end() for m in BOXED.finditer(text)]  # just past each box's "{"
    if not starts:
        return None
    closing, open_braces = {}, []
    for index, char in enumerate(text):
        if char == "{":
            open_braces.append(index)
        elif char == "}" and open_braces:
            closing[open_braces.pop()] = index
    for start in reversed(starts):
        end = closing.get(start - 1)
        if end is not None:
            return text[start:end].strip() or None
    return None


def extract_answer(text: str) -> str | None:
    """The last \\boxed{} answer; without one, what follows the last "the answer is" / "answer:" cue (its
    sentence up to a clause that goes on in words, unit words after a number dropped), judged whole: taking the
    leading number rewarded "5/8", "2^10" and "12 - 7 = 5" as 5, 2 and 12."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    answer = _after_last_cue(text)
    while answer and (inner := ANSWER_CUE.search(answer)) is not None:  # "Final Answer: The final answer is 42"
        answer = answer[inner.end():]
    if not answer:
        return None
    answer = SENTENCE_END.split(answer.strip(), maxsplit=1)[0]
    answer = without_markup(CLAUSE_END.split(answer, maxsplit=1)[0].strip())
    return number_without_words(answer) or None


def without_markup(text: str) -> str:
    """The text without the markup around it, by index (a regex `(...)+$` took 106 s on 50,000 "**": a review)."""
    start, end = 0, len(text)
    while (mark := next((m for m in OPENING_MARKUP if text.startswith(m, start, end)), None)) is not None:
        start += len(mark)
    while (mark := next((m for m in CLOSING_MARKUP if end - len(m) >= start and text.startswith(m, end - len(m))),
                        None)) is not None:
        end -= len(mark)
    return text[start:end].strip()


def _after_last_cue(text: str) -> str | None:
    """The rest of the line after the last answer cue with anything after it (a bare "Final answer" line after
    the answer is none: a review), or the next non-blank line when the cue ends its line."""
    for cue in reversed(list(ANSWER_CUE.finditer(text))):
        rest = text[cue.end():]
        line = rest.split("\n", 1)[0]
        if line.strip(" \t*_:"):
            return line
        following = NEXT_LINE.match(rest)
        if following and following.group(1).strip():
            return following.group(1)
    return None


def integer_text(answer: str) -> str | None:
    """An integer answer in canonical form (sign and digits, no leading zeros), or None when it is not one:
    1,234 / 1{,}234 / -$5 / \\$5 / 42. / 42.0 / −5 (a Unicode minus) / \\textbf{42} / = 42 are integers; 4,2 and 4.5
    are not.
    Compared as text: int() refuses strings past 4,300 digits (a failure, not a wrong answer)."""
    text = answer.strip()
    while (macro := TEXT_MACRO.match(text)) is not None:
        text = macro.group(1).strip()
    text = text.replace("\\$", "").replace("$", "").replace("\u2212", "-").lstrip("=").strip().rstrip(".")
    text = without_thousands_separators(text.replace("{,}", ","))  # 1{,}000: LaTeX's (math-verify reads it too)
    if "." in text and text.split(".", 1)[1].strip("0") == "":
        text = text.split(".", 1)[0]  # 42.0
    if not INTEGER.match(text):
        return None
    sign = "-" if text[0] == "-" else ""
    digits = text.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


def integer_match(completion: str, example: TaskExample) -> float:
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    gold = integer_text(str(example.answer))
    if gold is None:
        raise ValueError(f"the gold answer {example.answer!r} is not an integer (task.reward=integer)")
    return float(integer_text(answer) == gold)


def math_verify_match(completion: str, example: TaskExample) -> float:
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    # "-$5": a currency sign would end the $...$ math-verify reads, in the answer and in the gold (a gold of
    # -$5 matched nothing: found by a trial)
    return math_equal(UNESCAPED_DOLLAR.sub("", str(example.answer)), UNESCAPED_DOLLAR.sub("", answer))


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
    if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None)):
        # its call returns a coroutine never awaited: every sample a failure, and Python's warning (a trial)
        raise RewardError(f"reward {path!r} is an async function: tlt calls reward functions as plain functions "
                          f"(def, not async def)")
    _check_signature(function, path, attribute)
    return function


def _check_signature(function, path: str, name: str) -> None:
    """A function that cannot be called as function(completion, example) failed on every sample, and the run
    stopped only after 3 steps of zero rewards, each checkpointed (QA): refused when it loads."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or C extension without a signature: its calls will tell
        return
    try:
        signature.bind("completion", "example")
    except TypeError as error:
        raise RewardError(f"reward {path!r} must take (completion, example) — two arguments, the response's text "
                          f"and its task example — but its signature is {name}"
                          f"{signature}: {error}") from None


@dataclass
class RewardScores:
    rewards: list[float]   # correctness + format bonus
    correct: list[bool]
    failures: int          # reward function calls that raised or returned NaN/inf (those samples got 0, no bonus)


class Reward:
    def __init__(self, check: Callable[[str, TaskExample], float], format_reward: float = 0.0):
        self.check, self.format_reward = check, format_reward
        self._told = False  # the first failure's exception is logged (once: a broken function raises on all)

    def score(self, completions: list[str], examples: list[TaskExample]) -> RewardScores:
        rewards, correct, failures = [], [], 0
        for completion, example in zip(completions, examples):
            bonus = self.format_reward if extract_answer(completion) is not None else 0.0
            try:
                value = _finite(self.check(completion, example))
            except SystemExit as error:  # it ended the whole run without a word (found by review); not counted
                # as a failure, which would also swallow a worker's own termination (Ray's SIGTERM handler exits)
                raise RewardError(f"the reward function {getattr(self.check, '__name__', '?')} called sys.exit("
                                  f"{error.code!r}): a reward check must return a number (or raise)") from None
            except Exception as error:  # noqa: BLE001 — a user's reward bug must not kill a long run; counted
                value, failures = 0.0, failures + 1
                if not self._told:
                    self._told = True
                    what = first_line(error) if isinstance(error, BadReward) else \
                        f"raised {type(error).__name__}: {first_line(error)}"
                    log.warning("the reward function %s %s (that sample scores 0; the run goes on and counts such "
                                "samples as reward_failures)", getattr(self.check, "__name__", "?"), what)
                bonus = 0.0  # no format bonus either: a broken check must not train the format alone
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
    if abs(number) > MAX_REWARD:
        raise BadReward(f"returned {number}, past +-{MAX_REWARD:g}: a group's mean and spread would overflow to "
                        f"inf and every advantage become NaN (scale the reward down)")
    return number


# A group's mean, spread and advantages stay finite in float32 (max ~3.4e38) with rewards this large; a reward of
# 1e308 was accepted, its group mean overflowed, and every update was skipped for a NaN gradient (a CLI trial)
MAX_REWARD = 1e15


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
