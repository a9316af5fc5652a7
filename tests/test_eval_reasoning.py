"""Reasoning tasks: generators correct by construction (checked against a second computation from the prompt
text), deterministic, sized in the model's tokens; answer extraction and the trace / boxed / final_number
scores; the hand-written reasoning task file."""

from __future__ import annotations

import json
import pathlib
import random
import re

import pytest

from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.reasoning import (
    LIST_WORDS_PER_STEP,
    MAX_VALUE,
    REASONING_TASKS,
    make_arith,
    make_copy_program,
    make_list_recall,
    make_program,
    reasoning_problem,
    reasoning_sample,
    render,
    solution,
    solve_arith,
)
from kvtrim.eval.sample import read_task_file
from kvtrim.eval.scoring import (
    answer_is_final,
    answer_matches,
    last_boxed,
    last_number,
    normalize_answer,
    score_prediction,
    step_values,
    trace_partial,
)
from kvtrim.eval.tasks import ANSWER_SLACK, TASKS, generate_samples
from kvtrim.methods.base import KvtrimError

DATA = pathlib.Path(__file__).parent / "data" / "reasoning_tasks.jsonl"


# ---- second computations, from the rendered text only ---------------------------------------------------------


def arith_from_text(context: str) -> list[int]:
    """Re-derive the running values by reading the prompt text (the solver reads the dataclass)."""
    context = context.split("Problem:\n", 1)[-1]  # after the worked example, if any
    memo_match = re.search(r"^Memo: (\d+) \+ (\d+)$", context, re.MULTILINE)
    memo = int(memo_match.group(1)) + int(memo_match.group(2)) if memo_match else None
    value = int(re.search(r"^Start value: (\d+)$", context, re.MULTILINE).group(1))
    values = []
    for number, word, operand in re.findall(r"^Step (\d+): (add|subtract) (the memo|\d+)$", context, re.MULTILINE):
        assert int(number) == len(values) + 1
        amount = memo if operand == "the memo" else int(operand)
        value = value + amount if word == "add" else value - amount
        values.append(value)
    return values


def program_by_exec(context: str) -> tuple[list[int], dict[str, int]]:
    """Run the rendered program with Python itself, recording the value each line assigns."""
    env: dict[str, int] = {}
    values = []
    program = context.split("Problem:\n", 1)[1].split("\nWhat is", 1)[0]
    for line in program.strip().splitlines():
        statement = line.split(": ", 1)[1]
        exec(statement, {}, env)  # noqa: S102 - our own generated straight-line arithmetic
        values.append(env[statement.split(" = ")[0]])
    return values, env


def chain_from_text(context: str) -> list[int]:
    """Follow the arrows of the prompt text by brute force: scan every line for the current code each hop."""
    problem = context.split("Problem:\n", 1)[1]
    lines = re.findall(r"^(\d+) -> (\d+)$", problem, re.MULTILINE)
    code = int(re.search(r"^Start code: (\d+)$", problem, re.MULTILINE).group(1))
    out = []
    while True:
        hits = [int(b) for a, b in lines if int(a) == code]
        assert len(hits) <= 1  # an unambiguous lookup
        if not hits:
            return out
        code = hits[0]
        out.append(code)
        assert len(out) <= len(lines)  # no cycle


def list_from_text(context: str) -> tuple[dict[str, int], list[str], str]:
    """The list, the lookups and the asked word, read from the prompt text after the worked example."""
    problem = context.split("Problem:\n", 1)[1]
    number = {w: int(n) for w, n in re.findall(r"^([a-z]+): (\d+)$", problem, re.MULTILINE)}
    lookups = [w for _, w in re.findall(r"^Step (\d+): ([a-z]+)$", problem, re.MULTILINE)]
    asked = re.search(r"^Asked word: ([a-z]+)$", problem, re.MULTILINE).group(1)
    return number, lookups, asked


