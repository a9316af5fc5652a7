"""The passkeys `tests/test_vllm_server.py::test_passkey_with_evictions_while_decoding` expects the engine to find
(less at most one): in transformers, `kvtrim.generate(model, ids, method, max_new_tokens=40, min_new_tokens=40)`
(greedy; the prompt in the method's blocks, KeyDiff's of 16) on that test's 10 passkey prompts, in the given dtype.
Run from the core environment:

    .venv/bin/python tests/data/passkey_found.py float32    # prints the counts for FOUND_IN_TRANSFORMERS
"""

from __future__ import annotations

import sys

import torch

import kvtrim
from kvtrim.models import load_model
from kvtrim.passkey import passkey_samples
from kvtrim.specs import parse_method_spec

SPECS = ["full", "lagkv:lag_size=32", "keydiff:budget=450:block_size=16"]


def main(dtype: str) -> None:
    model, tok = load_model("smollm2-135m", dtype=dtype)
    samples = passkey_samples(tok, 900, 10, seed=24)  # the test's `prompts` fixture
    for spec in SPECS:
        method = parse_method_spec(spec).build()
        found = 0
        for s in samples:
            ids = tok(s.prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                new, _ = kvtrim.generate(model, ids, method, max_new_tokens=40, min_new_tokens=40)
            found += s.key in tok.decode(new[0], skip_special_tokens=True)
        print(f"{spec}: {found}/{len(samples)} ({dtype})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32")
