import pytest

from tlt.rl.config import TaskConfig
from tlt.rl.rewards import (Reward, RewardError, build_reward, extract_answer, extract_boxed, integer_match,
                            load_reward_function, math_verify_match)
from tlt.tasks.example import TaskExample


def example(answer):
    return TaskExample("q", str(answer))


def test_extraction():
    assert extract_boxed(r"so \boxed{12} or rather \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_answer("The answer is 1,234.") == "1,234"
    assert extract_answer("no answer here") is None
    assert extract_boxed(r"\boxed{unclosed") is None


def test_integer_match():
    assert integer_match(r"steps... \boxed{-42}", example(-42)) == 1.0
    assert integer_match(r"\boxed{1,000}", example(1000)) == 1.0
    assert integer_match(r"\boxed{41}", example(42)) == 0.0
    assert integer_match(r"\boxed{4.5}", example(4)) == 0.0
    assert integer_match("I don't know", example(4)) == 0.0


def test_math_verify_equivalence():
    assert math_verify_match(r"\boxed{\frac{1}{2}}", example("0.5")) == 1.0
    assert math_verify_match(r"\boxed{\frac{1}{3}}", example("0.5")) == 0.0


def test_format_reward_and_failures_are_counted():
    def flaky(completion, ex):
        if "boom" in completion:
            raise RuntimeError("user bug")
        return integer_match(completion, ex)

    scores = Reward(flaky, format_reward=0.1).score([r"\boxed{3}", "boom", r"\boxed{5}", "3"], [example(3)] * 4)
    assert scores.rewards == [1.1, 0.0, 0.1, 0.0]  # "3" alone has no extractable final answer
    assert scores.correct == [True, False, False, False]
    assert scores.failures == 1


def test_a_failed_check_gets_no_format_bonus():
    """A broken reward function would otherwise train the format alone (found by review)."""
    def broken(completion, ex):
        raise KeyError("answer")

    scores = Reward(broken, format_reward=0.1).score([r"\boxed{3}", "The answer is 3."], [example(3)] * 2)
    assert scores.rewards == [0.0, 0.0] and scores.failures == 2
    assert Reward(integer_match, format_reward=0.1).score([r"\boxed{4}"], [example(3)]).rewards == [0.1]  # control


def test_a_check_that_calls_sys_exit_is_one_clear_error():
    """It ended `tlt train` with its exit code and no message at all (found by review)."""
    import sys

    def exits(completion, ex):
        sys.exit(3)

    with pytest.raises(RewardError, match=r"the reward function exits called sys.exit\(3\): a reward check must"):
        Reward(exits).score([r"\boxed{3}"], [example(3)])


def test_dotted_path_loading():
    assert load_reward_function("tlt.rl.rewards:integer_match") is integer_match
    assert load_reward_function("tlt.rl.rewards.integer_match") is integer_match
    with pytest.raises(RewardError, match="cannot load"):
        load_reward_function("tlt.rl.rewards:nope")
    with pytest.raises(RewardError, match="dotted path"):
        load_reward_function("nodots")


def test_a_reward_module_in_the_current_directory_gets_a_pythonpath_hint(tmp_path, monkeypatch):
    """`task.reward=myrew:score` with myrew.py beside the user said only "No module named 'myrew'": the console
    script does not import from the current directory (found by review)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myrew_tlt_test.py").write_text("def score(completion, example):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"No module named 'myrew_tlt_test' \(myrew_tlt_test\.py is in the current "
                                          r"directory, which tlt does not import from: run with PYTHONPATH=\.\)"):
        load_reward_function("myrew_tlt_test:score")
    with pytest.raises(RewardError, match=r"No module named 'elsewhere'\Z"):  # no hint when no such file is here
        load_reward_function("elsewhere:score")


def test_a_reward_that_cannot_take_completion_and_example_is_refused_when_it_loads(tmp_path, monkeypatch):
    """def score(completion) failed on every sample: three steps of zero rewards, each checkpointed, before the
    run stopped (QA). Controls: defaults, *args and keyword-or-positional parameters are fine."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "sig_tlt_test.py").write_text(
        "def one(completion):\n    return 1.0\n"
        "def three(completion, example, extra):\n    return 1.0\n"
        "def keyword_only(*, completion, example):\n    return 1.0\n"
        "def fine(completion, example, scale=1.0):\n    return scale\n"
        "def star(*args):\n    return 1.0\n"
        "class Scorer:\n    def __call__(self, completion, example):\n        return 1.0\n"
        "scorer = Scorer()\n")
    for name in ("one", "three", "keyword_only"):
        with pytest.raises(RewardError, match=rf"reward 'sig_tlt_test:{name}' must take \(completion, example\)"):
            load_reward_function(f"sig_tlt_test:{name}")
    for name in ("fine", "star", "scorer"):
        assert callable(load_reward_function(f"sig_tlt_test:{name}"))


