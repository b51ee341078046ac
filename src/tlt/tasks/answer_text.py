"""Answer text as people write it around a number: thousands separators and unit words.

Shared by the datasets' gold answers (`loaders.normalize_answer`) and the rewards' unboxed answers
(`rewards.extract_answer`), so a gold and a response written alike are read alike.
"""

from __future__ import annotations

import re

THOUSANDS = re.compile(r"^[-+]?\$?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")  # 1,234 (not 4,2 or 12, 13: those are two numbers)
# a number, then one lowercase word ("18 dollars", "5 cm"): a unit, no part of its value. One word only, and
# lowercase: "2 and a half", "3 sin x", "2 Samuel", "3 Doors Down" are kept whole (a review: a blocklist of words
# alone let "2 thirds" and "5 below zero" read 2 and 5). ("$5$ dollars": the number's closing math delimiter.)
NUMBER_AND_WORD = re.compile(r"([-+]?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\$?[ \t]+([a-z]{2,})")
# single words that change a number's value or read as maths: "3 million", "2 thirds", "5 negative", "2 pi"
VALUE_WORDS = {"hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion", "billions",
               "trillion", "trillions", "lakh", "lakhs", "crore", "crores", "dozen", "dozens", "score", "scores",
               "gross", "tens", "pair", "pairs", "half", "halves", "third", "thirds", "quarter", "quarters", "fifth",
               "fifths", "sixth", "sixths", "seventh", "sevenths", "eighth", "eighths", "ninth", "ninths", "tenth",
               "tenths", "hundredth", "hundredths", "thousandth", "thousandths", "millionth", "millionths",
               "percent", "pi", "squared", "cubed", "factorial", "sqrt", "root", "roots", "ln", "log", "sin", "cos",
               "tan", "choose", "negative", "positive", "less", "more", "fewer", "below", "above", "over", "under",
               "times", "plus", "minus", "degrees", "radians", "th", "st", "nd", "rd"}


def without_thousands_separators(text: str) -> str:
    """1,234 -> 1234; anything else unchanged ("2,3" is two numbers, not 23: found by a trial)."""
    return text.replace(",", "") if THOUSANDS.match(text.strip()) else text


def number_without_words(text: str) -> str:
    """The number of "18 dollars" (a unit word after it); the text unchanged otherwise: several words, a
    capitalized one, or one that changes the value or reads as maths (VALUE_WORDS)."""
    match = NUMBER_AND_WORD.fullmatch(text.strip())
    if match is None or match.group(2) in VALUE_WORDS:
        return text
    return match.group(1)
