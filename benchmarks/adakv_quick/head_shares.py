"""How AdaKV splits a layer's budget across KV heads on SmolLM2 (3 KV heads): a random 2,048-token
prompt compressed at 0.75 (budget 512 per head on average), per layer the largest head's share of the
layer's entries and the smallest head's length (the safeguard is int(0.2 x 512) = 102).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/adakv_quick/head_shares.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import kvtrim


def main() -> None:
    torch.set_num_threads(1)
    model, _ = kvtrim.load_model("smollm2-135m")
    ids = torch.randint(100, 40000, (1, 2048), generator=torch.Generator().manual_seed(0))
    out = {"command": "OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/adakv_quick/head_shares.py",
           "prompt_tokens": 2048, "compression_ratio": 0.75, "methods": {}}
    for inner in (kvtrim.KNorm(compression_ratio=0.75), kvtrim.KeyDiff(compression_ratio=0.75),
                  kvtrim.SnapKV(compression_ratio=0.75)):
        method = kvtrim.AdaKV(inner)
        lengths = torch.tensor(kvtrim.compress(model, ids, method).stats().lengths_per_layer)[:, 0, :]
        share = lengths.float() / lengths.sum(-1, keepdim=True)
        out["methods"][method.label()] = {
            "largest_head_share_median": round(share.max(-1).values.median().item(), 3),
            "smallest_head_length_median": int(lengths.min(-1).values.median()),
            "lengths_per_layer": lengths.tolist(),
        }
        print(method.label(), {k: v for k, v in out["methods"][method.label()].items() if k != "lengths_per_layer"})
    Path(__file__).with_name("head_shares.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
