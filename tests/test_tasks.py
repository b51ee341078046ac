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
    with pytest.raises(DatasetError, match=r"data.jsonl, line 2: missing field 'answer'"):
        load_examples(path)
    path.write_text("{not json\n")
    with pytest.raises(DatasetError, match="line 1: not valid JSON"):
        load_examples(path)


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "solution": ["1", "2"]}), path)
    examples = load_examples(path, prompt_field="prompt", answer_field="solution")
    assert [(e.prompt, e.answer) for e in examples] == [("a", "1"), ("b", "2")]
    with pytest.raises(DatasetError, match="line 1: missing field 'question'"):
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
