"""`kvtrim eval --dataset`: every on-disk format reads to the same samples, rows sharing a context are
compressed once, and LongBench's metrics give hand-computed values."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model

import kvtrim.eval.runner as runner_module
from kvtrim.attention import enable
from kvtrim.eval.dataset_files import parse_columns, read_dataset, rows_to_samples
from kvtrim.eval.runner import Runner, RunSettings, plan
from kvtrim.eval.scoring import (classification, code_sim, count, longbench_score, qa_f1, retrieval, rouge_l,
                                 score_prediction)
from kvtrim.methods.base import KvtrimError
from kvtrim.specs import parse_method_specs

SHARED = "Alice keeps the red key in the blue box. Bob keeps the green key under the mat. " * 6
ROWS = [
    {"context": SHARED, "question": "Where is the red key?", "answer_prefix": "Answer:", "answer": ["blue box"],
     "max_new_tokens": 8, "task": "niah_single_1", "all_classes": None},
    {"context": SHARED, "question": "Where is the green key?", "answer_prefix": "Answer:", "answer": ["mat"],
     "max_new_tokens": 8, "task": "niah_single_1", "all_classes": None},
    {"context": SHARED, "question": "Who keeps the green key?", "answer_prefix": "", "answer": ["Bob", "bob"],
     "max_new_tokens": 8, "task": "qa_1", "all_classes": None},
    {"context": "Question types: what is a location? " * 8, "question": "Type of: Where is Paris?",
     "answer_prefix": "Type:", "answer": ["Location"], "max_new_tokens": 6, "task": "trec",
     "all_classes": ["Location", "Entity", "Human being", "Human"]},
]


def _write_all(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    paths = {}
    paths["jsonl"] = tmp_path / "bench.jsonl"
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    table = pa.Table.from_pylist(ROWS)
    paths["parquet"] = tmp_path / "bench.parquet"
    pq.write_table(table, paths["parquet"])
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    pq.write_table(table, folder / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), folder / "train-00000-of-00001.parquet")
    paths["hub"] = tmp_path / "hub"
    paths["saved"] = tmp_path / "saved"
    Dataset.from_list(ROWS).save_to_disk(str(paths["saved"]))
    paths["dict"] = tmp_path / "dict"
    DatasetDict({"test": Dataset.from_list(ROWS), "train": Dataset.from_list(ROWS[:2])}).save_to_disk(str(paths["dict"]))
    return paths


def _comparable(samples):
    return [(s.id.split("/", 1)[1], s.task, s.context, s.question, s.answer_prefix, s.answers, s.max_new_tokens,
             s.metric, s.meta.get("all_classes"), s.meta.get("first_line")) for s in samples]


def test_every_format_reads_to_the_same_samples(tmp_path):
    paths = _write_all(tmp_path)
    reference = read_dataset(str(paths["jsonl"]))
    assert [s.metric for s in reference] == ["string_match_all", "string_match_all", "string_match_part",
                                             "classification"]
    assert reference[3].meta["first_line"] and reference[3].meta["all_classes"][2] == "Human being"
    assert reference[2].answers == ["Bob", "bob"] and reference[0].answer_prefix == "Answer:"
    for key, split in [("parquet", None), ("hub", "test"), ("saved", None), ("dict", "test")]:
        assert _comparable(read_dataset(str(paths[key]), split)) == _comparable(reference), key
    assert len(read_dataset(str(paths["hub"]), "train")) == 1
    assert len(read_dataset(str(paths["dict"]), "train")) == 2
    per_task = read_dataset(str(paths["jsonl"]), per_task=1)
    assert [s.task for s in per_task] == ["niah_single_1", "qa_1", "trec"]


def test_column_mapping(tmp_path):
    renamed = [{"input": r["context"], "q": r["question"], "answers": r["answer"], "answer_prefix": r["answer_prefix"],
                "max_new_tokens": r["max_new_tokens"], "task": r["task"], "all_classes": r["all_classes"]}
               for r in ROWS]
    path = tmp_path / "renamed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in renamed))
    mapped = read_dataset(str(path), columns=parse_columns("context=input,question=q"))
    assert _comparable(mapped) == _comparable(rows_to_samples(ROWS, "x"))


@pytest.mark.parametrize("call, message", [
    (lambda p: read_dataset(str(p["dict"])), "choose one with --split"),
    (lambda p: read_dataset(str(p["dict"]), "dev"), "has no split 'dev'"),
    (lambda p: read_dataset(str(p["jsonl"]), "test"), "--split is for a folder"),
    (lambda p: read_dataset(str(p["jsonl"]), columns={"context": "nope"}), "has no column 'nope'"),
    (lambda p: parse_columns("context"), "expected FIELD=COLUMN"),
    (lambda p: parse_columns("contexts=input"), "unknown field 'contexts'"),
    (lambda p: rows_to_samples([{**ROWS[0], "task": "dureader"}], "x"), "Chinese metrics"),
    (lambda p: rows_to_samples([{k: v for k, v in ROWS[0].items() if k != "max_new_tokens"}], "x"), "--max-new-tokens"),
    (lambda p: rows_to_samples([{k: v for k, v in ROWS[3].items() if k != "all_classes"}], "x"), "all_classes"),
    (lambda p: read_dataset(str(p["jsonl"]) + ".missing"), "does not exist"),
])
def test_bad_datasets_are_one_line_errors(tmp_path, call, message):
    paths = _write_all(tmp_path)
    with pytest.raises(KvtrimError, match=message.replace("(", r"\(").replace("[", r"\[")) as err:
        call(paths)
    assert "\n" not in str(err.value)


def test_longbench_metrics_by_hand():
    # qa_f1: "cat sat on mat" vs "cat on mat" (articles and case gone): 3 shared, P = 3/4, R = 1
    assert qa_f1("The cat sat on the mat.", "a cat on a mat") == pytest.approx(2 * 0.75 / 1.75)
    assert qa_f1("nothing", "a cat") == 0.0
    # rouge_l: LCS "the cat on the mat" = 5 of 6 / 5 words: F = 2 (5/6)(1) / (5/6 + 1) = 10/11
    assert rouge_l("The cat sat on the mat", "the cat on the mat") == pytest.approx(10 / 11)
    assert rouge_l("a b c d", "d c b a") == pytest.approx(2 * 0.25 * 0.25 / 0.5)  # LCS 1 of 4 and 4
    classes = ["Location", "Entity", "Human being", "Human"]
    assert classification("Human being", "Human being", classes) == 1.0  # "Human" is part of the answer: dropped
    assert classification("Location or Human being", "Human being", classes) == 0.5
    assert classification("Entity", "Human being", classes) == 0.0
    assert retrieval("Paragraph 3, or maybe paragraph 5", "Paragraph 3") == 0.5
    assert retrieval("none", "Paragraph 3") == 0.0
    assert count("There are 12 unique paragraphs, not 13", "12") == 0.5
    # code_sim: the first line without ` # //, "    x = foo(1)" (14 chars) vs "x = foo(1)" (10): 2 * 10 / 24
    assert code_sim("```python\n    x = foo(1)\n# done", "x = foo(1)") == pytest.approx(20 / 24)
    # the best reference counts; first-line tasks score the first line only
    assert longbench_score("qa_f1", "  Paris", ["London", "Paris"]) == 1.0
    assert longbench_score("classification", "Location\nEntity", ["Location"], classes, first_line=True) == 1.0
    assert longbench_score("classification", "Location\nEntity", ["Location"], classes) == 0.5
    s = score_prediction("qa_f1", "The cat sat on the mat.", ["a cat on a mat"])
    assert s["score"] == s["qa_f1"] == pytest.approx(6 / 7) and "string_match_all" in s


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))


@pytest.fixture(scope="module")
def model():
    return enable(tiny_model("llama", vocab=49152, layers=2))


TIMING = ("seconds", "prefill_reused", "context_group", "key")


def test_a_shared_context_is_compressed_once_and_answers_as_alone(model, tok, tmp_path, monkeypatch):
    samples = rows_to_samples(ROWS, "bench")
    specs = parse_method_specs(["full", "streaming", "snapkv:window=4", "keydiff:block_size=16"])
    jobs = plan(samples, specs, [0.5, 0.75])
    calls = []
    real = runner_module.compress

    def counting(model, ids, method, *args, **kwargs):
        calls.append(type(method).__name__)
        return real(model, ids, method, *args, **kwargs)

    monkeypatch.setattr(runner_module, "compress", counting)
    settings = RunSettings(model="tiny", max_new_tokens=4)
    grouped = Runner(model, tok, settings, str(tmp_path / "grouped"), progress=False).run(jobs)
    # one shared full prefill per context (2 contexts), plus KeyDiff's block-wise prefill per ratio
    assert sorted(calls) == sorted(["FullCache"] * 2 + ["KeyDiff"] * 4)
    assert {r["context_group"] for r in grouped if r["sample_id"] != samples[3].id} == {3}
    calls.clear()
    alone_runner = Runner(model, tok, settings, str(tmp_path / "alone"), progress=False)
    alone = [row for s in samples for row in alone_runner.run_unit([j for j in jobs if j.sample.id == s.id])]
    assert len(calls) == 4 * 3  # sample by sample: 1 shared + 2 KeyDiff each
    strip = lambda rows: {r["key"]: {k: v for k, v in r.items() if k not in TIMING} for r in rows}  # noqa: E731
    assert strip(grouped) == strip(alone) and len(grouped) == len(jobs)


def test_eval_cli_reads_a_dataset(tmp_path, monkeypatch, model, tok, capsys):
    import kvtrim.models
    from kvtrim.cli import main

    monkeypatch.setattr(kvtrim.models, "load_model", lambda *a, **k: (model, tok))
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "o"
    assert main(["eval", "--dataset", str(path), "--methods", "full,streaming", "--compression-ratios", "0.5",
                 "--max-new-tokens", "3", "--no-plots", "--quiet", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {r["metric"] for r in rows} == {"string_match_all", "string_match_part", "classification"}
    assert main(["eval", "--split", "test", "--tasks", "vt", "--out", str(tmp_path / "p")]) == 2
    assert "--split is for --dataset" in capsys.readouterr().err
