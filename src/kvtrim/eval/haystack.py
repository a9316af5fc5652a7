"""Haystacks: the text the needles hide in.

* `NOISE`: RULER's repeated five-sentence filler (its "repeat"/"noise" haystack, also the passkey filler).
* `prose_sentences(n, seed)`: a SYNTHETIC prose-like haystack, standing in for the Paul Graham essays
  RULER downloads. Sentences are drawn from a few dozen templates filled with the word lists of
  `kvtrim.eval.words`; they read like (odd) English, contain no digits, no hyphens and never the
  phrase "special magic", so no needle can occur by accident. Deterministic under `seed`.

The prose is not real English text: retrieval from it is probably easier than from essays (the
needles stand out more), and scores are not comparable with published RULER numbers.
"""

from __future__ import annotations

import random
import re

from kvtrim.eval.words import ADJECTIVES, ADVERBS, NOUNS, PREPOSITIONS, VERBS, third_person

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# {a} adjective, {n} noun, {v} verb (third person), {b} base verb, {d} adverb, {p} preposition
_TEMPLATES = [
    "The {a} {n} {v} the {n} {p} the {n}.",
    "Every {n} in the {n} {v} a {a} {n}.",
    "When the {n} {v}, the {n} {v} {d}.",
    "Some people say that a {a} {n} never {v} without a {n}.",
    "It was a {a} morning, and the {n} {v} again.",
    "{D}, the {n} {v} the {a} {n}.",
    "Nobody knew why the {n} would {b} the {n} {p} the {a} {n}.",
    "I once saw a {n} {b} a {n}, and it seemed {a}.",
    "The {n} and the {n} {v} {d} {p} the {a} {n}.",
    "If you {b} a {n}, the {n} {v} {d}.",
    "My {n} {v} that the {n} is {a}.",
    "There is a {a} {n} {p} the {n}, and it {v} {d}.",
    "We had to {b} the {n} before the {n} could {b}.",
    "A {a} {n} is worth more than a {a} {n}.",
    "Later, the {n} {v} the {n} and {v} {d}.",
    "Most {a} things {b} {p} a {n} sooner or later.",
    "The old {n} {v} the {a} {n} {d}.",
    "She told the {n} to {b} the {n} {d}.",
    "In the {n}, a {a} {n} {v} {p} the {n}.",
    "Why would a {n} {b} when the {n} is so {a}?",
    "He kept a {a} {n} in his {n} for years.",
    "The {n} grew {a}, so the {n} {v} the {n}.",
    "Nothing is as {a} as a {n} that {v} {d}.",
    "They walked {p} the {n} until the {n} {v}.",
]


def _fill(template: str, rng: random.Random) -> str:
    out = []
    i = 0
    while i < len(template):
        if template[i] == "{":
            j = template.index("}", i)
            slot = template[i + 1 : j]
            word = {
                "a": lambda: rng.choice(ADJECTIVES),
                "n": lambda: rng.choice(NOUNS),
                "v": lambda: third_person(rng.choice(VERBS)),
                "b": lambda: rng.choice(VERBS),
                "d": lambda: rng.choice(ADVERBS),
                "D": lambda: rng.choice(ADVERBS).capitalize(),
                "p": lambda: rng.choice(PREPOSITIONS),
            }[slot]()
            out.append(word)
            i = j + 1
        else:
            out.append(template[i])
            i += 1
    return _ARTICLE.sub(lambda m: m.group(1) + "n " + m.group(2), "".join(out))


_ARTICLE = re.compile(r"\b([Aa]) ([aeiou])")


def prose_sentence(rng: random.Random) -> str:
    """One synthetic prose sentence."""
    return _fill(rng.choice(_TEMPLATES), rng)


def prose_sentences(n: int, seed: int = 0) -> list[str]:
    """The first `n` sentences of the synthetic prose stream for `seed` (a prefix of a longer call)."""
    rng = random.Random(f"kvtrim-prose-{seed}")
    return [prose_sentence(rng) for _ in range(n)]
