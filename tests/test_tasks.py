import json
import statistics

import pytest

from tlt.rl.rewards import integer_match
from tlt.tasks import ArithmeticTask, ArithmeticTaskConfig, DatasetError, load_examples


def test_arithmetic_is_deterministic_correct_and_graded():
    task = ArithmeticTask(ArithmeticTaskConfig(min_operations=1, max_operations=6))
    problems = task.sample(400, seed=3)
    assert problems == task.sample(400, seed=3) and problems != task.sample(400, seed=4)
    for p in problems:
        assert int(p.answer) == eval(p.meta["expression"])  # noqa: S307 — generated arithmetic only
        assert r"\boxed" in p.prompt and p.meta["expression"] in p.prompt
        assert integer_match(rf"\boxed{{{p.answer}}}", p) == 1.0
    levels = [p.meta["operations"] for p in problems]
    assert levels.count(1) > levels.count(3) > levels.count(6) > 0  # few hard problems: a long tail
    easy = statistics.mean(len(p.meta["expression"]) for p in problems if p.meta["operations"] == 1)
    hard = statistics.mean(len(p.meta["expression"]) for p in problems if p.meta["operations"] == 6)
    assert hard > 3 * easy


def test_bad_task_config():
    with pytest.raises(ValueError, match="min_operations"):
        ArithmeticTaskConfig(min_operations=4, max_operations=2)


def test_jsonl_gsm8k_answers_and_missing_fields(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "2 plus 2\n#### 4"}) + "\n\n"
                    + json.dumps({"question": "big?", "answer": "#### 1,200"}) + "\n")
    examples = load_examples(path)
    assert [e.answer for e in examples] == ["4", "1200"]
    path.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n" + json.dumps({"question": "q2"}) + "\n")
    with pytest.raises(DatasetError, match=r"data.jsonl, line 2: missing field 'answer'.*; task.answer_field names"):
        load_examples(path)
    path.write_text(json.dumps({"prompt": "q", "response": "1"}) + "\n")  # another dataset's names: say the key
    with pytest.raises(DatasetError, match=r"missing field 'question' \(fields present: prompt, response\); "
                                           r"task.prompt_field names the field to read"):
        load_examples(path)
    path.write_text("{not json\n")
    with pytest.raises(DatasetError, match="line 1: not valid JSON"):
        load_examples(path)


def test_numeric_golds_in_plain_digits_score_as_written(tmp_path):
    """JSON numbers Python prints with an exponent (5e-05, 1e+16) become plain digits, which a response's own
    answer matches; the control shows the exponent text never scored."""
    from tlt.rl.rewards import math_verify_match

    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"question": "q", "answer": a}) for a in (0.00005, 1e16, 2.5, 7)) + "\n")
    examples = load_examples(path)
    assert [e.answer for e in examples] == ["0.00005", "10000000000000000", "2.5", "7"]
    assert math_verify_match(r"\boxed{0.00005}", examples[0]) == 1.0
    assert math_verify_match(r"\boxed{10^{16}}", examples[1]) == 1.0
    control = type(examples[0])(examples[0].prompt, "5e-05")
    assert math_verify_match(r"\boxed{0.00005}", control) == 0.0


def test_gsm8k_golds_keep_the_number_of_their_line(tmp_path):
    """Text on lines after '#### N' was kept in the gold, and '#### 18 dollars' gave the gold "18 dollars",
    which no boxed 18 matches; a string gold "1e-05" never matched 0.00001 (QA). Controls: a gold that is no
    number with a unit, or a fraction, is kept as written."""
    from tlt.rl.rewards import math_verify_match

    golds = ["work\n#### 42\nmore text", "#### 18 dollars", "####\n7", "#### 3/4", "#### 5 dollars and 3 cents",
             "1e-05", "-2.5E+2", "e5"]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"question": "q", "answer": a}) for a in golds) + "\n")
    answers = [e.answer for e in load_examples(path)]
    assert answers == ["42", "18", "7", "3/4", "5 dollars and 3 cents", "0.00001", "-250", "e5"]
    assert math_verify_match(r"\boxed{18}", load_examples(path)[1]) == 1.0


