"""LazyEviction's window W for the reasoning preset, by the paper's rule (`kvtrim.estimate_window`).

Generates `--samples` `list_recall` samples (seed 1: not the preset's samples, which use seed 0) greedily
with the full cache on the preset's model, tracks every entry's maximum recurrence interval (MRI) as
LazyEviction does, and takes the 80th percentile of the MRI of the entries that were attended again
(the paper's rule). Writes `window.json` next to this script (or `--out`); `kvtrim.eval.presets` reads the number
from there by hand (it is a committed measurement, not a run-time step).

    PYTHONPATH=src .venv/bin/python benchmarks/reasoning/window.py --samples 2
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

import kvtrim
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.tasks import generate_samples

HERE = pathlib.Path(__file__).parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--task", default="list_recall")
    p.add_argument("--length", type=int, default=768)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--percentile", type=float, default=80.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "window.json"), help="where the result goes (JSON)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvtrim.load_model(args.model, dtype=torch.float32)
    kvtrim.enable(model)
    samples = generate_samples(args.task, PromptFormat(tok), args.length, args.samples, seed=1)
    start = time.perf_counter()
    window = kvtrim.estimate_window(model, tok, [s.context + s.question for s in samples],
                                    max_new_tokens=max(s.max_new_tokens for s in samples), percentile=args.percentile)
    result = {"model": args.model, "task": args.task, "length": args.length, "samples": [s.id for s in samples],
              "percentile": args.percentile, "window": window, "seconds": round(time.perf_counter() - start, 1)}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(result)


if __name__ == "__main__":
    main()
