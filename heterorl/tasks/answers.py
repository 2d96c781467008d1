"""Pull a final answer out of a completion and compare it with a reference.

Two answer styles are supported: GSM8K's ``#### <answer>`` and LaTeX's
``\\boxed{<answer>}``. Comparison is numeric when both sides read as numbers.
"""

from __future__ import annotations

import re
from decimal import Decimal

_HASH = "####"
_BOXED = "\\boxed{"
_NUMBER_AFTER_HASH = re.compile(r"[ \t]*(-?\d+(?:,\d+)*(?:\.\d+)?)")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def extract_hash_answer(text: str) -> str | None:
    """The answer after the last ``####`` in ``text``, or None if there is none.

    When a number follows the marker (optional spaces or tabs, an optional
    leading ``-``, digits with optional ``,`` separators and an optional
    decimal part) that number is returned with its commas removed
    (``"#### 1,234 apples"`` gives ``"1234"``). Otherwise the rest of the
    marker's line, stripped, is returned, or None when that is empty.
    """
    at = text.rfind(_HASH)
    if at < 0:
        return None
    rest = text[at + len(_HASH):]
    number = _NUMBER_AFTER_HASH.match(rest)
    if number:
        return number.group(1).replace(",", "")
    line = rest.split("\n", 1)[0].strip()
    return line or None


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, or None.

    Braces nest: ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. A last
    ``\\boxed{`` whose braces never close gives None.
    """
    at = text.rfind(_BOXED)
    if at < 0:
        return None
    start = at + len(_BOXED)
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None


def _as_number(text: str) -> Decimal | None:
    cleaned = text.replace(",", "").strip().strip("$").strip()
    if not _PLAIN_NUMBER.fullmatch(cleaned):
        return None
    return Decimal(cleaned)


def answers_match(predicted: str, reference: str) -> bool:
    """Whether ``predicted`` is the same answer as ``reference``.

    If both read as plain decimal numbers once commas and surrounding ``$``
    and spaces are removed, they are compared as numbers (``"12.0"`` matches
    ``"12"``, ``"$1,000"`` matches ``"1000"``); otherwise the two stripped
    strings must be equal.
    """
    left, right = _as_number(predicted), _as_number(reference)
    if left is not None and right is not None:
        return left == right
    return predicted.strip() == reference.strip()