@pytest.mark.parametrize("gold,kept", [
    ("#### 2,3", "2,3"), ("#### 1,5,7", "1,5,7"), ("#### 1,234", "1234"), ("#### 3 million", "3 million"),
    ("#### 4 hundred", "4 hundred"), ("#### 2 pi", "2 pi"), ("#### 3 i", "3 i"), ("18 dollars", "18"),
    ("#### 1,234.5 kg", "1234.5"), ("-$5", "-$5"), ("5 \\text{ cm}", "5 \\text{ cm}"),
    # a review: text golds, value words, and a plain gold's commas (its fingerprint) are kept
    ("3 Doors Down", "3 Doors Down"), ("2 Samuel", "2 Samuel"), ("3,000 BC", "3,000 BC"), ("1,000", "1,000"),
    ("#### 2 thirds", "2 thirds"), ("#### 2 and a half", "2 and a half")])
def test_a_gold_keeps_its_value(gold, kept):
    """Every comma of a '####' gold was dropped ("2,3" became 23) and any word after its number too ("3 million"
    became 3); a plain gold kept its unit ("18 dollars" matched no boxed 18): found by a trial. Thousands
    separators and unit words go, words that change the value stay."""
    from tlt.tasks.loaders import normalize_answer

    assert normalize_answer(gold) == kept


def test_a_warmup_reads_prompts_without_answers(tmp_path):
    """A drafter warm-up never scores its responses: a file of prompts only is fine there (QA), not for training."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"question": "2+2?"}) + "\n" + json.dumps({"question": "3+3?"}) + "\n")
    assert [(e.prompt, e.answer) for e in load_examples(path, answer_field=None)] == [("2+2?", ""), ("3+3?", "")]
    with pytest.raises(DatasetError, match="line 1: missing field 'answer'"):
        load_examples(path)


def test_integers_in_a_float_column_are_integers_and_long_ones_are_refused(tmp_path):
    """A parquet float column (one row with a decimal point makes a whole column float) gave golds "4.0", and
    2^60 as "1152921504606847000", which no correct response matched: a float keeps 17 significant digits (QA).
    An integer-valued float is its integer; past 2^53 it is refused unless it is a round number. Control: the
    same 2^60 in an integer column reads exactly."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"question": list("abcde"), "answer": [4.0, 2.5, 1e20, 1e23, 1.2345678901234e22]}), path)
    assert [e.answer for e in load_examples(path)] == ["4", "2.5", "100000000000000000000",  # as written, not the
                                                       "100000000000000000000000",  # float's binary value
                                                       "12345678901234000000000"]
    pq.write_table(pa.table({"question": ["a", "b"], "answer": [4.0, float(2 ** 60)]}), path)
    with pytest.raises(DatasetError, match=r"floats.parquet, row 2: field 'answer' holds 1.152921504606847e\+18, a "
                                           r"number read as a float past 2\^53"):
        load_examples(path)
    pq.write_table(pa.table({"question": ["a"], "answer": pa.array([2 ** 60], pa.int64())}), path)
    assert load_examples(path)[0].answer == "1152921504606846976"


