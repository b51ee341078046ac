"""Datasets of prompt/answer records from JSONL or parquet files (GSM8K-style)."""

from __future__ import annotations

import json
import math
import random
import re
from decimal import Decimal
from pathlib import Path

from tlt.errors import TltError
from tlt.tasks.answer_text import number_without_words, without_thousands_separators
from tlt.tasks.example import TaskExample

GSM8K_ANSWER = re.compile(r"####[ \t]*\n?([^\n]*)")  # the rest of its line: text after it is no answer (QA)
EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class DatasetError(TltError):
    """A dataset file or record that cannot be used."""


def normalize_answer(answer) -> str:
    """GSM8K answers end with '#### N' after the worked solution: keep N, without thousands separators (1,234;
    not 2,3: two numbers). A number followed by one unit word loses the word (18 dollars; not 3 million, not
    2 Samuel), in a '####' answer or a plain one: no boxed answer carries it. A plain gold keeps its commas, as it
    always did (the run's dataset fingerprint hashes the golds: a run could not --resume over a new reading)."""
    text = str(answer).strip()
    match = GSM8K_ANSWER.search(text)
    if not match:
        return number_without_words(text)
    return without_thousands_separators(number_without_words(match.group(1).strip()))


def _text_field(value, name: str, where: str, *, answer: bool) -> str:
    """A prompt or answer as text. Numbers are fine answers (a gold of 42); anything else was turned into its
    Python repr and trained on — a chat-message list became the prompt "[{'role': 'user', ...}]", NaN the gold
    "nan" — and an empty text can never be answered (found by review)."""
    numeric = answer and isinstance(value, (int, float)) and not isinstance(value, bool)
    if numeric and value != value:
        raise DatasetError(f"{where}: field {name!r} is NaN")
    if numeric and value in (math.inf, -math.inf):
        raise DatasetError(f"{where}: field {name!r} is infinite, which no answer can match")
    if not (isinstance(value, str) or numeric):
        hint = (" (a list of chat messages: tlt formats a text prompt with the model's chat template; put the "
                "user's text in the field)" if isinstance(value, list) and not answer else
                " (a gold answer is one text or number)" if answer else "")
        raise DatasetError(f"{where}: field {name!r} is {type(value).__name__}, not text{hint}")
    if numeric and isinstance(value, float) and value.is_integer():
        value = _integer_of_float(value, name, where)
    if numeric and isinstance(value, float) and "e" in repr(value):
        # in plain digits: Python writes 0.00005 as "5e-05" and 1e16 as "1e+16", which no response's answer
        # (0.00005, 10^{16}) matches as text or as math-verify parses it (found by a CLI trial)
        value = format(Decimal(repr(value)), "f")
    text = normalize_answer(value) if answer else value
    if answer and EXPONENT.fullmatch(str(text).strip()):  # a gold "1e-05" as text: plain digits, as for numbers
        text = format(Decimal(str(text).strip()), "f")
    _check_encodable(str(text), name, where)
    if not str(text).strip():
        after = " after '####'" if answer and GSM8K_ANSWER.search(str(value)) else ""
        raise DatasetError(f"{where}: field {name!r} is empty{after}")
    return text


def _integer_of_float(value: float, name: str, where: str) -> int:
    """An integer a float column holds (a CSV or parquet column turns float when one row has a decimal point),
    written as the integer: "4", not "4.0". The number as written, from the float's shortest repr (1e23 is
    100000000000000000000000, not the float's exact ...991611392). Past 2^53 a float keeps 15-17 significant
    digits, so a long integer read as a float may have lost its last ones (12345678901234567890 is read as
    1.2345678901234567e+19): its gold could never be matched, and is refused unless it is a round number."""
    written = repr(value)
    mantissa = written.split("e")[0].replace("-", "").replace(".", "").strip("0")
    if abs(value) >= 2 ** 53 and len(mantissa) >= 15:
        raise DatasetError(f"{where}: field {name!r} holds {written}, a number read as a float past 2^53, whose "
                           f"last digits a float may have lost: store the answers as text (quoted) or integers")
    return int(Decimal(written))


def _check_encodable(text: str, name: str, where: str) -> None:
    """JSON's escapes can spell half of a UTF-16 surrogate pair ("\\ud83e", a cut emoji), which no UTF-8 text
    holds: the tokenizer and the run's fingerprint would fail on it later, with a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DatasetError(f"{where}: field {name!r} holds a lone UTF-16 surrogate "
                           f"({ascii(error.object[error.start])} at character {error.start}: half of an emoji "
                           f"cut in two?); remove it or complete the pair") from None


def load_examples(path: str | Path, prompt_field: str = "question", answer_field: str | None = "answer"
                  ) -> list[TaskExample]:
    """The file's records as examples; answer_field=None: prompts only (a drafter warm-up scores nothing), each
    example's answer empty."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset not found: {path}")
    if path.is_dir():
        raise DatasetError(f"{path} is a directory: give one .jsonl or .parquet file")
    if path.suffix.lower() == ".parquet":  # a table: its records are rows (a parquet error said "line 1")
        return records_to_examples(_parquet_records(path), prompt_field, answer_field, str(path), unit="row")
    if path.suffix.lower() in (".jsonl", ".json"):
        return records_to_examples(jsonl_records(path), prompt_field, answer_field, str(path))
    raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r} (use .jsonl or .parquet; a .csv file "
                       f"or a datasets directory reads with task.name=hf)")


