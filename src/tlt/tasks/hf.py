"""`task.name=hf`: prompt/answer records from a local Hugging Face `datasets` dataset (the data extra).

`task.path` is a directory written by `save_to_disk` (a Dataset or a DatasetDict: `load_from_disk`), a .json/.jsonl/
.parquet/.csv file (`load_dataset("json"/"parquet"/"csv", data_files=...)`), or a local dataset directory that
`load_dataset(path)` reads (data files, e.g. a cloned hub repository). Only local paths: nothing is downloaded.
`task.split` takes the datasets split syntax, slices and sums included ("train", "test[:200]", "train[:10%]").
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tlt.errors import first_line
from tlt.tasks.example import TaskExample
from tlt.tasks.loaders import DatasetError, jsonl_records, records_to_examples

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
INSTALL_HINT = 'task.name=hf needs the datasets package: pip install "tlt-rl[data]"'


def load_hf_examples(path: str | Path, split: str = "train", prompt_field: str = "question",
                     answer_field: str = "answer") -> list[TaskExample]:
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset not found: {path} (task.name=hf reads local paths only)")
    if path.is_file() and path.stat().st_size == 0:  # datasets says only "StopIteration"
        raise DatasetError(f"{path} is empty: no records to train on")
    datasets = _import_datasets()
    with _quiet(datasets):
        try:
            # rows are decoded as they are read: a file that is not UTF-8 fails here, not at load_dataset
            records = list(enumerate(_load(datasets, path, split), start=1))
        except DatasetError:
            raise
        except UnicodeDecodeError as error:
            raise DatasetError(f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x}); save the file as "
                               f"UTF-8") from None
        except Exception as error:  # noqa: BLE001 - datasets raises many types (ValueError, FileNotFoundError, ...)
            _name_a_bad_jsonl_line(path)
            raise DatasetError(f"{path}: cannot load split {split!r} with datasets ({_root_cause(error)})") from None
    return records_to_examples(records, prompt_field, answer_field, f"{path} [{split}]", "row")


def _name_a_bad_jsonl_line(path: Path) -> None:
    """A .jsonl file datasets could not read: the JSON Lines reader of task.name=jsonl names the bad line
    (datasets said "Trailing data at position 43", or blamed a column's type in the row before; found by a trial)."""
    if path.is_file() and path.suffix.lower() == ".jsonl":
        for _ in jsonl_records(path):  # raises DatasetError naming the line, if one is bad
            pass


def _root_cause(error: BaseException) -> str:
    """datasets wraps the cause ("An error occurred while generating the dataset"): the innermost one says what
    is wrong with the file; both are named when they differ."""
    root, seen = error, set()
    while (root.__cause__ or root.__context__) is not None and id(root) not in seen:
        seen.add(id(root))
        root = root.__cause__ or root.__context__
    outer = first_line(error)
    if root is error:
        return outer
    return f"{outer}: {type(root).__name__}: {first_line(root)}"


def _load(datasets, path: Path, split: str):
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        return _select_split(datasets, datasets.load_from_disk(str(path)), split)
    if path.is_dir():
        return datasets.load_dataset(str(path), split=split)
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(f"{path}: task.name=hf reads {', '.join(FILE_BUILDERS)} files or dataset directories, "
                           f"not {path.suffix or 'a file without a suffix'!r}")
    return datasets.load_dataset(builder, data_files=str(path), split=split)


def _select_split(datasets, loaded, split: str):
    """A `save_to_disk` directory: a DatasetDict's splits by name, a lone Dataset as split "train"."""
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    parts = datasets.ReadInstruction.from_spec(split).to_absolute({name: len(ds) for name, ds in splits.items()})
    selected = [splits[part.splitname].select(range(part.from_, part.to)) for part in parts]
    return selected[0] if len(selected) == 1 else datasets.concatenate_datasets(selected)


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise DatasetError(INSTALL_HINT) from None
    return datasets


@contextlib.contextmanager
def _quiet(datasets):
    """No "Generating train split" bars between tlt's own lines."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()

