"""The task registry: names -> seeded, deterministic sample generators sized in the model's tokens.

Tasks:
* RULER's 11 offline synthetic tasks (`kvtrim.eval.ruler`): niah_single_1/2/3, niah_multikey_1/2/3,
  niah_multivalue, niah_multiquery, vt, cwe, fwe;
* `passkey` (5 digits) and `passkey_64` (64 digits), filler haystack, needle at a controlled depth;
* `niah`: one needle (RULER's niah_single_2 format, synthetic prose haystack) at a controlled depth,
  for the depth x length heat map;
* `--haystack essay` (`kvtrim.eval.essays`): Paul Graham's essays, as RULER, for the tasks whose RULER
  haystack is the essays (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery), `niah` and
  the passkeys; the tasks on noise or needle haystacks keep theirs, as in RULER;
* `pydoc_needle` (`kvtrim.eval.pydoc_needle`): one fact planted in real prose, the Python language
  reference of the standard library's `pydoc_data`, asked after the context;
* reasoning tasks (`kvtrim.eval.reasoning`): `arith_trace`, `arith_recall`, `program_trace`, `var_trace`,
  `chain_trace`, `list_recall`, long
  step-by-step answers scored by the `trace` metric.

Length convention (RULER's): a sample of length L has `prompt tokens + max_new_tokens <= L`, counted
with the model's tokenizer and prompt format (chat template included), as close to L as whole
haystack pieces allow. Depth tasks (`passkey*`, `niah`) make `n` samples per depth. Reasoning tasks
count the answer instead of a haystack: a sample of length L has as many steps as fit
`prompt tokens + ANSWER_SLACK x (tokens of the reference answer) <= L`, and `max_new_tokens = L - prompt
tokens`; every sample of a (task, length) has the same number of steps.
"""

from __future__ import annotations

import random

from kvtrim.eval.fit import fit_sample, largest_fitting
from kvtrim.eval.passkey import PASSKEY_TASKS, passkey_eval_sample, passkey_max_new_tokens, random_key
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.pydoc_needle import PYDOC_MAX_NEW_TOKENS, pydoc_needle_sample
from kvtrim.eval.reasoning import REASONING_TASKS, reasoning_sample
from kvtrim.eval.essays import words_hint
from kvtrim.eval.ruler import NIAH_TASKS, RULER_TASKS, ruler_sample, units_hint, uses_essay
from kvtrim.eval.sample import Sample
from kvtrim.methods.base import KvtrimError, check

DEPTH_TASKS = ["passkey", "passkey_64", "niah"]
REAL_TEXT_TASKS = ["pydoc_needle"]
TASKS = RULER_TASKS + DEPTH_TASKS + REAL_TEXT_TASKS + list(REASONING_TASKS)
# the reference answer times this must fit: room for a model that writes more than the ideal answer
# (qwen2.5-coder-0.5b wrote 0.85-1.29x the reference, and ran into the cap once at 1.29x: benchmarks/reasoning)
ANSWER_SLACK = 1.25
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NIAH_MAX_NEW_TOKENS = 32  # the answer is a 7-digit number in one short sentence


def check_tasks(names: list[str]) -> None:
    unknown = [t for t in names if t not in TASKS]
    check(not unknown, f"unknown task {', '.join(unknown)}; known tasks: {', '.join(TASKS)}")


def max_new_tokens(task: str) -> int:
    if task in PASSKEY_TASKS:
        return passkey_max_new_tokens(PASSKEY_TASKS[task])
    if task == "niah":
        return NIAH_MAX_NEW_TOKENS
    if task == "pydoc_needle":
        return PYDOC_MAX_NEW_TOKENS
    return ruler_sample(task, "probe", random.Random(0), 4, 4096).max_new_tokens


def takes_haystack(task: str, haystack: str) -> bool:
    """Whether `task` uses `--haystack haystack` (the essays: RULER's essay tasks, niah, passkey*)."""
    if haystack == "synthetic":
        return True
    return task in PASSKEY_TASKS or uses_essay("niah_single_2" if task == "niah" else task, haystack)