def test_a_lone_surrogate_is_named_not_a_traceback(tmp_path):
    """JSON's "\\ud83e" (half of an emoji) is valid JSON but no UTF-8 text: the run's dataset fingerprint
    raised UnicodeEncodeError with a traceback (QA). Control: the whole pair reads."""
    path = tmp_path / "cut.jsonl"
    path.write_text('{"question": "2+2? \\ud83e\\udd14", "answer": "4"}\n{"question": "2+2? \\ud83e", '
                    '"answer": "4"}\n')
    with pytest.raises(DatasetError, match=r"cut.jsonl, line 2: field 'question' holds a lone UTF-16 surrogate "
                                           r"\('\\ud83e' at character 5"):
        load_examples(path)
    path.write_text(path.read_text().splitlines()[0] + "\n")
    assert load_examples(path)[0].prompt == "2+2? \U0001f914"


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "solution": ["1", "2"]}), path)
    examples = load_examples(path, prompt_field="prompt", answer_field="solution")
    assert [(e.prompt, e.answer) for e in examples] == [("a", "1"), ("b", "2")]
    with pytest.raises(DatasetError, match="data.parquet, row 1: missing field .question."):  # a table has rows
        load_examples(path)


def test_a_null_field_is_named_as_null_not_missing(tmp_path):
    """A null answer read 'missing field 'answer' (fields present: answer, question)', naming it twice."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": None}) + "\n")
    with pytest.raises(DatasetError, match=r"data.jsonl, line 1: field 'answer' is null$"):
        load_examples(path)


@pytest.mark.parametrize("indent", [None, 1])
def test_a_json_array_file_is_named_as_such(tmp_path, indent):
    """A .json file holding a JSON array (a common dataset layout) read 'line 1: not valid JSON (Expecting
    value)' when pretty-printed: the file is fine, only not JSON Lines; task.name=hf reads it."""
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"question": "q", "answer": "1"}] * 2, indent=indent))
    with pytest.raises(DatasetError, match="a JSON array, but tlt reads JSON Lines here.*task.name=hf"):
        load_examples(path)


def test_a_dataset_is_read_in_shuffled_epochs():
    """Training steps read a dataset as a shuffling data loader would: every example once per epoch (it used
    to draw each step independently, so over one epoch's worth of steps about a third was never seen), a new
    order each epoch, and the same steps for the same seed (a resumed run reads on where it stopped)."""
    from tlt.tasks import DatasetTask, TaskExample

    task = DatasetTask([TaskExample(f"q{i}", str(i)) for i in range(10)])
    steps = [task.step_examples(4, step, seed=7) for step in range(5)]  # 20 positions: two epochs
    stream = [example.answer for batch in steps for example in batch]
    first, second = stream[:10], stream[10:]
    assert sorted(first, key=int) == sorted(second, key=int) == [str(i) for i in range(10)]
    assert first != second  # reshuffled
    assert [e.answer for e in task.step_examples(4, 3, seed=7)] == stream[12:16]  # a function of (step, seed)
    assert stream != [e.answer for step in range(5) for e in task.step_examples(4, step, seed=8)]


def test_training_steps_take_their_prompts_from_the_epoch_stream():
    """sample_prompts (the trainer's and the workers' draw) reads a dataset task in epochs."""
    from types import SimpleNamespace

    from tlt.rl.phases import sample_prompts
    from tlt.tasks import ChatTask, DatasetTask, TaskExample

    examples = [TaskExample(f"q{i}", str(i)) for i in range(6)]
    config = SimpleNamespace(rollout=SimpleNamespace(prompts_per_step=3), run=SimpleNamespace(seed=0))
    replica = SimpleNamespace(config=config, task=ChatTask(DatasetTask(examples), tokenizer=None))
    seen = [e.answer for step in (0, 1) for e in sample_prompts(replica, step)]
    assert sorted(seen, key=int) == [str(i) for i in range(6)]