def test_build_reward_auto():
    assert build_reward(TaskConfig()).check is integer_match
    assert build_reward(TaskConfig(name="jsonl", path="x")).check is math_verify_match


def test_a_nan_or_inf_reward_scores_0_as_a_failure():
    """A non-finite reward made every weight NaN in one update, and that policy was checkpointed (found by review):
    it now counts as a failed reward call, as one that raises."""
    values = iter([float("nan"), 1.0, float("inf"), float("-inf")])
    scores = Reward(lambda completion, ex: next(values)).score(["a", "b", "c", "d"], [example(3)] * 4)
    assert scores.rewards == [0.0, 1.0, 0.0, 0.0] and scores.failures == 3



def test_a_reward_too_large_for_the_groups_statistics_scores_0_as_a_failure():
    """1e308 is finite, but its group's mean overflowed and every update was skipped for a NaN gradient, the
    message blaming the gradient (found by a CLI trial). 1e15 is the largest accepted."""
    from tlt.rl.grpo import group_advantages

    values = iter([1e308, -1e16, 1e15, 1.0])
    scores = Reward(lambda completion, ex: next(values)).score(["a", "b", "c", "d"], [example(3)] * 4)
    assert scores.rewards == [0.0, 0.0, 1e15, 1.0] and scores.failures == 2
    import torch

    assert torch.isfinite(group_advantages(torch.tensor([[1e15, -1e15, 0.0, 1.0]]))).all()


def test_math_verify_scores_on_worker_threads_as_on_the_main_thread():
    """math-verify's timeouts use signal.alarm, main thread only: on the in-process backend's worker threads
    every call raised, so every answer scored 0 and counted as a failure (found by review). Off the main thread
    it now runs in a child process. The same completions score the same on both."""
    import threading

    completions = ["\\boxed{0.5}", "so \\boxed{\\frac{2}{4}}", "\\boxed{3}", "no answer"]
    examples = [TaskExample("q", "\\frac{1}{2}")] * len(completions)
    on_main = Reward(math_verify_match).score(completions, examples)
    scored = {}
    worker = threading.Thread(target=lambda: scored.update(r=Reward(math_verify_match).score(completions, examples)))
    worker.start()
    worker.join()
    assert on_main.rewards == scored["r"].rewards == [1.0, 1.0, 0.0, 0.0]
    assert on_main.failures == scored["r"].failures == 0


def test_a_math_verify_check_past_its_hard_timeout_is_a_failure_and_the_child_is_replaced(monkeypatch):
    import tlt.rl.math_check as rewards

    checker = rewards._MathVerifyProcess()
    monkeypatch.setattr(rewards, "MATH_VERIFY_HARD_TIMEOUT_S", 0.01)  # the child's start alone takes longer
    with pytest.raises(TimeoutError, match="math-verify took over 0.01 s on '1/2'"):
        checker("0.5", "1/2")
    assert checker._child is None  # killed, to be started again
    monkeypatch.setattr(rewards, "MATH_VERIFY_HARD_TIMEOUT_S", 60.0)
    assert checker("0.5", "1/2") == 1.0
    checker._child.kill()  # a child that died (out of memory): one failure, then a new child
    checker._child.wait()
    with pytest.raises(RuntimeError, match="math-verify's process ended"):
        checker("0.5", "1/2")
    assert checker("0.5", "1/3") == 0.0
    checker._stop()