def _builder(task: str, length: int, seed: int, depth: float | None, haystack: str = "synthetic"):
    """`make(index, units) -> Sample` for one (task, length, depth) cell; deterministic in its arguments.
    A sample on the essay haystack has `/essay` in its id (its rows never mix with the synthetic ones')."""
    tag = "" if depth is None else f"/d{round(depth * 100)}"
    essay = haystack == "essay" and takes_haystack(task, haystack)
    tag += "/essay" if essay else ""

    def make(index: int, units: int) -> Sample:
        sample_id = f"{task}/L{length}{tag}/s{seed}/{index}"
        rng = random.Random(f"{sample_id}")
        if task in PASSKEY_TASKS:
            key = random_key(rng, PASSKEY_TASKS[task])
            return passkey_eval_sample(task, sample_id, key, depth, units, length, haystack if essay else "synthetic")
        if task == "niah":
            s = ruler_sample("niah_single_2", sample_id, rng, units, length, haystack_seed=seed, depth=depth,
                             haystack=haystack)
            s.task, s.max_new_tokens, s.depth = "niah", NIAH_MAX_NEW_TOKENS, depth
            return s
        if task == "pydoc_needle":
            return pydoc_needle_sample(sample_id, rng, units, length)
        return ruler_sample(task, sample_id, rng, units, length, haystack_seed=seed, haystack=haystack)

    return make


def reasoning_samples(task: str, fmt: PromptFormat, length: int, n: int, seed: int = 0) -> list[Sample]:
    """`n` samples of reasoning `task` at `length` tokens (see the module docstring), deterministic under `seed`."""
    tokenizer = fmt.tokenizer

    def make(index: int, steps: int) -> Sample:
        return reasoning_sample(task, f"{task}/L{length}/s{seed}/{index}", steps, length=length)

    def need(sample: Sample) -> int:
        reference = len(tokenizer(sample.meta["reference"], add_special_tokens=False).input_ids)
        sample.meta["reference_tokens"] = reference
        return fmt.count(sample) + int(ANSWER_SLACK * reference + 0.999)

    spec = REASONING_TASKS[task]
    start = max(spec.min_steps + 1, length // (2 * spec.tokens_per_step))
    try:
        steps = largest_fitting(lambda u: make(0, spec.min_steps - 1 + u), need, length, start=start)
    except KvtrimError:
        raise KvtrimError(f"task {task} at length {length}: the target length is too short for its smallest "
                          "problem and answer") from None
    steps += spec.min_steps - 1
    samples = []
    for index in range(n):
        sample = make(index, steps)
        while need(sample) > length and sample.meta["steps"] > spec.min_steps:  # a few more digits than sample 0
            sample = make(index, sample.meta["steps"] - 1)
        prompt = fmt.count(sample)
        sample.max_new_tokens = length - prompt
        sample.meta["prompt_tokens"] = prompt
        samples.append(sample)
    return samples


def generate_samples(
    task: str, fmt: PromptFormat, length: int, n: int, seed: int = 0, depths: tuple[float, ...] | None = None,
    haystack: str = "synthetic",
) -> list[Sample]:
    """`n` samples of `task` at `length` tokens (per depth for depth tasks), deterministic under `seed`.
    `haystack="essay"`: Paul Graham's essays for the tasks that take it (`takes_haystack`), the others
    unchanged."""
    check_tasks([task])
    check(n >= 1, f"--samples must be >= 1, got {n}")
    if task in REASONING_TASKS:
        return reasoning_samples(task, fmt, length, n, seed)
    budget = length - max_new_tokens(task)
    cells = list(depths or DEFAULT_DEPTHS) if task in DEPTH_TASKS else [None]
    samples: list[Sample] = []
    for depth in cells:
        make = _builder(task, length, seed, depth, haystack)
        if task in PASSKEY_TASKS:
            start = words_hint(length) if haystack == "essay" else 8
        elif task == "pydoc_needle":
            start = max(2, length // 12)  # about 12 tokens a line
        else:
            start = units_hint("niah_single_2" if task == "niah" else task, length, haystack)
        try:
            units = largest_fitting(lambda u: make(0, u), fmt.count, budget, start=start)
        except KvtrimError as err:
            raise KvtrimError(f"task {task} at length {length}: {err} (plus {max_new_tokens(task)} to generate)") from None
        samples += [fit_sample(lambda u, i=i: make(i, u), fmt.count, budget, units) for i in range(n)]
    return samples


__all__ = ["DEFAULT_DEPTHS", "takes_haystack", "DEPTH_TASKS", "NIAH_TASKS", "REAL_TEXT_TASKS", "REASONING_TASKS", "TASKS", "check_tasks",
           "generate_samples", "reasoning_samples"]
