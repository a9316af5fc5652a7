"""The answers `tests/test_vllm_server.py::test_a_context_compressed_on_its_own_answers_as_kvtrim_compress` expects:
in transformers (float32), `kvtrim.compress(model, context, method)` then `ctx.generate(question)`, greedy, for the
passkey prompts of that test, the context being each prompt's tokens but its last `QUESTION` ones. Run from the
core environment (its transformers has kvtrim's `cache=` generate path):

    .venv/bin/python tests/data/context_reference/make.py    # writes answers.json next to this file
"""

from __future__ import annotations

import json
import pathlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvtrim
from kvtrim.models import resolve_model_dir
from kvtrim.passkey import passkey_samples
from kvtrim.specs import parse_method_spec

#: the prompt tokens read after the context (the question); the methods compared; new tokens
QUESTION, NEW_TOKENS = 12, 12
SPECS = ["keydiff:compression_ratio=0.5", "snapkv:compression_ratio=0.5", "lagkv:compression_ratio=0.5",
         "tova:budget=256", "h2o:budget=256"]


def samples(tok):
    return passkey_samples(tok, 900, 10, seed=24)[8:10]  # (prompts the server tests use nowhere else)


def main() -> None:
    path = resolve_model_dir("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    kvtrim.enable(model)
    out = {"question_tokens": QUESTION, "new_tokens": NEW_TOKENS, "answers": {}}
    for spec in SPECS:
        answers = []
        for sample in samples(tok):
            ids = torch.tensor([tok(sample.prompt).input_ids])
            method = parse_method_spec(spec).build()
            ctx = kvtrim.compress(model, ids[:, :-QUESTION], method)
            new = ctx.generate(ids[:, -QUESTION:], max_new_tokens=NEW_TOKENS)[0]
            answers.append({"prompt_ids": ids[0].tolist(), "answer_ids": new.tolist(),
                            "answer": tok.decode(new, skip_special_tokens=True)})
        out["answers"][spec] = answers
        print(spec, [tok.decode(a["answer_ids"]) for a in answers])
    (pathlib.Path(__file__).parent / "answers.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
