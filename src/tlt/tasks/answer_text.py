"""Answer text as people write it around a number: thousands separators and unit words.

Shared by the datasets' gold answers (`loaders.normalize_answer`) and the rewards' unboxed answers
(`rewards.extract_answer`), so a gold and a response written alike are read alike.
"""

from __future__ import annotations

import re

THOUSANDS = re.compile(r"^[-+]?\$?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")  # 1,234 (not 4,2 or 12, 13: those are two numbers)
# a number, then words only ("18 dollars", "5 cm", "42 because it is even"): the words are no part of its value
# ("$5$ dollars": the number's closing math delimiter before the words)
NUMBER_AND_WORDS = re.compile(r"([-+]?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\$?\s+([A-Za-z]{2,}(?:[ \t]+[A-Za-z]+)*)")
# words that change a number's value or read as maths: "3 million", "2 pi", "3 i" are not 3 (found by a trial:
# a GSM8K gold of "#### 3 million" became 3)
VALUE_WORDS = {"hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion", "billions",
               "trillion", "trillions", "dozen", "dozens", "pi", "percent", "squared", "cubed", "times", "plus",
               "minus", "over", "divided", "factorial", "root"}


def without_thousands_separators(text: str) -> str:
    """1,234 -> 1234; anything else unchanged ("2,3" is two numbers, not 23: found by a trial)."""
    return text.replace(",", "") if THOUSANDS.match(text.strip()) else text


def number_without_words(text: str) -> str:
    """The number of "18 dollars" (units, or the rest of a sentence after it); the text unchanged when words
    follow that change the value or read as maths (VALUE_WORDS), or when anything but words follows."""
    match = NUMBER_AND_WORDS.fullmatch(text.strip())
    if match is None or VALUE_WORDS.intersection(match.group(2).lower().split()):
        return text
    return match.group(1)
