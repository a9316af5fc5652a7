"""`pydoc_needle`: real prose from `pydoc_data` with one planted fact; the answer correct by construction,
samples deterministic per seed, sized in the model's tokens. Checked against the reference text itself."""

from __future__ import annotations

import random
import re

import pytest

from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.pydoc_needle import INTRO, pydoc_needle_sample, reference_lines
from kvtrim.eval.tasks import generate_samples


@pytest.fixture(scope="module")
def fmt():
    """The real SmolLM2 tokenizer (local, no download) with its chat template."""
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return PromptFormat(AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m")))


def planted(sample):
    """`(haystack lines, needle line)`: the context without its intro, split around the one fact."""
    assert sample.context.startswith(INTRO) and sample.context.endswith("\n")
    body = sample.context[len(INTRO):-1].split("\n")
    needles = [i for i, line in enumerate(body) if line.startswith("The access code of the ")]
    assert len(needles) == 1
    i = needles[0]
    assert body[i + 1] == ""  # the fact is a paragraph of its own
    return body[:i] + body[i + 2:], body[i]


def test_haystack_is_the_reference_text_in_order():
    """Every line around the fact is the reference's next line, from a start drawn by the seed: real
    text, nothing generated."""
    from pydoc_data.topics import topics

    lines, digest = reference_lines()
    assert len(digest) == 12 and lines[0] == topics[sorted(topics)[0]].strip("\n").split("\n")[0].rstrip()
    for seed in range(6):
        s = pydoc_needle_sample(f"x/{seed}", random.Random(seed), 150)
        haystack, _ = planted(s)
        start = s.meta["start_line"]
        assert haystack == [lines[(start + k) % len(lines)] for k in range(150)]


def test_answer_is_correct_by_construction():
    for seed in range(20):
        s = pydoc_needle_sample(f"y/{seed}", random.Random(seed), 120)
        haystack, needle = planted(s)
        key, value = re.fullmatch(r"The access code of the (\S+) archive is (\d{7})\.", needle).groups()
        assert s.answers == [value] and key == s.meta["key"]
        assert s.question == f"What is the access code of the {key} archive? Answer with the number only."
        assert s.answer_prefix == f"The access code of the {key} archive is"
        assert s.context.count(value) == 1 and s.context.count("access code") == 1  # unique
        assert value not in "\n".join(haystack)
        assert 0.0 < s.depth < 1.0 and s.context.index(needle) / len(s.context) == pytest.approx(s.depth, abs=1e-3)


def test_depth_is_drawn_per_sample_and_lands_on_a_paragraph_break():
    depths = []
    for seed in range(30):
        s = pydoc_needle_sample(f"z/{seed}", random.Random(seed), 400)
        body = s.context[len(INTRO):].split("\n")
        i = next(k for k, line in enumerate(body) if line.startswith("The access code"))
        assert body[i - 1] == ""  # after a blank line: between paragraphs
        depths.append(s.depth)
    assert 0.05 < min(depths) and max(depths) < 0.95 and max(depths) - min(depths) > 0.4


def test_samples_are_deterministic_per_seed_and_sized_in_model_tokens(fmt):
    a = generate_samples("pydoc_needle", fmt, 1800, 3, seed=0)
    b = generate_samples("pydoc_needle", fmt, 1800, 3, seed=0)
    c = generate_samples("pydoc_needle", fmt, 1800, 3, seed=1)
    assert [s.to_json() for s in a] == [s.to_json() for s in b]
    assert [s.context for s in a] != [s.context for s in c]
    assert len({s.context for s in a}) == 3 and len({s.answers[0] for s in a}) == 3
    for s in a:
        total = fmt.count(s) + s.max_new_tokens
        assert 0.97 * 1800 <= total <= 1800 and s.meta["units"] == s.meta["lines"]
