"""Task generators: deterministic under a seed, sized to the target length, answers present."""

from __future__ import annotations

import json
import re

import pytest

from kvtrim.eval.haystack import prose_sentences
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.ruler import NIAH_TASKS, RULER_TASKS, cwe_vocabulary, zeta
from kvtrim.eval.sample import read_task_file, write_task_file
from kvtrim.eval.tasks import DEPTH_TASKS, REAL_TEXT_TASKS, REASONING_TASKS, TASKS, generate_samples, max_new_tokens
from kvtrim.methods.base import KvtrimError


@pytest.fixture(scope="module")
def fmt():
    """The real SmolLM2 tokenizer (local, no download) with its chat template."""
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return PromptFormat(AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m")))


def test_registry_has_rulers_eleven_tasks_and_their_lengths():
    assert RULER_TASKS == ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                           "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]
    assert {t: max_new_tokens(t) for t in ("niah_single_1", "niah_multiquery", "vt", "cwe", "fwe")} == {
        "niah_single_1": 128, "niah_multiquery": 128, "vt": 30, "cwe": 120, "fwe": 50}
    assert set(TASKS) == set(RULER_TASKS) | set(DEPTH_TASKS) | set(REAL_TEXT_TASKS) | set(REASONING_TASKS)


@pytest.mark.parametrize("task", RULER_TASKS + DEPTH_TASKS + REAL_TEXT_TASKS)  # reasoning: test_eval_reasoning.py
def test_generator_is_deterministic_sized_and_contains_its_answers(fmt, task):
    length = 1536
    a = generate_samples(task, fmt, length, 2, seed=3, depths=(0.3,))
    b = generate_samples(task, fmt, length, 2, seed=3, depths=(0.3,))
    assert [s.to_json() for s in a] == [s.to_json() for s in b]
    c = generate_samples(task, fmt, length, 1, seed=4, depths=(0.3,))
    assert c[0].context != a[0].context or c[0].answers != a[0].answers  # the seed matters
    assert a[0].id != a[1].id
    for s in a:
        total = fmt.count(s) + s.max_new_tokens
        assert total <= length, (task, total)
        assert total >= 0.95 * length, (task, total)  # within a few percent (RULER's whole-piece granularity)
        assert s.answers and all(ans in s.context for ans in s.answers), task
        assert s.question and s.task == task and s.length == length


def test_answers_are_unique_needles(fmt):
    """Multi-key / needle haystacks: the asked key appears once, with the right value right after it."""
    for task in ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"):
        s = generate_samples(task, fmt, 2048, 1, seed=1)[0]
        key = re.search(r"for (\S+) mentioned", s.question).group(1)
        assert s.context.count(f"for {key} is:") == 1
        assert f"for {key} is: {s.answers[0]}." in s.context
    mv = generate_samples("niah_multivalue", fmt, 2048, 1, seed=1)[0]
    assert len(mv.answers) == 4 and len(set(mv.answers)) == 4
    mq = generate_samples("niah_multiquery", fmt, 2048, 1, seed=1)[0]
    assert len(mq.answers) == 4 and mq.question.count(", ") >= 2


def test_depth_tasks_put_the_needle_at_the_asked_depth(fmt):
    for depth in (0.0, 0.5, 1.0):
        s = generate_samples("niah", fmt, 2048, 1, seed=0, depths=(depth,))[0]
        where = s.context.index(s.answers[0]) / len(s.context)
        assert abs(where - depth) < 0.1, (depth, where)
        assert s.depth == depth
        p = generate_samples("passkey", fmt, 1024, 1, seed=0, depths=(depth,))[0]
        assert abs(p.context.index(p.answers[0]) / len(p.context) - depth) < 0.1
    key64 = generate_samples("passkey_64", fmt, 1024, 1, depths=(0.5,))[0].answers[0]
    assert len(key64) == 64 and key64.isdigit()


def test_cwe_and_fwe_answers_are_the_most_frequent_words(fmt):
    s = generate_samples("cwe", fmt, 2048, 1, seed=2)[0]
    main = s.context.split("\n")[-2]  # the numbered list of the real question (after the one-shot example)
    words = re.findall(r"\d+\. (\S+)", main)
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=counts.get, reverse=True)[:10]
    assert set(top) == set(s.answers) and min(counts[w] for w in s.answers) > max(
        c for w, c in counts.items() if w not in s.answers)
    f = generate_samples("fwe", fmt, 2048, 1, seed=2)[0]
    coded = f.context.split(". ", 1)[1].split()
    freq = {w: coded.count(w) for w in set(coded) if w != "..."}
    assert sorted(freq, key=freq.get, reverse=True)[:3] == f.answers


