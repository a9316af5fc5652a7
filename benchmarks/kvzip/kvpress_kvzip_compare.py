"""KVzip side by side: kvtrim's pure functions (`kvtrim.methods.kvzip`) vs kvpress 0.5.5's `KVzipPress`,
kept sets per layer and KV head on the default model and a ~1k-token chat-formatted context.

    PYTHONPATH=src /work/main/.venv/bin/python benchmarks/kvzip/kvpress_kvzip_compare.py \
        --out benchmarks/kvzip/results/kvpress_kvzip_keep.json

Needs `.venv-kvpress` (scripts/kvpress_env.sh). The context is real prose that ships with Python (the
language reference topics of `pydoc_data`), cut to `--context-tokens` tokens and formatted as kvpress's
pipeline formats a context (chat head, then the text, the user turn left open).

Our side drives the model by hand (transformers 5, SDPA): prefill into a `DynamicCache`, then each
reconstruction chunk forward under an attention function registered under its own name that records the
post-RoPE queries and keys it is given (and otherwise is stock SDPA); scores by `reconstruction_scores`,
the cache cropped back after every chunk; selection by `select_global`. The kvtrim settings that define
the same thing as kvpress: chat pieces in kvpress style, `sink_size=4`, `protected=4`,
`rounding="kvpress"`, kvpress's chunk size, the chat head skipped. Reported per configuration:

* `jaccard`: our kept set vs kvpress's, per layer and head (kvpress: every entry not in
  `masked_key_indices`);
* `selection_only_jaccard`: `select_global` applied to kvpress's own scores vs kvpress's kept set
  (isolates the selection rule from the scoring numerics);
* `scores`: the largest difference between our scores and kvpress's `score_val` (sinks excluded: kvpress
  overwrites them with max + 1);
* `official_variant` (default chunking only): the kept set under the official code's definitions
  (system prompt = the whole chat head as sinks and protected, official prompts and rounding) vs
  kvpress's, to show how far the two definitions are apart on this input; then one official definition
  at a time (the chat head protected from eviction; the chat head as the softmax sinks), the rest as
  kvpress.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import torch
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvtrim.bench.kvpress_compare import jaccard_per_head
from kvtrim.methods.kvzip import (
    KVPRESS_CHUNK_SIZE,
    OFFICIAL_CHUNK_SIZE,
    chat_context,
    reconstruction_chunks,
    reconstruction_pieces,
    reconstruction_scores,
    select_global,
)
from kvtrim.models import resolve_model_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
CAPTURE = "kvzip_capture_sdpa"
CAPTURED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
TOPICS = ["if", "while", "for", "try", "with", "function", "class", "import", "assert", "return", "raise"]


def capture_sdpa(module, query, key, value, attention_mask, **kwargs):
    """Stock SDPA that also records the post-RoPE queries and the keys (cache + new) it attends to."""
    CAPTURED[module.layer_idx] = (query.detach(), key.detach())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def context_text(tok, n_tokens: int) -> str:
    """The first `n_tokens` tokens of some `pydoc_data` language-reference topics, as text."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[t].strip() for t in TOPICS)
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < n_tokens:
        raise SystemExit(f"only {len(ids)} tokens of text available")
    return tok.decode(ids[:n_tokens])


@torch.no_grad()
def our_scores(model, ids: torch.Tensor, prefix: int, pieces, chunk_size: int, sink_size: int) -> list[torch.Tensor]:
    """Prefill, then the reconstruction forwards by hand; per layer `(1, kv_heads, n)` float32 scores."""
    cache = DynamicCache()
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    n = ids.shape[1]
    before = [layer.keys.clone() for layer in cache.layers]
    scores: list[torch.Tensor | None] = [None] * len(before)
    for chunk in reconstruction_chunks(ids[:, prefix:], pieces, offset=prefix, chunk_size=chunk_size):
        r = chunk.input_ids.shape[1]
        model(input_ids=chunk.input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        for layer in range(len(before)):
            q, k = CAPTURED.pop(layer)
            scores[layer] = reconstruction_scores(q, k[:, :, :n], k[:, :, n:], chunk.start, chunk.stop, sink_size,
                                                  scores[layer])
        cache.crop(-r)
        assert cache.get_seq_length() == n
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, before)), "the cache changed"
    return scores


def kept_lists(masks: list[torch.Tensor]) -> list[list[list[int]]]:
    return [[m[0, h].nonzero().flatten().tolist() for h in range(m.shape[1])] for m in masks]


def cache_kept(ctx) -> list[list[list[int]]]:
    """`[layer][head]` original positions a compressed context's cache holds (dense or ragged layers)."""
    out = []
    for layer in ctx.cache.layers:
        if layer.is_ragged:
            v = layer.storage.padded()
            out.append([v.positions[0, h][v.valid[0, h]].tolist() for h in range(v.positions.shape[1])])
        else:
            out.append([layer.positions[0, h].tolist() for h in range(layer.positions.shape[1])])
    return out


