"""Where the time of tests/test_padded_integration.py goes, for one method (issue #11's padded batch).

    OMP_NUM_THREADS=2 PYTHONPATH=src:tests python benchmarks/padded/profile_padded.py --method h2o

Times, in one process: the padded batch through `generate` (prefill only, i.e. one new token, and with
the test's new tokens), a batch of the same shape without pads (dense layers, stock SDPA: what the pads
cost on their own), each prompt alone, and a cProfile of the padded run (top functions by own time).
Writes `profile_<method>.json` beside this file.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch
import test_padded_integration as T

import kvtrim


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="h2o", choices=[m[0] for m in T.METHODS])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    model, tok = kvtrim.load_model("smollm2-135m", dtype=torch.float32)
    method = {m[0]: m[1] for m in T.METHODS}[args.method]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    seqs = [tok(" ".join(T.prose_sentences(400, seed=i)), return_tensors="pt").input_ids[0][:n]
            for i, n in enumerate(T.LENGTHS)]
    ids, mask = T.pad(seqs, "left")
    ids = ids.masked_fill(mask == 0, pad_id)

    def gen(x, m, new):
        cache = kvtrim.TrimCache(method, config=model.config)
        with torch.no_grad():
            return model.generate(x, attention_mask=m, cache=cache, max_new_tokens=new, do_sample=False,
                                  pad_token_id=pad_id)

    res = {"method": method.label(), "lengths": list(T.LENGTHS), "new_tokens": T.NEW, "threads": args.threads,
           "load_average_before": load}
    res["padded_prefill_s"] = timed(lambda: gen(ids, mask, 1))[0]
    res["padded_s"] = timed(lambda: gen(ids, mask, T.NEW))[0]
    res["unpadded_same_shape_prefill_s"] = timed(lambda: gen(ids, torch.ones_like(mask), 1))[0]
    res["alone_s"] = [timed(lambda: gen(s[None], torch.ones(1, len(s), dtype=torch.long), T.NEW))[0] for s in seqs]
    prof = cProfile.Profile()
    prof.enable()
    gen(ids, mask, T.NEW)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    res["profile_padded_top_tottime"] = text.getvalue().splitlines()
    res["load_average_after"] = os.getloadavg()
    out = Path(__file__).with_name(f"profile_{args.method}.json")
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "profile_padded_top_tottime"}, indent=1))
    print("\n".join(res["profile_padded_top_tottime"]))


if __name__ == "__main__":
    main()