@pytest.mark.parametrize("task", list(REASONING_TASKS))
@pytest.mark.parametrize("seed", range(25))
def test_reference_solution_matches_a_computation_from_the_prompt_text(task, seed):
    steps = 5 + 3 * seed
    sample = reasoning_sample(task, f"t/{seed}", steps)
    final, values = int(sample.answers[0]), [int(v) for v in sample.answers[1:]]
    assert len(values) == steps
    if task in ("program_trace", "var_trace"):
        exec_values, env = program_by_exec(sample.context)
        result = re.search(r"final value of (\w+)", sample.question).group(1)
        assert values == exec_values and final == env[result]
    elif task == "chain_trace":
        assert values == chain_from_text(sample.context) and final == values[-1]
        assert len(re.findall(r"^\d+ -> \d+$", sample.context.split("Problem:")[1], re.MULTILINE)) == 2 * steps
        return  # codes are 3-digit numbers, not running values
    elif task == "list_recall":
        number, lookups, asked = list_from_text(sample.context)
        assert len(number) == max(3, round(LIST_WORDS_PER_STEP * steps)) and len(set(number.values())) == len(number)
        assert values == [number[w] for w in lookups] and final == number[asked]
        assert lookups[0] == asked and asked not in lookups[1:]  # the asked fact is the answer's first line only
    else:
        assert values == arith_from_text(sample.context) and final == values[-1]
    assert all(0 <= v <= MAX_VALUE for v in values)
    assert str(final) not in sample.question  # the instruction does not give the answer away


def test_arith_recall_uses_the_memo_and_always_at_the_last_step():
    for seed in range(20):
        p = make_arith(random.Random(seed), 30, recall=True)
        assert p.ops[-1].operand is None and sum(op.operand is None for op in p.ops) >= 2
        assert 10 <= sum(p.memo) <= 30
    assert all(op.operand is not None for op in make_arith(random.Random(0), 30).ops)


def test_program_reads_variables_and_never_assigns_one_twice_in_a_row():
    p = make_program(random.Random(3), 40)
    targets = [line.target for line in p.lines]
    assert targets[:4] == ["a", "b", "c", "d"] and p.result == targets[-1]
    assert all(x != y for x, y in zip(targets[4:], targets[5:]))
    assert sum(isinstance(line.right, str) for line in p.lines) >= 5  # variable + variable lines exist
    with pytest.raises(KvtrimError, match="at least 5 lines"):
        make_program(random.Random(0), 4)


def test_var_trace_copies_variables_and_its_constants_are_all_different():
    p = make_copy_program(random.Random(5), 60)
    constants = [line.left for line in p.lines if isinstance(line.left, int)]
    copies = [line for line in p.lines if isinstance(line.left, str)]
    assert len(set(constants)) == len(constants) >= 4 and len(copies) >= 30
    assert all(line.right is None and line.left != line.target for line in copies)


@pytest.mark.parametrize("task", list(REASONING_TASKS))
def test_generators_are_deterministic_in_their_id(task):
    a, b, c = (reasoning_sample(task, sid, 12) for sid in ("x/0", "x/0", "x/1"))
    assert a.to_json() == b.to_json() and a.context != c.context
    assert reasoning_problem(task, random.Random("x/0"), 12) == reasoning_problem(task, random.Random("x/0"), 12)


@pytest.mark.parametrize("task", list(REASONING_TASKS))
def test_the_reference_answer_scores_full_marks_and_errors_cost_what_they_should(task):
    sample = reasoning_sample(task, "s/0", 10)
    reference = sample.meta["reference"]
    assert score_prediction("trace", reference, sample.answers)["score"] == 1.0
    assert trace_partial(reference, sample.answers[1:]) == 1.0
    # one wrong step value (the step's line, not the box): partial drops by 1/10, the boxed answer stands
    lines = reference.splitlines()
    k = next(i for i, line in enumerate(lines) if line.startswith("Step 6:"))
    lines[k] = re.sub(r"\d+$", lambda m: str(int(m.group()) + 1), lines[k])
    s = score_prediction("trace", "\n".join(lines), sample.answers)
    assert s["trace_partial"] == pytest.approx(0.9) and s["score"] == 1.0
    # cut after 4 steps: 4/10 right, no box, no exact credit
    cut = "\n".join(line for line in reference.splitlines() if re.match(r"(Memo|Step [1-4]):", line))
    s = score_prediction("trace", cut, sample.answers)
    assert s["trace_partial"] == pytest.approx(0.4) and s["score"] == 0.0


