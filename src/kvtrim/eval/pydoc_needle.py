"""`pydoc_needle`: a fact planted in real prose, the Python language reference that ships with Python.

The haystack is the text of `pydoc_data.topics` (the reference's topics as `help()` shows them: prose,
grammar rules and code, written by people, not generated), read line by line from a topic chosen by
the seed, topic after topic in alphabetical order (wrapping around), a blank line between topics. One
fact is planted between two paragraphs, at a depth drawn from the sample's seed in [0.1, 0.9]:

    The access code of the <adjective>-<noun> archive is <7 digits>.

and asked after the context (query-agnostic: nothing before the question says which fact will be
asked). The answer is the number (`string_match_all`). The number is drawn again until it appears
nowhere in the haystack, and the phrase "access code" appears nowhere in the reference, so the
answer is unique by construction.

Sizing: `units` = lines of the reference; `kvtrim.eval.fit` finds the most lines that fit the target
length in the model's own tokens (prompt + `PYDOC_MAX_NEW_TOKENS`). Samples are deterministic for a
given seed *and Python version* (each Python release ships its own reference text; `meta` records the
version and a digest of the topics).
"""

from __future__ import annotations

import hashlib
import platform
import random
from functools import lru_cache

from kvtrim.eval.sample import Sample
from kvtrim.eval.words import ADJECTIVES, NOUNS
from kvtrim.methods.base import KvtrimError

TASK = "pydoc_needle"
PYDOC_MAX_NEW_TOKENS = 16  # a 7-digit number in one short sentence
DEPTH_RANGE = (0.1, 0.9)  # away from the sinks and the recent window, where every method keeps entries
INTRO = ("Below is an excerpt from the Python language reference. Read it carefully: I will ask you a question "
         "about it afterwards.\n\n")
NEEDLE = "The access code of the {key} archive is {value}."
QUESTION = "What is the access code of the {key} archive? Answer with the number only."
ANSWER_PREFIX = "The access code of the {key} archive is"


@lru_cache(maxsize=1)
def reference_lines() -> tuple[tuple[str, ...], str]:
    """`(lines, digest)`: every line of `pydoc_data.topics`, topics in alphabetical order, a blank line
    after each topic; the digest (sha256, 12 hex digits) identifies the text."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise KvtrimError("task pydoc_needle needs the standard library's pydoc_data, which this Python "
                          "installation lacks") from None
    lines: list[str] = []
    for name in sorted(topics):
        lines += [line.rstrip() for line in topics[name].strip("\n").split("\n")] + [""]
    text = "\n".join(lines)
    return tuple(lines), hashlib.sha256(text.encode()).hexdigest()[:12]


def _haystack(start: int, units: int) -> list[str]:
    lines, _ = reference_lines()
    return [lines[(start + i) % len(lines)] for i in range(units)]


def _paragraph_break(lines: list[str], target: int) -> int:
    """The index of the blank line nearest to `target` (ties: the earlier), or `target` when none."""
    blanks = [i for i, line in enumerate(lines) if not line.strip()]
    return min(blanks, key=lambda i: (abs(i - target), i)) if blanks else target


def pydoc_needle_sample(sample_id: str, rng: random.Random, units: int, length: int = 0) -> Sample:
    """One sample: `units` lines of the reference with one fact planted; deterministic in `rng`'s seed."""
    if units < 1:
        raise KvtrimError(f"pydoc_needle needs at least one line of haystack, got {units}")
    lines, digest = reference_lines()
    start = rng.randrange(len(lines))
    key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    depth_target = rng.uniform(*DEPTH_RANGE)
    haystack = _haystack(start, units)
    text = "\n".join(haystack)
    if "access code" in text.lower():  # another Python's reference might say it: the answer would not be unique
        raise KvtrimError("pydoc_needle: this Python's language reference mentions an 'access code'")
    value = str(rng.randrange(10**6, 10**7))
    while value in text:  # unique by construction (drawn again from the same rng: still deterministic)
        value = str(rng.randrange(10**6, 10**7))
    at = _paragraph_break(haystack, round(depth_target * len(haystack)))
    needle = NEEDLE.format(key=key, value=value)
    planted = haystack[: at + 1] + [needle, ""] + haystack[at + 1:]
    body = "\n".join(planted)
    context = INTRO + body + "\n"
    depth = (len(INTRO) + body.index(needle)) / len(context)
    return Sample(
        id=sample_id, task=TASK, context=context, question=QUESTION.format(key=key), answers=[value],
        max_new_tokens=PYDOC_MAX_NEW_TOKENS, answer_prefix=ANSWER_PREFIX.format(key=key), length=length,
        depth=round(depth, 4),
        meta={"key": key, "start_line": start, "lines": units, "python": platform.python_version(),
              "pydoc_topics_sha256": digest},
    )


__all__ = ["PYDOC_MAX_NEW_TOKENS", "TASK", "pydoc_needle_sample", "reference_lines"]
