"""Offline evaluation: synthetic long-context tasks generated in code, a resumable sweep, reports.

Modules (one job each):
    words, haystack   word lists and the synthetic haystacks (prose, RULER's noise sentences)
    ruler             RULER's 11 offline tasks; passkey (5 / 64 digits); tasks (registry, NIAH grid)
    reasoning         generated step-by-step tasks with long answers (arith / program / var / chain traces)
    sample, prompt    the sample record + JSONL task files; turning a sample into token ids
    fit               sizing samples to a target length in the model's own tokens
    scoring           RULER's string_match_all / string_match_part, passkey exact / partial,
                      boxed / final_number / trace (final answers and step values of reasoning)
    runner            the sweep (methods from `kvtrim.specs`, contexts compressed with `kvtrim.compress`,
                      one shared prefill replayed for every one-shot method), resumable through results.jsonl
    report, presets   summary.csv / summary.md / PNG plots; named sweeps; cli: `kvtrim eval`

Python use:

    from kvtrim.eval import PromptFormat, Runner, RunSettings, generate_samples, parse_method_specs, plan
    samples = generate_samples("niah_single_2", PromptFormat(tok), 2048, n=5)
    rows = Runner(model, tok, RunSettings(model="smollm2-135m"), "out").run(
        plan(samples, parse_method_specs("full,lagkv,streaming"), [0.5, 0.75]))
"""

from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.report import write_report
from kvtrim.eval.runner import Runner, RunSettings, plan
from kvtrim.eval.sample import Sample, read_task_file, write_task_file
from kvtrim.eval.scoring import score_prediction, string_match_all, string_match_part
from kvtrim.specs import parse_method_specs
from kvtrim.eval.tasks import TASKS, generate_samples

__all__ = [
    "TASKS",
    "PromptFormat",
    "RunSettings",
    "Runner",
    "Sample",
    "generate_samples",
    "parse_method_specs",
    "plan",
    "read_task_file",
    "score_prediction",
    "string_match_all",
    "string_match_part",
    "write_report",
    "write_task_file",
]