def test_list_recall_looks_up_every_word_and_revisits_them():
    for seed in range(20):
        p = make_list_recall(random.Random(seed), 40)
        words = [w for w, _ in p.entries]
        assert set(p.lookups) == set(words) and len(words) == 24
        assert all(a != b for a, b in zip(p.lookups, p.lookups[1:]))  # never the same word twice in a row
    with pytest.raises(KvtrimError, match="at least two steps"):
        make_list_recall(random.Random(0), 1)


def test_every_reasoning_task_is_registered():
    assert set(REASONING_TASKS) <= set(TASKS)


# ---- sizing in the model's tokens -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fmt():
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return PromptFormat(AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m")))


@pytest.mark.parametrize("task", list(REASONING_TASKS))
def test_samples_fit_the_length_and_grow_with_it(fmt, task):
    tok = fmt.tokenizer
    small, big = (generate_samples(task, fmt, length, 3, seed=1) for length in (700, 1400))
    assert [s.to_json() for s in small] == [s.to_json() for s in generate_samples(task, fmt, 700, 3, seed=1)]
    for samples, length in ((small, 700), (big, 1400)):
        for s in samples:
            reference = len(tok(s.meta["reference"], add_special_tokens=False).input_ids)
            prompt = fmt.count(s)
            assert prompt + s.max_new_tokens == length and s.length == length
            assert prompt + ANSWER_SLACK * reference <= length
            more = reasoning_sample(task, s.id, s.meta["steps"] + 1)  # one more step would not fit
            more_ref = len(tok(more.meta["reference"], add_special_tokens=False).input_ids)
            assert fmt.count(more) + ANSWER_SLACK * more_ref > length or s is not samples[0]
    assert big[0].meta["steps"] > 1.8 * small[0].meta["steps"]
    assert len({s.context for s in small}) == 3


def test_too_short_length_for_a_reasoning_task_is_a_clear_error(fmt):
    with pytest.raises(KvtrimError, match="program_trace at length 150"):
        generate_samples("program_trace", fmt, 150, 1)


# ---- answer extraction and scores ---------------------------------------------------------------------------


def test_last_boxed_takes_the_last_complete_box_with_nested_braces():
    assert last_boxed(r"so \boxed{12} no wait \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{7} and then \boxed{8") == "7"  # a box cut off by the token cap
    assert last_boxed("the answer is 7") is None
    assert last_boxed(r"\boxed{}") == ""
    assert last_boxed(r"$\boxed{ 3,000 }$.") == " 3,000 "


def test_last_number_reads_signs_thousands_and_decimals():
    assert last_number("from 3 to -12.5 then") == "-12.5"
    assert last_number("total: 1,234,567 dollars") == "1,234,567"
    assert last_number("items 3, 4, 5") == "5"
    assert last_number("no digits") is None
    assert last_number("Step 9: 45 - 3 = 42.") == "42"


def test_normalize_answer():
    assert normalize_answer(" 1,000.0 ") == normalize_answer("$1000$") == "1000"
    assert normalize_answer("-0.50") == "-0.5"
    assert normalize_answer(r"\dfrac{1}{2}") == normalize_answer(r"\frac{1}{2}") == r"\frac{1}{2}"
    assert normalize_answer(r"\text{(B)}") == "(B)"
    assert normalize_answer(r"\left( 1, 2 \right)") == "(1,2)"
    assert normalize_answer("18.") == "18"
    assert answer_matches(None, ["1"]) == 0.0 and answer_matches("0.5", [r"\frac12"]) == 0.0  # no symbolic algebra


def test_boxed_and_final_number_metrics():
    assert score_prediction("boxed", r"... so \boxed{\dfrac{3}{4}}", [r"\frac{3}{4}"])["score"] == 1.0
    assert score_prediction("boxed", "the answer is 18", ["18"])["score"] == 0.0  # MATH: no box, no credit
    s = score_prediction("final_number", "She pays 2 * 9 = 18 dollars.\n#### 18", ["18"])
    assert s["score"] == s["final_number"] == 1.0 and s["boxed"] == 0.0
    assert score_prediction("final_number", r"\boxed{17} since 18 - 1 = 17, then 3", ["17"])["score"] == 1.0
    assert score_prediction("final_number", "18 apples, minus 2 is 16", ["18"])["score"] == 0.0
    assert score_prediction("final_number", "", ["18"])["score"] == 0.0


def test_step_values_take_the_first_line_of_each_step_and_its_last_number():
    text = "Step 1: 5 + 3 = 8\n**Step 2:** 8 - 2 = 6\nStep 1: oops 9\nstep 3: c = a + 1 = 6 + 1 = 7 \\boxed{7}\nStep 4:"
    assert step_values(text) == {1: "8", 2: "6", 3: "7"}
    assert trace_partial(text, ["8", "6", "7", "9"]) == 0.75


def test_answer_is_final():
    assert answer_is_final("trace", r"Step 3: 4 + 1 = 5 \boxed{5}") and not answer_is_final("trace", "Step 3: 4 + 1 = 5")
    assert not answer_is_final("final_number", "the answer is 5")  # a later number would replace it
    assert answer_is_final("string_match_all", "") and answer_is_final("passkey", "")


# ---- the task file ----------------------------------------------------------------------------------------


def test_hand_written_reasoning_task_file_reads_and_scores():
    samples = read_task_file(str(DATA))
    assert [s.metric for s in samples] == ["final_number", "boxed", "trace"]
    assert all(s.max_new_tokens >= 512 for s in samples)
    gsm, math, trace = samples
    assert score_prediction(gsm.metric, "5 + 2 = 7 eggs, 7 * 3 = 21. The answer is 21.", gsm.answers)["score"] == 1.0
    assert score_prediction(math.metric, r"Hence $x = \boxed{\dfrac{5}{2}}$.", math.answers)["score"] == 1.0
    right = "Step 1: 40 + 7 = 47\nStep 2: 47 - 5 = 42\nStep 3: 42 + 9 = 51\n\\boxed{51}"
    assert score_prediction(trace.metric, right, trace.answers)["trace_partial"] == 1.0
    assert arith_from_text(trace.context) == [int(v) for v in trace.answers[1:]]


@pytest.mark.parametrize("row, message", [
    ({"answers": ["51"], "metric": "trace"}, "needs answers"),
    ({"answers": ["51", "47", "x"], "metric": "trace"}, "needs answers"),
    ({"answers": ["51"], "metric": "boxed", "meta": [1]}, "'meta' must be a JSON object"),
    ({"answers": ["51"], "metric": "last_word"}, "unknown metric 'last_word'"),
])
def test_bad_reasoning_rows_are_one_line_errors(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"context": "c", "question": "q", "max_new_tokens": 2048, **row}) + "\n")
    with pytest.raises(KvtrimError, match=message):
        read_task_file(str(path))


def test_solution_is_consistent_across_helpers():
    p = make_arith(random.Random(1), 9, recall=True)
    final, values, reference = solution(p)
    assert values == solve_arith(p) and final == values[-1] and reference.endswith(f"\\boxed{{{final}}}")
    context, question = render(p)
    assert f"Problem:\nMemo: {p.memo[0]} + {p.memo[1]}\nStart value: {p.start}\n" in context
    assert "in the same way" in question