@pytest.mark.parametrize("completion,gold,score", [
    ("The answer is 5/8.", "5", 0.0), ("The answer is 2^10.", "2", 0.0), ("The answer is 12 - 7 = 5.", "12", 0.0),
    ("The answer is 7x.", "7", 0.0), ("The answer is 3/4.", "3", 0.0),
    ("The answer is -$5.", "-5", 1.0), ("Answer: **42**", "42", 1.0), ("The answer is $1,234$.", "1234", 1.0),
    ("so the answer is 12\nthen more text", "12", 1.0)])
def test_the_answer_is_fallback_judges_the_whole_answer(completion, gold, score):
    """Without a box, "the answer is" kept the leading number: "5/8" scored as 5, "2^10" as 2 — wrong answers
    rewarded, a way for the policy to collect reward (found by review). The rest of the sentence is the answer."""
    assert integer_match(completion, example(gold)) == score
    assert math_verify_match(completion, example(gold)) == score


@pytest.mark.parametrize("completion,gold,score", [
    ("The answer is 42, which is even.", "42", 1.0), ("The answer is 42?", "42", 1.0),
    ("The answer is 42; done", "42", 1.0), ("The answer is 42.\nFinal answer", "42", 1.0),
    ("**Final Answer**\n\n42", "42", 1.0), ("The answer is 3 (x+1).", "3(x+1)", 1.0),
    ("The answer is 42 (forty-two).", "42", 1.0), ("The answer is 18 dollars.", "18", 1.0),
    ("The answer is $5$ dollars.", "5", 1.0), ("**Answer**: 42", "42", 1.0), ("The answer is:\n42", "42", 1.0),
    ("**Final Answer**\n42", "42", 1.0), ("The answer is 1, 2, and 3", "1, 2, 3", 1.0),
    # controls: still wrong ("5!" is a factorial: 120; a review)
    ("the answer is 5!", "5", 0.0), ("The answer is 3 million.", "3", 0.0), ("3 cats", "3", 0.0),
    ("The answer is 2 thirds.", "2", 0.0), ("The answer is 5 below zero.", "5", 0.0),
    ("The answer is 3 (x+1).", "3", 0.0), ("The answer is 42 because it is even", "42", 0.0),
    ("answer: x = 2, y = 3", "2", 0.0), ("Let me check the answer\nWe have 2+2=4", "4", 0.0),
    ("The answer is 5 times 3.", "5", 0.0)])
def test_the_answer_is_fallback_ends_where_the_sentence_goes_on_in_words(completion, gold, score):
    """A correct answer followed by words ("42, which is even", "42?", "18 dollars") scored 0, and "**Answer**: 42",
    "The answer is:\\n42" and a "**Final Answer**" heading were not read at all (found by a trial)."""
    if gold.lstrip("-").isdigit():  # the integer reward refuses other golds
        assert integer_match(completion, example(gold)) == score
    assert math_verify_match(completion, example(gold)) == score


@pytest.mark.parametrize("text", ["The answer is 5" + " " * 100_000 + "x", "The answer is 5" + "**" * 50_000 + "x",
                                  "The answer is 5," + " " * 100_000 + "1", "The answer is 5" + "$" * 100_000])
def test_an_unboxed_answer_is_read_in_linear_time(text):
    """`\\s+\\(` in the clause cut took 29 s on 100,000 spaces, the markup strip 106 s on 50,000 "**" (a review)."""
    import time

    started = time.perf_counter()
    extract_answer(text)
    assert time.perf_counter() - started < 1.0


def test_a_gold_written_with_a_currency_sign_matches():
    """A gold of -$5 matched no answer: the response's dollar signs were dropped, the gold's not (a trial)."""
    assert math_verify_match(r"\boxed{-5}", example("-$5")) == 1.0
    assert math_verify_match(r"\boxed{-6}", example("-$5")) == 0.0


