"""The kvpress side of the KVzip side-by-side: runs inside .venv-kvpress (scripts/kvpress_env.sh, kvpress
0.5.5 with transformers 4.57) and imports only kvpress, transformers, torch and the standard library.

    .venv-kvpress/bin/python benchmarks/kvzip/kvpress_kvzip_keep.py --input in.json --output out.json

Input: the model directory, the context token ids (chat-formatted, as kvpress's pipeline formats a
context) and the configurations to run (compression_ratio, layerwise, chunk_size). For each, the context
is prefilled under `KVzipPress` exactly as the pipeline does (`model.model(input_ids=..., past_key_values=...)`
inside `with press(model)`), then:

* the evicted entries are read from `module.masked_key_indices` (kvpress does not evict: it leaves the
  cache whole and swaps the evicted keys for "fake keys" at attention time, see its attention_patch.py);
* the scores and the chat-head length the press computed are copied in `compress_post`, before the
  press resets them (a subclass that calls the original: nothing is patched).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import tempfile
import time

import torch
import transformers
from transformers import DynamicCache

# kvpress_side.py ships inside the package (src/kvtrim/bench), importable here without kvtrim itself
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "src" / "kvtrim" / "bench"))
from kvpress_side import load  # noqa: E402  (same model loading as the other kvpress comparisons)


def run(model, ids: torch.Tensor, cfg: dict) -> dict:
    from kvpress import KVzipPress

    seen: dict = {}

    class RecordingKVzip(KVzipPress):
        def compress_post(self, model):
            seen["scores"] = self.score_val.detach().float().clone()  # (layers, batch, kv_heads, n)
            seen["prefix_length"] = self.prefix_length
            seen["suffix_ids"] = self._suffix_ids[0].tolist()
            return super().compress_post(model)

    press = RecordingKVzip(compression_ratio=cfg["compression_ratio"], layerwise=cfg["layerwise"],
                           chunk_size=cfg["chunk_size"])
    cache = DynamicCache()
    t0 = time.perf_counter()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    seconds = time.perf_counter() - t0
    n = ids.shape[1]
    evicted = []
    for layer in model.model.layers:
        module = layer.self_attn
        heads = [[] for _ in range(model.config.num_key_value_heads)]
        if getattr(module, "masked_key_indices", None) is not None:
            b, h, s = module.masked_key_indices
            assert int(b.max()) == 0 if len(b) else True
            for hh, ss in zip(h.tolist(), s.tolist()):
                heads[hh].append(ss)
        evicted.append([sorted(x) for x in heads])
        module.masked_key_indices = None  # the next run starts clean
    assert cache.get_seq_length() == n, "the reconstruction left entries in the cache"
    return {"config": cfg, "evicted": evicted, "scores": seen["scores"][:, 0].tolist(),
            "prefix_length": seen["prefix_length"], "suffix_ids": seen["suffix_ids"], "seconds": seconds}


def compatible_dir(model_dir: str, tmp: str) -> str:
    """A view of `model_dir` that transformers 4.57 can read whole: links to its files and a tokenizer config
    naming `PreTrainedTokenizerFast` (transformers 5 writes `TokenizersBackend`, unknown to 4.57).
    `KVzipPress` loads the tokenizer itself from `model.config.name_or_path`, so the model is loaded from
    here too."""
    src = pathlib.Path(model_dir)
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (pathlib.Path(tmp) / f.name).symlink_to(f.resolve())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local"):
        config.pop(key, None)
    (pathlib.Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    spec = json.loads(open(args.input).read())
    torch.set_num_threads(spec.get("threads", 1))
    tmp = tempfile.TemporaryDirectory()
    model = load(compatible_dir(spec["model_dir"], tmp.name))
    ids = torch.tensor([spec["ids"]])
    from importlib.metadata import version

    out = {"env": {"kvpress": version("kvpress"), "transformers": transformers.__version__,
                   "torch": torch.__version__, "python": platform.python_version()},
           "runs": [run(model, ids, cfg) for cfg in spec["configs"]]}
    with open(args.output, "w") as f:
        json.dump(out, f)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