def check_format(name: str, path: str | Path) -> None:
    """task.name=jsonl with a .parquet path (or the reverse) read the other format without a word."""
    suffix = Path(path).suffix.lower()
    expected = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}.get(name)
    if expected is not None and Path(path).is_dir():
        raise DatasetError(f"task.path={path} is a directory: give one {' or '.join(expected)} file")
    if expected is not None and suffix not in expected:
        raise DatasetError(f"task.name={name} but task.path={path} is a {suffix or 'suffix-less'} file: set "
                           f"task.name to its format ({' or '.join(expected)} files for {name}; task.name=hf "
                           f"reads .csv files and datasets directories too)")


def records_to_examples(records, prompt_field: str, answer_field: str | None, source: str, unit: str = "line"
                        ) -> list[TaskExample]:
    """(number, record dict) pairs to examples: the field mapping, GSM8K answers reduced, one-line errors that
    name the record (`unit` and its number). answer_field=None: no answers (empty)."""
    examples = []
    for number, record in records:
        for name in (prompt_field,) if answer_field is None else (prompt_field, answer_field):
            if name not in record:
                key = "task.prompt_field" if name == prompt_field else "task.answer_field"
                raise DatasetError(f"{source}, {unit} {number}: missing field {name!r} "
                                   f"(fields present: {', '.join(sorted(record)) or 'none'}); {key} names the "
                                   f"field to read")
            if record[name] is None:
                raise DatasetError(f"{source}, {unit} {number}: field {name!r} is null")
        where = f"{source}, {unit} {number}"
        gold = "" if answer_field is None else _text_field(record[answer_field], answer_field, where, answer=True)
        examples.append(TaskExample(_text_field(record[prompt_field], prompt_field, where, answer=False), gold,
                                    {"source": source, unit: number}))
    if not examples:
        raise DatasetError(f"{source}: no records")
    return examples


def jsonl_records(path: Path):
    try:
        # "\n" only: splitlines() also broke at U+2028, U+2029 and U+0085, which JSON allows raw inside strings;
        # utf-8-sig: a byte-order mark (Windows editors) is not part of the first record
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[:error.start].count(b"\n") + 1
        raise DatasetError(f"{path}, line {line}: not UTF-8 text (byte {error.object[error.start]:#04x}); "
                           f"save the file as UTF-8") from None
    except IsADirectoryError:
        raise DatasetError(f"{path} is a directory, not a .jsonl file") from None
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            if text.lstrip().startswith("[") and not any(line.strip() for line in lines[:number - 1]):
                raise DatasetError(f"{path}: a JSON array, but tlt reads JSON Lines here (one JSON object per "
                                   f"line); task.name=hf reads a JSON array file") from None
            raise DatasetError(f"{path}, line {number}: not valid JSON ({error.msg})") from error
        if isinstance(record, list) and not any(line.strip() for line in lines[:number - 1]):
            raise DatasetError(f"{path}: a JSON array, but tlt reads JSON Lines here (one JSON object per line); "
                               f"task.name=hf reads a JSON array file")
        if not isinstance(record, dict):
            raise DatasetError(f"{path}, line {number}: expected a JSON object")
        yield number, record


def _parquet_records(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise DatasetError("reading parquet needs pyarrow: pip install 'tlt-rl[data]'") from error
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as error:  # noqa: BLE001 - pyarrow raises several types for unreadable files
        raise DatasetError(f"{path}: not a readable parquet file ({str(error).splitlines()[0]})") from None
    yield from enumerate(records, start=1)


class DatasetTask:
    """A fixed list of examples. Training reads it in epochs (`step_examples`): every example once per epoch,
    in an order reshuffled per epoch from the run seed, as a shuffling data loader would; `sample` draws a
    seeded set without replacement (warm-up, verify)."""

    def __init__(self, examples: list[TaskExample]):
        self.examples = examples
        self._orders: dict[tuple[int, int], list[int]] = {}

    def sample(self, count: int, seed: int) -> list[TaskExample]:
        rng = random.Random(seed)
        return [self.examples[i] for i in rng.sample(range(len(self.examples)), min(count, len(self.examples)))]

    def step_examples(self, count: int, step: int, seed: int) -> list[TaskExample]:
        """Step `step`'s (0-based) `count` examples: positions [step * count, (step + 1) * count) of the stream of
        epochs. A function of (step, seed) alone, so a resumed run reads on where it stopped."""
        stream = range(step * count, (step + 1) * count)
        return [self.examples[self._order(position // len(self.examples), seed)[position % len(self.examples)]]
                for position in stream]

    def _order(self, epoch: int, seed: int) -> list[int]:
        key = (epoch, seed)
        if key not in self._orders:
            order = list(range(len(self.examples)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {key: order}  # steps read epochs in turn: one order kept
        return self._orders[key]
