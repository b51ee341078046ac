"""task.name=hf: Hugging Face `datasets` datasets from local paths (save_to_disk directories, data files, dataset
directories), with a split and a field mapping; one-line errors, also without the datasets package."""

import json
import sys

import pytest

from tlt.rl.config import load_config
from tlt.rl.preflight import preflight
from tlt.tasks import DatasetError, DatasetTask, build_task, load_task_examples
from tlt.tasks.hf import INSTALL_HINT, load_hf_examples

ROWS = [{"problem": f"What is {i} + {i}?", "solution": f"{i} + {i} = {2 * i}\n#### {2 * i}", "id": i}
        for i in range(6)]


@pytest.fixture
def datasets(tmp_path, monkeypatch):
    """The datasets package (the data extra), its cache kept inside tmp_path."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return datasets


def answers(examples):
    return [e.answer for e in examples]


def test_a_saved_dataset_dict_by_split_with_slices(tmp_path, datasets):
    whole = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": whole.select(range(4)), "test": whole.select(range(4, 6))}).save_to_disk(
        str(tmp_path / "dd"))
    load = lambda split: load_hf_examples(tmp_path / "dd", split, "problem", "solution")  # noqa: E731
    assert answers(load("train")) == ["0", "2", "4", "6"]  # "#### N" reduced to N, as for JSONL
    assert answers(load("test")) == ["8", "10"]
    assert answers(load("train[1:3]")) == ["2", "4"]
    assert answers(load("train[:1]+test[-1:]")) == ["0", "10"]
    assert load("test")[0].prompt == "What is 4 + 4?" and load("test")[0].meta["row"] == 1
    with pytest.raises(DatasetError, match=r"dd: cannot load split 'validation' with datasets \(Unknown split "
                                           r"\"validation\". Should be one of \['train', 'test'\]\.\)"):
        load("validation")


def test_a_saved_dataset_is_split_train(tmp_path, datasets):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    examples = load_hf_examples(tmp_path / "ds", "train[50%:]", "problem", "solution")
    assert answers(examples) == ["6", "8", "10"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_data_files_of_each_format(tmp_path, datasets, suffix):
    path = tmp_path / f"data{suffix}"
    table = datasets.Dataset.from_list(ROWS)
    if suffix == ".parquet":
        table.to_parquet(str(path))
    elif suffix == ".csv":
        table.to_csv(str(path), index=False)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    examples = load_hf_examples(path, "train[:3]", "problem", "solution")
    assert [(e.prompt, e.answer) for e in examples] == [(r["problem"], str(2 * r["id"])) for r in ROWS[:3]]


def test_a_dataset_directory_of_split_files(tmp_path, datasets):
    """A cloned hub repository: data files named by split, read with load_dataset(path)."""
    (tmp_path / "repo" / "data").mkdir(parents=True)
    for split, rows in (("train", ROWS[:5]), ("test", ROWS[5:])):
        (tmp_path / "repo" / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert answers(load_hf_examples(tmp_path / "repo", "test", "problem", "solution")) == ["10"]
    assert len(load_hf_examples(tmp_path / "repo", "train", "problem", "solution")) == 5


def test_the_task_config_builds_a_dataset_task_and_preflight_counts_it(tmp_path, datasets):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    fields = ["task.name=hf", f"task.path={path}", "task.prompt_field=problem", "task.answer_field=solution"]
    config = load_config(None, fields + ["task.split=train[:4]", "task.eval_size=1", "rollout.prompts_per_step=2",
                                         "run.workers=1", "run.speculative=off"])
    task = build_task(config.task, tokenizer=None)
    assert isinstance(task.source, DatasetTask) and len(task.source.examples) == 3
    assert answers(task.eval_examples) == ["6"]  # the split's last row is held out
    preflight(config)
    short = load_config(None, fields + ["task.split=train[:2]", "rollout.prompts_per_step=4", "run.workers=1",
                                        "run.speculative=off"])
    with pytest.raises(DatasetError, match=r"\(task.split=train\[:2\]\) has 2 example\(s\), fewer than the 4 one step "
                                           r"needs"):
        preflight(short)


def test_bad_inputs_are_one_line(tmp_path, datasets):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    with pytest.raises(DatasetError, match=r"data.jsonl \[train\], row 1: missing field 'question' \(fields present: "
                                           r"id, problem, solution\)"):
        load_hf_examples(path)  # the default field names do not fit this dataset
    with pytest.raises(DatasetError, match="dataset not found: .*nowhere .task.name=hf reads local paths only"):
        load_hf_examples(tmp_path / "nowhere")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"reads .json, .jsonl, .parquet, .csv files or dataset directories, "
                                           r"not '.txt'"):
        load_hf_examples(tmp_path / "data.txt")
    with pytest.raises(DatasetError, match="cannot load split 'train.:abc.' with datasets"):
        load_hf_examples(path, "train[:abc]", "problem", "solution")
    (tmp_path / "empty.jsonl").write_text("")  # datasets said only "(StopIteration)" (found by QA)
    with pytest.raises(DatasetError, match="empty.jsonl is empty: no records to train on"):
        load_hf_examples(tmp_path / "empty.jsonl")
    # rows decode lazily: a file that is not UTF-8 was a UnicodeDecodeError traceback (found by review)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9 2+2?", "answer": "4"}\n')
    with pytest.raises(DatasetError, match=r"latin1.jsonl: not UTF-8 text \(byte 0xe9\)"):
        load_hf_examples(tmp_path / "latin1.jsonl")
    (tmp_path / "hello.json").write_text("hello")  # the cause under datasets' "An error occurred while ..."
    with pytest.raises(DatasetError, match=r"hello.json: cannot load split 'train' with datasets \(.+: \w+: .+\)"):
        load_hf_examples(tmp_path / "hello.json")
    # a bad line of a .jsonl file: datasets said "Trailing data at position 43" or blamed the row before (a trial)
    lines = [json.dumps({"question": f"{i}?", "answer": str(i)}) for i in range(5)] + ['{"question": "5?", "ans']
    (tmp_path / "cut.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"cut.jsonl, line 6: not valid JSON"):
        load_hf_examples(tmp_path / "cut.jsonl")


def test_without_the_datasets_package_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    config = load_config(None, ["task.name=hf", f"task.path={path}"])
    with pytest.raises(DatasetError, match="task.name=hf needs the datasets package") as error:
        load_task_examples(config.task)
    assert str(error.value) == INSTALL_HINT == 'task.name=hf needs the datasets package: pip install "tlt-rl[data]"'