def test_an_async_reward_function_is_refused_when_it_loads(tmp_path, monkeypatch):
    """Its call returned a coroutine never awaited: every sample a failure, with Python's warning (a trial)."""
    (tmp_path / "async_reward.py").write_text("async def score(completion, example):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="is an async function"):
        load_reward_function("async_reward:score")


def test_the_answer_is_fallback_gives_math_verify_the_whole_expression():
    assert math_verify_match("The answer is 3/4.", example("3/4")) == 1.0  # was cut to 3: scored 0
    assert math_verify_match(r"so the answer is \(\frac{1}{2}\).", example("0.5")) == 1.0


def test_a_reward_function_returning_text_is_a_failure_even_if_it_reads_as_a_number():
    """float("1.0") scored a function that returned its extracted answer text as 1.0 (found by a new-user pass)."""
    scores = Reward(lambda completion, ex: "1.0").score(["x"], [example(1)])
    assert scores.rewards == [0.0] and scores.failures == 1


@pytest.mark.parametrize("completion,gold,score", [
    (r"\boxed{4,2}", "42", 0.0), (r"\boxed{12, 13}", "1213", 0.0), (r"\boxed{1 234}", "1234", 0.0),  # two numbers
    (r"\boxed{1,234}", "1234", 1.0), (r"\boxed{-1,234,567}", "-1234567", 1.0), (r"\boxed{\$42}", "42", 1.0),
    (r"\boxed{42.0}", "42", 1.0), ("\\boxed{\u22125}", "-5", 1.0), (r"\boxed{\textbf{42}}", "42", 1.0),
    (r"\boxed{= 42}", "42", 1.0), (r"\boxed{042}", "42", 1.0), (r"\boxed{-0}", "0", 1.0), (r"\boxed{42.5}", "42", 0.0),
    ("The answer is: 42", "42", 1.0), ("Final Answer: The final answer is 42", "42", 1.0),
    ("The answer isn't 42, it is 41", "42", 0.0), (r"\boxed{" + "9" * 5000 + "}", "9" * 5000, 1.0),
    ("The answer is 1,000.", "1,000", 1.0), (r"\boxed{1{,}000}", "1000", 1.0), (r"\boxed{4{,}2}", "42", 0.0)])
def test_integer_answers_in_their_usual_forms_and_only_them(completion, gold, score):
    """The integer reward dropped every comma and space, so \\boxed{4,2} scored right for 42 and \\boxed{12, 13} for
    1213; "The answer is: 42", \\$42, 42.0, a Unicode minus and \\textbf{42} scored wrong; a 5,000-digit answer
    raised (int() refuses past 4,300 digits) and a gold of "1,000" failed on every sample (found by review)."""
    assert integer_match(completion, example(gold)) == score


def test_a_long_run_of_spaces_is_no_slow_answer_search():
    import time

    started = time.perf_counter()
    assert extract_answer("the answer is" + " " * 50_000 + "x" + " " * 50_000) == "x"
    assert time.perf_counter() - started < 1.0  # was quadratic: 20,000 spaces took 2.9 s


def test_the_last_complete_box_is_the_answer_and_an_empty_one_none():
    """A response cut off inside a second box scored 0 after a correct \\boxed{42}; an empty \\boxed{} earned the
    format bonus (found by review)."""
    assert extract_boxed(r"so \boxed{42}. Check: \boxed{4") == "42"
    assert extract_boxed(r"\boxed{}") is None and extract_boxed(r"\boxed{ {} }") == "{}"
    assert Reward(integer_match, format_reward=0.1).score([r"\boxed{}"], [example(42)]).rewards == [0.0]


def test_many_unclosed_boxes_take_one_pass():
    import time

    started = time.perf_counter()
    assert extract_boxed(r"\boxed{7} " + r"\boxed{" * 20_000) == "7"
    assert time.perf_counter() - started < 2.0  # a scan per box: 20,000 x 140,000 characters


def test_math_verify_logs_a_long_text_shortened(caplog):
    """math-verify logs a timeout with the whole text it parsed: one 100,000-character line per sample (a trial)."""
    import logging

    from tlt.rl.math_check import _Shortened  # importing it installs the filter

    assert any(isinstance(f, _Shortened) for f in logging.getLogger("math_verify.parser").filters)

    with caplog.at_level("WARNING", logger="math_verify.parser"):
        logging.getLogger("math_verify.parser").warning(f"Timeout during parsing: {'x' * 100_000}")
    assert len(caplog.records[-1].getMessage()) < 300 and "(100,024 characters)" in caplog.text