def summary(jac: list[list[float]]) -> dict:
    flat = [x for row in jac for x in row]
    return {"mean": round(sum(flat) / len(flat), 6), "min": round(min(flat), 6),
            "heads_identical": sum(x == 1.0 for x in flat), "heads": len(flat)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/kvzip/results/kvpress_kvzip_keep.json"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--ratios", default="0.5,0.69")
    parser.add_argument("--small-chunk", type=int, default=256, help="a second chunking, to exercise several chunks")
    parser.add_argument("--kvpress-python", default=str(ROOT / ".venv-kvpress/bin/python"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ratios = [float(x) for x in args.ratios.split(",")]
    chunk_sizes = [KVPRESS_CHUNK_SIZE, args.small_chunk]

    model_dir = str(resolve_model_dir(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids, prefix = chat_context(tok, context_text(tok, args.context_tokens))
    configs = [{"compression_ratio": r, "layerwise": lw, "chunk_size": cs}
               for cs in chunk_sizes for lw in (False, True) for r in ratios]

    # kvpress side first (its own venv)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"model_dir": model_dir, "ids": ids[0].tolist(), "configs": configs, "threads": args.threads}
        (pathlib.Path(tmp) / "in.json").write_text(json.dumps(spec))
        t0 = time.perf_counter()
        subprocess.run([args.kvpress_python, str(ROOT / "benchmarks/kvzip/kvpress_kvzip_keep.py"),
                        "--input", f"{tmp}/in.json", "--output", f"{tmp}/out.json"], check=True)
        print(f"kvpress side: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        theirs = json.loads((pathlib.Path(tmp) / "out.json").read_text())

    AttentionInterface.register(CAPTURE, capture_sdpa)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.set_attn_implementation(CAPTURE)
    kvpress_pieces = reconstruction_pieces(tok, "chat", "kvpress")
    scores = {cs: our_scores(model, ids, prefix, kvpress_pieces, cs, 4) for cs in chunk_sizes}
    official_scores = our_scores(model, ids, prefix, reconstruction_pieces(tok, "chat", "official"),
                                 OFFICIAL_CHUNK_SIZE, prefix)

    # kvtrim's cache path: kvtrim.compress with KVzip(variant="kvpress", level="head"), ragged layers
    import kvtrim

    cache_model = kvtrim.load_model(args.model, dtype=torch.float32)[0]
    cache_path = {}
    for cfg in configs:
        method = kvtrim.KVzip(compression_ratio=cfg["compression_ratio"], variant="kvpress", level="head",
                              layerwise=cfg["layerwise"], chunk_size=cfg["chunk_size"])
        ctx = kvtrim.compress(cache_model, ids, method, tokenizer=tok)
        cache_path[json.dumps(cfg, sort_keys=True)] = (ctx, cache_kept(ctx))

    n = ids.shape[1]
    runs = []
    for run in theirs["runs"]:
        cfg = run["config"]
        assert run["prefix_length"] == prefix, (run["prefix_length"], prefix)
        assert tuple(run["suffix_ids"]) == kvpress_pieces.separator
        kv_kept = [[sorted(set(range(n)) - set(ev)) for ev in layer] for layer in run["evicted"]]
        mine = select_global(scores[cfg["chunk_size"]], compression_ratio=cfg["compression_ratio"], protected=4,
                             layerwise=cfg["layerwise"], rounding="kvpress")
        theirs_scores = [torch.tensor(s)[None] for s in run["scores"]]
        on_theirs = select_global(theirs_scores, compression_ratio=cfg["compression_ratio"], protected=4,
                                  layerwise=cfg["layerwise"], rounding="kvpress")
        ours_t = torch.stack([s[0] for s in scores[cfg["chunk_size"]]])[..., 4:]
        theirs_t = torch.stack([s[0] for s in theirs_scores])[..., 4:]
        jac = jaccard_per_head(kept_lists(mine), kv_kept)
        ctx, cache_kept_sets = cache_path[json.dumps(cfg, sort_keys=True)]
        stats = ctx.stats()
        entry = {
            **cfg,
            "chunks": len(range(0, n - prefix, cfg["chunk_size"])),
            "kept_ours": sum(len(h) for layer in kept_lists(mine) for h in layer),
            "kept_kvpress": sum(len(h) for layer in kv_kept for h in layer),
            # kvpress never scores the chat head past its 4 sinks (score 0): how much of it survives
            "chat_head_kept_kvpress": sum(len([i for i in h if 4 <= i < prefix]) for layer in kv_kept for h in layer),
            "chat_head_entries": len(kv_kept) * len(kv_kept[0]) * (prefix - 4),
            "kept_per_head_kvpress": {"min": min(len(h) for layer in kv_kept for h in layer),
                                      "max": max(len(h) for layer in kv_kept for h in layer)},
            "kept_per_layer_fraction_kvpress": {
                "min": round(min(sum(map(len, layer)) / (len(layer) * n) for layer in kv_kept), 4),
                "max": round(max(sum(map(len, layer)) / (len(layer) * n) for layer in kv_kept), 4)},
            "jaccard": summary(jac),
            "jaccard_per_layer_head": [[round(x, 4) for x in row] for row in jac],
            "selection_only_jaccard": summary(jaccard_per_head(kept_lists(on_theirs), kv_kept)),
            # the same through the cache: kvtrim.compress, KVzip(variant="kvpress", level="head")
            "cache_path": {
                "jaccard": summary(jaccard_per_head(cache_kept_sets, kv_kept)),
                "jaccard_per_layer_head": [[round(x, 4) for x in row]
                                           for row in jaccard_per_head(cache_kept_sets, kv_kept)],
                "ragged_layers": sum(layer.is_ragged for layer in ctx.cache.layers),
                "bytes_allocated": stats.bytes_allocated, "bytes_ideal": stats.bytes_ideal,
                "bytes_full": stats.bytes_full,
                "scoring_seconds": round(ctx.scoring_seconds, 2), "prefill_seconds": round(ctx.prefill_seconds, 2),
            },
            "scores": {"max_abs_diff": float((ours_t - theirs_t).abs().max()),
                       "max_score": float(theirs_t.max())},
            "kvpress_seconds": round(run["seconds"], 2),
        }
        if cfg["chunk_size"] == KVPRESS_CHUNK_SIZE:
            official = select_global(official_scores, compression_ratio=cfg["compression_ratio"], protected=prefix,
                                     layerwise=cfg["layerwise"], rounding="official")
            # one official definition at a time, the rest as kvpress
            chat_head_kept = select_global(scores[cfg["chunk_size"]], compression_ratio=cfg["compression_ratio"],
                                           protected=prefix, layerwise=cfg["layerwise"], rounding="kvpress")
            head_sinks = select_global(official_scores, compression_ratio=cfg["compression_ratio"], protected=4,
                                       layerwise=cfg["layerwise"], rounding="kvpress")
            entry["official_variant"] = {
                "kept": sum(len(h) for layer in kept_lists(official) for h in layer),
                "jaccard_vs_kvpress": summary(jaccard_per_head(kept_lists(official), kv_kept)),
                "only_chat_head_protected": summary(jaccard_per_head(kept_lists(chat_head_kept), kv_kept)),
                "only_chat_head_as_softmax_sinks": summary(jaccard_per_head(kept_lists(head_sinks), kv_kept)),
            }
        runs.append(entry)

    result = {
        "schema": "kvtrim.kvzip.kvpress_keep/1",
        "command": "PYTHONPATH=src /work/main/.venv/bin/python benchmarks/kvzip/kvpress_kvzip_compare.py "
                   + " ".join(sys.argv[1:]),
        "model": args.model, "context": {"source": "pydoc_data.topics " + "+".join(TOPICS), "tokens": n,
                                          "chat_head": prefix, "text_tokens": n - prefix},
        "kvtrim_env": {"transformers": transformers.__version__, "torch": torch.__version__,
                       "python": platform.python_version()},
        "kvpress_env": theirs["env"],
        "runs": runs,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for e in runs:
        print(f"ratio {e['compression_ratio']} layerwise {e['layerwise']!s:5} chunk {e['chunk_size']:4} "
              f"({e['chunks']} chunks): kept {e['kept_ours']}/{e['kept_kvpress']}, Jaccard mean "
              f"{e['jaccard']['mean']:.4f} min {e['jaccard']['min']:.4f} ({e['jaccard']['heads_identical']}/"
              f"{e['jaccard']['heads']} identical), selection only {e['selection_only_jaccard']['mean']:.4f}, "
              f"score diff {e['scores']['max_abs_diff']:.2e}, cache path {e['cache_path']['jaccard']['mean']:.4f} "
              f"({e['cache_path']['jaccard']['heads_identical']}/{e['cache_path']['jaccard']['heads']} identical, "
              f"allocated/ideal {e['cache_path']['bytes_allocated'] / e['cache_path']['bytes_ideal']:.3f})"
              + (f", official variant {e['official_variant']['jaccard_vs_kvpress']['mean']:.3f}"
                 f" (protection only {e['official_variant']['only_chat_head_protected']['mean']:.3f},"
                 f" softmax sinks only {e['official_variant']['only_chat_head_as_softmax_sinks']['mean']:.3f})"
                 if "official_variant" in e else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