def _jsonl(path, records, **dumps):
    path.write_text("".join(json.dumps(r, **dumps) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize("record,message", [
    ({"question": [{"role": "user", "content": "1+1?"}], "answer": "2"}, "field 'question' is list, not text (a list of chat"),
    ({"question": {"text": "1+1?"}, "answer": "2"}, "field 'question' is dict, not text"),
    ({"question": "1+1?", "answer": [2]}, "field 'answer' is list, not text"),
    ({"question": "1+1?", "answer": True}, "field 'answer' is bool, not text"),
    ({"question": "1+1?", "answer": float("nan")}, "field 'answer' is NaN"),
    ({"question": "1+1?", "answer": float("-inf")}, "field 'answer' is infinite"),
    ({"question": "1+1?", "answer": ""}, "field 'answer' is empty"),
    ({"question": "1+1?", "answer": "work... #### "}, "field 'answer' is empty after '####'"),
    ({"question": "  ", "answer": "2"}, "field 'question' is empty")])
def test_records_that_are_not_text_or_are_empty_are_refused(tmp_path, record, message):
    """They became Python reprs ("[{'role': 'user', ...}]", the gold "nan") or golds nothing can match, and were
    trained on (found by review)."""
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "2+2?", "answer": "4"}, record])
    with pytest.raises(DatasetError, match=rf"d.jsonl, line 2: {__import__('re').escape(message)}"):
        load_examples(path)


def test_numeric_answers_jsonl_line_separators_a_bom_and_upper_case_suffixes_are_read(tmp_path):
    """U+2028 inside a string split the line (splitlines), a byte-order mark failed the first record, .JSONL was
    an unsupported format (found by review)."""
    path = tmp_path / "D.JSONL"
    _jsonl(path, [{"question": "a\u2028b\u0085c?", "answer": 42}, {"question": "1+1?", "answer": 2.5}],
           ensure_ascii=False)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    examples = load_examples(path)
    assert [(e.prompt, e.answer) for e in examples] == [("a\u2028b\u0085c?", "42"), ("1+1?", "2.5")]
    assert [e.meta["line"] for e in examples] == [1, 2]


def test_a_task_name_that_is_not_the_files_format_is_refused(tmp_path):
    from tlt.rl.config import load_config
    from tlt.tasks import load_task_examples

    path = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}])
    with pytest.raises(DatasetError, match=r"task.name=parquet but task.path=.*d.jsonl is a .jsonl file"):
        load_task_examples(load_config(None, ["task.name=parquet", f"task.path={path}"]).task)


@pytest.mark.parametrize("name", ["jsonl", "parquet"])
def test_a_directory_for_task_path_is_named_as_one(tmp_path, name):
    from tlt.rl.config import load_config
    from tlt.tasks import load_task_examples

    with pytest.raises(DatasetError, match=r"task.path=.* is a directory: give one"):
        load_task_examples(load_config(None, [f"task.name={name}", f"task.path={tmp_path}"]).task)
    with pytest.raises(DatasetError, match="is a directory"):
        load_examples(tmp_path)


def test_a_held_out_prompt_repeated_earlier_in_the_file_is_not_trained_on():
    """The split is positional: a duplicate of a held-out prompt among the training records was trained on
    (found by review); the arithmetic task already excluded held-out prompts by text."""
    from tlt.tasks.held_out import split_held_out
    from tlt.tasks.example import TaskExample
    from tlt.tasks.loaders import DatasetTask

    examples = [TaskExample(p, "1") for p in ("a", "b", "c", "b", "d", "b")]
    training, held_out = split_held_out(DatasetTask(examples), 2)
    assert [e.prompt for e in held_out] == ["d", "b"]
    assert [e.prompt for e in training.examples] == ["a", "c"]


def test_a_system_prompt_the_chat_template_refuses_is_one_line():
    """A Gemma-style template raises on a system message: a Jinja traceback after the model's load."""
    from test_verify import byte_tokenizer
    from tlt.errors import TltError
    from tlt.tasks.chat import chat_prompt_ids

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}\n"
                               "{% endfor %}")
    assert len(chat_prompt_ids(tokenizer, "hi")) == 3
    with pytest.raises(TltError, match="task.system_prompt: the model's chat template refuses a system message "
                                       r"\(System role not supported\)"):
        chat_prompt_ids(tokenizer, "hi", "Be brief.")
