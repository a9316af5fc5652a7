"""The document-QA load's questions asked in-process (`kvtrim.compress` then `generate`, in transformers), to
compare with what the servers answered (`docqa.py`'s results.json in `--out`). Run from the core environment:

    .venv/bin/python benchmarks/serving/docqa_reference.py --out benchmarks/serving/results-docqa-shared-9

For each kvtrim run of the results, each document is compressed once as its context (query-agnostic, as the
server compresses it) and each of its questions is answered greedily from a copy, `max_tokens` new tokens, in
the dtype the servers ran (bfloat16). Writes reference.json and reference.md: per method, the keys found
in-process and by the server, and how many answers are the same text (bf16: the server's CPU kernels and
transformers' attention round differently, so texts may part after a few tokens; the float32 server tests
check token equality).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "src"))

from docqa_docs import documents  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="docqa_reference.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, required=True, help="a docqa.py results folder")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvtrim
    from kvtrim.models import resolve_model_dir
    from kvtrim.specs import parse_method_spec

    data = json.loads((args.out / "results.json").read_text())
    c = data["config"]
    path = resolve_model_dir(c["model"])
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.bfloat16).eval()
    kvtrim.enable(model)
    docs = documents(tok, c["docs"], c["questions"], c["doc_tokens"], c["seed"])
    rows, out = [], {"command": " ".join(["benchmarks/serving/docqa_reference.py", *(argv or sys.argv[1:])]),
                     "methods": {}}
    for run in data["runs"]:
        if run["method"] is None:
            continue
        method = parse_method_spec(run["method"]).build()
        answers = {}
        for d, (doc, qs) in enumerate(docs):
            ctx = kvtrim.compress(model, torch.tensor([doc]), method)
            for q, (ids, key) in enumerate(qs):
                new = ctx.generate(torch.tensor([ids]), max_new_tokens=c["max_tokens"], do_sample=False)
                answers[(d, q)] = (tok.decode(new[0], skip_special_tokens=True), key)
            print(f"[{run['label']}] document {d} done", flush=True)
        served = {(r["doc"], r["question"]): r["text"] for r in run["records"]}
        found = sum(key in text for text, key in answers.values())
        found_served = sum(key in served[k] for k, (_, key) in answers.items())
        same = sum(text == served[k] for k, (text, _) in answers.items())
        out["methods"][run["label"]] = {"found_in_process": found, "found_served": found_served, "same_text": same,
                                        "questions": len(answers),
                                        "answers": {f"{d}/{q}": a for (d, q), (a, _) in answers.items()}}
        rows.append(f"| {run['label']} | {found}/{len(answers)} | {found_served}/{len(answers)} | "
                    f"{same}/{len(answers)} |")
    (args.out / "reference.json").write_text(json.dumps(out, indent=1))
    lines = ["# The same questions in-process (`kvtrim.compress` + `generate`, bfloat16)", "", "    " + out["command"],
             "", "| configuration | keys found in-process | keys found by the server | same text |", "|---|---:|---:|---:|",
             *rows]
    (args.out / "reference.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
