"""`StoredCounts` (the scheduler's counts, no vLLM needed): counting by the schedule (no keys) says the same
as the method run on stand-in keys, forward by forward: which forwards are due and how many entries are
discarded after each."""

import pytest

from kvtrim.specs import parse_method_spec
from kvtrim.vllm.compact import StoredCounts, forward_steps, plan_forward

COUNTED = ["keydiff:budget=48:block_size=16", "keydiff:compression_ratio=0.5", "streaming:budget=40",
           "streaming:compression_ratio=0.75", "knorm:budget=30", "knorm:compression_ratio=0.6",
           "keydiff:budget=20:block_size=1"]


def forwards(prompt: int, total: int, chunk: int) -> list[tuple[int, int]]:
    """A request's forwards as vLLM schedules them: the prompt in chunks of `chunk`, then one token each."""
    out, start = [], 0
    while start < prompt:
        out.append((start, min(prompt, start + chunk)))
        start = out[-1][1]
    return out + [(n, n + 1) for n in range(prompt, total)]


@pytest.mark.parametrize("spec", COUNTED)
@pytest.mark.parametrize("prompt,total,chunk", [(100, 260, 1000), (100, 260, 32), (30, 120, 7), (8, 60, 8)])
def test_counting_by_schedule_is_the_stand_in(spec, prompt, total, chunk):
    method = parse_method_spec(spec).build()
    counted, stand_in = StoredCounts(method), StoredCounts(method)
    assert counted.by_count
    stand_in.by_count = False  # the general path: the method on stand-in keys
    for start, end in forwards(prompt, total, chunk):
        steps = forward_steps(start, end, prompt)
        assert counted.advance(steps) == stand_in.advance(steps), (start, end)
        assert counted.discarded == stand_in.discarded, (start, end)
    # a recomputed request: its prompt and generated tokens in one forward (prompt end, then an append)
    again, again_stand_in = StoredCounts(method), StoredCounts(method)
    again_stand_in.by_count = False
    steps = forward_steps(0, total - 10, prompt)
    assert again.advance(steps) == again_stand_in.advance(steps)
    assert again.discarded == again_stand_in.discarded


@pytest.mark.parametrize("spec", ["lagkv:lag_size=16:sink_size=4", "lagkv:compression_ratio=0.5:lag_size=8",
                                  "snapkv:budget=40", "h2o:budget=40"])
def test_methods_with_their_own_rules_run_on_stand_in_keys(spec):
    assert not StoredCounts(parse_method_spec(spec).build()).by_count


def test_plan_forward_starts_a_request_afresh():
    method = parse_method_spec("streaming:budget=40").build()
    counts = {}
    due = plan_forward(counts, "r", method, 0, 100, 100)
    assert due is not None and due.end == 100 and due.discarded == 60 and due.steps[0][1]
    assert plan_forward(counts, "r", method, 100, 101, 100).discarded == 61  # every step over budget evicts
    assert plan_forward(counts, "r", method, 0, 50, 100) is None  # recomputed: a new first chunk, nothing due yet
    assert "r" not in counts