def test_vt_chain_resolves_to_the_answers(fmt):
    s = generate_samples("vt", fmt, 2048, 1, seed=5)[0]
    value = re.search(r"value (\d+) in the text", s.question).group(1)
    main = s.context.split("\n\n", 2)[-1]  # after the one-shot example
    assigned = dict(re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", main))
    resolved = set()
    for name in assigned:
        v = assigned[name]
        while v.startswith("VAR "):
            v = assigned[v[4:]]
        if v == value:
            resolved.add(name)
    assert resolved == set(s.answers) and len(s.answers) == 5


def test_haystack_is_deterministic_and_needle_free():
    a = prose_sentences(300, seed=1)
    assert a[:100] == prose_sentences(100, seed=1) and a != prose_sentences(300, seed=2)
    text = " ".join(a)
    assert not re.search(r"\d|-|special magic", text)
    assert len(cwe_vocabulary(5000)) == len(set(cwe_vocabulary(5000))) == 5000
    assert abs(zeta(2.0) - 3.141592653589793**2 / 6) < 1e-6


def test_samples_roundtrip_through_a_task_file(fmt, tmp_path):
    samples = generate_samples("niah_single_1", fmt, 1024, 2) + generate_samples("passkey", fmt, 1024, 1, depths=(0.5,))
    path = tmp_path / "tasks.jsonl"
    write_task_file(str(path), samples)
    assert [s.to_json() for s in read_task_file(str(path))] == [s.to_json() for s in samples]


def test_task_file_accepts_ruler_style_rows_and_rejects_bad_ones(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"context": "c", "question": "q?", "outputs": ["x"], "max_new_tokens": 8}) + "\n"
                    + json.dumps({"context": "c", "question": "q?", "answer": "y", "max_new_tokens": 8, "task": "t"}) + "\n")
    a, b = read_task_file(str(path))
    assert (a.answers, a.task, a.id) == (["x"], "custom", "custom-0") and (b.answers, b.id) == (["y"], "t-1")
    for bad, msg in [({"question": "q", "answers": ["a"], "max_new_tokens": 1}, "context"),
                     ({"context": "c", "question": "q", "answers": [], "max_new_tokens": 1}, "answers"),
                     ({"context": "c", "question": "q", "answers": ["a"], "max_new_tokens": 0}, "max_new_tokens"),
                     ({"context": "c", "question": "q", "answers": ["a"], "max_new_tokens": 1, "metric": "bleu"}, "metric")]:
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(KvtrimError, match=msg):
            read_task_file(str(path))
    path.write_text("{not json\n")
    with pytest.raises(KvtrimError, match="invalid JSON"):
        read_task_file(str(path))
    with pytest.raises(KvtrimError, match="cannot read"):
        read_task_file(str(tmp_path / "missing.jsonl"))


def test_too_short_length_is_a_clear_error(fmt):
    with pytest.raises(KvtrimError, match="vt at length 300"):
        generate_samples("vt", fmt, 300, 1)


def test_niah_tasks_follow_ruler_configs():
    assert NIAH_TASKS["niah_single_1"].haystack == "noise"
    assert NIAH_TASKS["niah_multikey_3"].key_type == NIAH_TASKS["niah_multikey_3"].value_type == "uuids"
    assert NIAH_TASKS["niah_multikey_1"].num_keys == 4 and NIAH_TASKS["niah_multivalue"].num_values == 4
