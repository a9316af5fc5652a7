"""`kvtrim bench --vs-kvpress`: the same model, prompts and compression ratio through kvtrim and kvpress 0.5.5.

kvpress needs transformers < 5.3, so it runs in its own environment (`scripts/kvpress_env.sh` makes
`.venv-kvpress`) through `kvpress_side.py` (shipped next to this module, run there by path), which
receives the prompts as token ids. Per
pair of equivalent methods this reports:

* selection agreement: Jaccard index of the kept positions per layer and KV head (kvtrim: the
  `positions` a `TrimLayer` holds; kvpress: recovered by matching its compressed keys to the keys
  before compression), on the "selection" prompt of each length;
* time: prefill wall time and the part spent compressing (kvtrim: scoring + gather, `EvictionTimer`;
  kvpress: inside `press.compress`), medians over repeats that alternate between the two sides (and
  rotate the method order), each side with its own full cache as the reference (the two sides run
  different transformers versions);
* passkey accuracy on the same `kvtrim.passkey` samples (greedy, the key must appear in the answer),
  and how often both sides produced the very same tokens;
* peak tensor memory of the prompt and one decode step (`TensorPeak` on both sides; kvtrim on each of its
  paths, `kvtrim.bench.paths`), unless `--no-path-memory`.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from kvtrim.bench.timing import EvictionTimer
from kvtrim.cache import TrimCache
from kvtrim.methods import KeyDiff, LagKV, SnapKV, StreamingLLM
from kvtrim.methods.base import EvictionMethod, KvtrimError, check
from kvtrim.methods.full import FullCache
from kvtrim.decoding import greedy_decode
from kvtrim.prefill import prefill

SCHEMA = "kvtrim.bench.kvpress/1"


@dataclass(frozen=True)
class Pair:
    """A kvpress press and the kvtrim method that is defined to select the same entries (or not)."""

    name: str
    press_params: dict
    comparable: bool  # same definition -> selections should agree
    note: str

    def kvtrim_method(self, n: int, ratio: float) -> EvictionMethod:
        p = self.press_params
        if self.name == "full":
            return FullCache()
        if self.name == "lagkv":
            return LagKV(compression_ratio=ratio, sink_size=p["n_sink"], lag_size=p["lag_size"])
        if self.name == "keydiff":
            return KeyDiff(compression_ratio=ratio)
        if self.name == "block_keydiff":
            return KeyDiff(budget=max(1, int(n * (1 - ratio))), block_size=p["block_size"])
        if self.name == "snapkv":
            return SnapKV(compression_ratio=ratio, window=p["window_size"], kernel=p["kernel_size"], pooling="avg")
        if self.name == "streaming":
            return StreamingLLM(compression_ratio=ratio, sink_size=p["n_sink"])
        raise KvtrimError(f"no kvtrim counterpart for press '{self.name}'")

    def kvpress_label(self) -> str:
        labels = {
            "full": "no press", "lagkv": "LagKVPress(n_sink={n_sink}, lag_size={lag_size})",
            "keydiff": "KeyDiffPress()", "block_keydiff": "BlockPress(KeyDiffPress(), block_size={block_size})",
            "snapkv": "SnapKVPress(window_size={window_size}, kernel_size={kernel_size})",
            "streaming": "StreamingLLMPress(n_sink={n_sink})",
        }
        return labels[self.name].format(**self.press_params)


PAIRS = (
    Pair("full", {}, True, "both keep everything"),
    Pair("lagkv", {"n_sink": 4, "lag_size": 128}, True,
         "same definition (kvtrim's global-budget mode is kvpress's LagKVPress), but ties are broken differently: "
         "ranks tie across partitions at the budget boundary, and when the sinks plus the window alone exceed the "
         "budget (short prompts) all of them tie at the top; kvpress's `topk` then picks any of the tied entries, "
         "kvtrim the earliest"),
    Pair("keydiff", {}, True, "same definition (one-shot, ratio mode); scores in float32 on both sides"),
    Pair("block_keydiff", {"block_size": 128}, False,
         "not the same computation: kvpress's BlockPress replays the block selection on keys computed with full "
         "attention over the whole prompt; kvtrim really prefills block by block (later blocks never see evicted "
         "entries), so keys, values and selections differ by design"),
    Pair("snapkv", {"window_size": 64, "kernel_size": 5}, True,
         "same definition with avg pooling (kernel 5, window 64, mean over window queries and GQA group); kvpress "
         "recomputes the window queries from the hidden states, kvtrim uses the queries the model computed"),
    Pair("streaming", {"n_sink": 4}, True, "same definition: 4 sinks + the most recent entries"),
)
PAIR_BY_NAME = {p.name: p for p in PAIRS}


@dataclass
class CompareConfig:
    model: str = "smollm2-135m"
    lengths: list[int] = field(default_factory=lambda: [2048])
    compression_ratio: float = 0.75
    repeats: int = 3
    passkey_trials: int = 5
    new_tokens: int = 8
    pairs: list[str] = field(default_factory=lambda: [p.name for p in PAIRS])
    kvpress_python: str = ".venv-kvpress/bin/python"
    kvpress_runner: str | None = None  # default: kvpress_side.py next to this module
    threads: int | None = None
    seed: int = 0
    peaks: bool = True  # peak tensor memory on both sides (kvtrim: each path), per selection prompt


# ---- pure helpers ---------------------------------------------------------------------------------
def jaccard(a, b) -> float:
    """|A ∩ B| / |A ∪ B| of two collections of indices (1.0 when both are empty)."""
    a, b = set(int(x) for x in a), set(int(x) for x in b)
    union = a | b
    return 1.0 if not union else len(a & b) / len(union)


def jaccard_per_head(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> list[list[float]]:
    """`[layer][head]` Jaccard indices of two `[layer][head] -> kept indices` structures."""
    check(len(ours) == len(theirs), f"layer counts differ: {len(ours)} vs {len(theirs)}")
    out = []
    for la, lb in zip(ours, theirs):
        check(len(la) == len(lb), f"head counts differ: {len(la)} vs {len(lb)}")
        out.append([jaccard(a, b) for a, b in zip(la, lb)])
    return out


def contains_key(text: str, key: str) -> bool:
    return key in text


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---- the kvtrim side ------------------------------------------------------------------------------
@torch.no_grad()
def kvtrim_prefill(model, ids: torch.Tensor, method: EvictionMethod):
    """Prefill as the benchmark does (one shot, or the method's blocks); returns
    (last logits, cache, prefill seconds, eviction seconds)."""
    timer = EvictionTimer("cpu")
    cache = timer.attach(TrimCache(timer.instrument(method), config=model.config))
    size = method.prefill_block_size()
    t0 = time.perf_counter()
    logits = prefill(model, ids, cache, chunk_size=size)
    seconds = time.perf_counter() - t0
    evict = timer.totals()["prefill_evict_s"]
    timer.detach()
    return logits, cache, seconds, evict


def kept_positions(cache: TrimCache) -> list[list[list[int]]]:
    """`[layer][head]` sorted original positions held by each evicting layer (batch row 0)."""
    out = []
    for layer in cache.layers:
        pos = layer.positions[0]
        out.append([sorted(pos[h].tolist()) for h in range(pos.shape[0])])
    return out


def kvtrim_kept_and_answers(model, prompts: list[dict], pairs: list[Pair], cfg: CompareConfig) -> dict:
    """Kept positions on the selection prompts (an untimed pass, which also warms up) and passkey answers."""
    out = {"kept": {}, "answers": [], "full_logits": {}}
    for p in prompts:
        if p["role"] != "selection":
            continue
        ids = torch.tensor([p["ids"]])
        for pair in pairs:
            logits, cache, _, _ = kvtrim_prefill(model, ids, pair.kvtrim_method(ids.shape[-1], cfg.compression_ratio))
            out["kept"][f"{pair.name}@{p['id']}"] = kept_positions(cache)
            if pair.name == "full":
                out["full_logits"][p["id"]] = logits[0].tolist()
    for p in prompts:
        if p["role"] != "passkey":
            continue
        ids = torch.tensor([p["ids"]])
        for pair in pairs:
            logits, cache, _, _ = kvtrim_prefill(model, ids, pair.kvtrim_method(ids.shape[-1], cfg.compression_ratio))
            out["answers"].append({"press": pair.name, "prompt": p["id"], "tokens": greedy_decode(model, cache, logits,
                                                                                                cfg.new_tokens, set())})
    return out


def kvtrim_peaks(model, prompts: list[dict], pairs: list[Pair], cfg: CompareConfig) -> list[dict]:
    """Peak tensor memory of each pair's kvtrim method on each path (`kvtrim.bench.paths`), per selection prompt."""
    from kvtrim.bench.paths import path_peaks

    rows = []
    for p in prompts:
        if p["role"] != "selection":
            continue
        ids = torch.tensor([p["ids"]])
        for pair in pairs:
            method = pair.kvtrim_method(ids.shape[-1], cfg.compression_ratio)  # prefilled in its own blocks
            rows.append({"press": pair.name, "prompt": p["id"], **path_peaks(model, method, ids)})
    return rows


def kvtrim_timings(model, prompts: list[dict], pairs: list[Pair], cfg: CompareConfig, repeat: int) -> list[dict]:
    """One interleaved timing repeat (the pair order rotates with `repeat`, as on the kvpress side)."""
    rows = []
    for p in prompts:
        if p["role"] != "selection":
            continue
        ids = torch.tensor([p["ids"]])
        k = repeat % len(pairs)
        for pair in pairs[k:] + pairs[:k]:
            _, _, seconds, evict = kvtrim_prefill(model, ids, pair.kvtrim_method(ids.shape[-1], cfg.compression_ratio))
            rows.append({"press": pair.name, "prompt": p["id"], "repeat": repeat, "prefill_s": seconds,
                         "compress_s": evict})
    return rows


# ---- comparison -----------------------------------------------------------------------------------
def compare(prompts: list[dict], pairs: list[Pair], ours: dict, theirs: dict, decode_text: Callable[[list], str]
            ) -> list[dict]:
    """One row per (pair, length): Jaccard, times, passkey accuracy (both sides)."""
    rows = []
    selection = {p["id"]: p for p in prompts if p["role"] == "selection"}
    passkey = [p for p in prompts if p["role"] == "passkey"]
    for pid, prompt in selection.items():
        length = prompt["length"]
        full_ours = _median([t["prefill_s"] for t in ours["timings"] if t["press"] == "full" and t["prompt"] == pid])
        full_theirs = _median([t["prefill_s"] for t in theirs["timings"]
                               if t["press"] == "full" and t["prompt"] == pid])
        for pair in pairs:
            key = f"{pair.name}@{pid}"
            per_head = jaccard_per_head(ours["kept"][key], theirs["kept"][key])
            flat = [j for layer in per_head for j in layer]
            t_ours = [t for t in ours["timings"] if t["press"] == pair.name and t["prompt"] == pid]
            t_theirs = [t for t in theirs["timings"] if t["press"] == pair.name and t["prompt"] == pid]
            row = {
                "method": pair.name, "kvpress": pair.kvpress_label(), "comparable": pair.comparable, "note": pair.note,
                "length": length, "prompt_tokens": len(prompt["ids"]),
                "kept_per_head_kvtrim": len(ours["kept"][key][0][0]), "kept_per_head_kvpress": len(theirs["kept"][key][0][0]),
                "jaccard_mean": statistics.fmean(flat), "jaccard_min": min(flat),
                "heads_identical": sum(j == 1.0 for j in flat) / len(flat),
                "jaccard_per_layer_head": per_head,
                "kvtrim_prefill_s": _median([t["prefill_s"] for t in t_ours]),
                "kvtrim_compress_s": _median([t["compress_s"] for t in t_ours]),
                "kvpress_prefill_s": _median([t["prefill_s"] for t in t_theirs]),
                "kvpress_compress_s": _median([t["compress_s"] for t in t_theirs]),
                "kvtrim_full_prefill_s": full_ours, "kvpress_full_prefill_s": full_theirs,
            }
            right_ours = right_theirs = same = 0
            n_pk = 0
            for p in passkey:
                if p["length"] != length:
                    continue
                a = next(x["tokens"] for x in ours["answers"] if x["press"] == pair.name and x["prompt"] == p["id"])
                b = next(x["tokens"] for x in theirs["answers"] if x["press"] == pair.name and x["prompt"] == p["id"])
                n_pk += 1
                right_ours += contains_key(decode_text(a), p["key"])
                right_theirs += contains_key(decode_text(b), p["key"])
                same += a == b
            row.update(passkey_trials=n_pk, passkey_kvtrim=right_ours, passkey_kvpress=right_theirs,
                       answers_identical=same)
            mine = next((x for x in ours.get("peaks", []) if x["press"] == pair.name and x["prompt"] == pid), None)
            other = next((x for x in theirs.get("peaks", []) if x["press"] == pair.name and x["prompt"] == pid), None)
            if mine is not None and other is not None:
                row.update(kvpress_peak_bytes=other["peak_bytes"],
                           **{f"kvtrim_peak_{path}_bytes": mine[path] for path in ("prefill", "generate",
                                                                                   "generate_deferred")})
            rows.append(row)
    return rows


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "## Side by side with kvpress", "",
        f"`{meta.get('command', '')}`", "",
        f"Model `{meta['model']}`, float32, SDPA, compression ratio {meta['compression_ratio']}, "
        f"{meta['repeats']} interleaved repeats (medians), {meta['threads']} torch threads. kvtrim {meta['kvtrim_env']['kvtrim']} on "
        f"transformers {meta['kvtrim_env']['transformers']}; kvpress {meta['kvpress_env']['kvpress']} on transformers "
        f"{meta['kvpress_env']['transformers']} (its own venv); torch {meta['kvtrim_env']['torch']} on both. "
        f"Passkey: `kvtrim.passkey.passkey_samples` (seed {meta['seed']}), greedy, {meta['new_tokens']} tokens, the "
        "key must appear in the answer. Compress = kvtrim's scoring + gather / the time inside kvpress's "
        "`press.compress`.", "",
        "| tokens | method (kvpress press) | Jaccard mean (min) | heads identical | compress ms kvtrim / kvpress "
        "| prefill s kvtrim / kvpress (each vs its own full) | passkey kvtrim / kvpress | same answer |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        rel_ours = r["kvtrim_prefill_s"] / r["kvtrim_full_prefill_s"]
        rel_theirs = r["kvpress_prefill_s"] / r["kvpress_full_prefill_s"]
        mark = "" if r["comparable"] else " †"
        lines.append(
            f"| {r['prompt_tokens']} | {r['method']} ({r['kvpress']}){mark} | {r['jaccard_mean']:.4f} ({r['jaccard_min']:.3f}) "
            f"| {r['heads_identical'] * 100:.0f} % | {r['kvtrim_compress_s'] * 1000:.1f} / {r['kvpress_compress_s'] * 1000:.1f} "
            f"| {r['kvtrim_prefill_s']:.2f} ({rel_ours:.2f}) / {r['kvpress_prefill_s']:.2f} ({rel_theirs:.2f}) "
            f"| {r['passkey_kvtrim']}/{r['passkey_trials']} / {r['passkey_kvpress']}/{r['passkey_trials']} "
            f"| {r['answers_identical']}/{r['passkey_trials']} |"
        )
    if any("kvpress_peak_bytes" in r for r in result["rows"]):
        lines += ["", "Peak tensor memory of the prompt and one decode step, above the model's weights (both sides "
                  "through `kvtrim.bench.memory.TensorPeak`: torch's CPU allocation records); kvtrim on each path "
                  "(`kvtrim.bench.paths`); in brackets, × each side's own full cache:", "",
                  "| tokens | method | kvpress MiB | kvtrim.prefill MiB | model.generate, prompt_length= MiB "
                  "| model.generate, deferred end MiB |", "|---:|---|---:|---:|---:|---:|"]
        fulls = {r["length"]: r for r in result["rows"] if r["method"] == "full" and "kvpress_peak_bytes" in r}
        for r in result["rows"]:
            base = fulls.get(r["length"])
            if "kvpress_peak_bytes" not in r or base is None:
                continue
            cells = []
            for key in ("kvpress_peak_bytes", "kvtrim_peak_prefill_bytes", "kvtrim_peak_generate_bytes",
                        "kvtrim_peak_generate_deferred_bytes"):
                value, ref = r.get(key), base.get(key)
                cells.append("–" if value is None else f"{value / 2**20:.0f} ({value / ref:.2f})" if ref else
                             f"{value / 2**20:.0f}")
            lines.append(f"| {r['prompt_tokens']} | {r['method']} | " + " | ".join(cells) + " |")
    lines += ["", "Notes:", ""]
    seen = set()
    for r in result["rows"]:
        if r["method"] not in seen:
            seen.add(r["method"])
            lines.append(f"- **{r['method']}**{'' if r['comparable'] else ' †'}: {r['note']}.")
    diffs = [r["full_logits_max_abs_diff"] for r in result["rows"] if "full_logits_max_abs_diff" in r]
    if diffs:
        lines.append(f"- Same model on both sides: the full cache's last-token logits (top 20) differ by at most "
                     f"{max(diffs):.2e} between transformers versions.")
    if result.get("findings"):
        lines += ["", *result["findings"]]
    return "\n".join(lines) + "\n"


def _runner_path(cfg: CompareConfig) -> pathlib.Path:
    if cfg.kvpress_runner:
        return pathlib.Path(cfg.kvpress_runner)
    return pathlib.Path(__file__).resolve().with_name("kvpress_side.py")


# runs the kvpress side as a script without putting its folder (kvtrim/bench, whose module names such as
# `timing` or `memory` could shadow top-level modules) at the front of that interpreter's sys.path
_RUN_BY_PATH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def kvpress_command(python: str | pathlib.Path, runner: str | pathlib.Path, *args: str) -> list[str]:
    """The command line that runs the kvpress side `runner` with the kvpress environment's `python`."""
    return [str(python), "-c", _RUN_BY_PATH, str(runner), *args]


def run_compare(cfg: CompareConfig, out_dir: str | pathlib.Path, command: str = "",
                progress: Callable[[str], None] = print) -> dict:
    import kvtrim
    import transformers

    from kvtrim.bench.summary import write_json
    from kvtrim.passkey import passkey_samples
    from kvtrim.models import load_model, resolve_model_dir

    pairs = [PAIR_BY_NAME[n] for n in cfg.pairs]
    python = pathlib.Path(cfg.kvpress_python)
    check(python.exists(), f"{python} not found: run scripts/kvpress_env.sh first (it makes .venv-kvpress)")
    runner = _runner_path(cfg)
    check(runner.exists(), f"kvpress runner {runner} not found")
    out_dir = pathlib.Path(out_dir)
    exchange = out_dir / "kvpress_exchange"
    exchange.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    threads = torch.get_num_threads()

    model, tok = load_model(cfg.model)
    prompts = []
    for length in cfg.lengths:
        sel = passkey_samples(tok, length, 1, seed=cfg.seed + 1000)[0]
        prompts.append({"id": f"sel{length}", "role": "selection", "length": length,
                        "ids": tok(sel.prompt).input_ids, "key": sel.key})
        for i, s in enumerate(passkey_samples(tok, length, cfg.passkey_trials, seed=cfg.seed)):
            prompts.append({"id": f"pk{length}_{i}", "role": "passkey", "length": length,
                            "ids": tok(s.prompt).input_ids, "key": s.key, "depth": s.depth})
    spec = {"model_dir": str(resolve_model_dir(cfg.model)), "compression_ratio": cfg.compression_ratio,
            "presses": [{"name": p.name, "params": p.press_params} for p in pairs], "prompts": prompts,
            "repeats": cfg.repeats, "new_tokens": cfg.new_tokens, "threads": threads, "seed": cfg.seed}

    def kvpress_side(name: str, **changes) -> dict:
        (exchange / f"{name}_in.json").write_text(json.dumps({**spec, **changes}))
        t0 = time.perf_counter()
        proc = subprocess.run(kvpress_command(python, runner, "--input", str(exchange / f"{name}_in.json"),
                                              "--output", str(exchange / f"{name}_out.json")),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise KvtrimError("the kvpress side failed: " + " | ".join(tail))
        progress(f"kvpress side ({name}) done in {time.perf_counter() - t0:.0f} s")
        return json.loads((exchange / f"{name}_out.json").read_text())

    # selections and answers first, then the timing repeats alternate between the two sides so that
    # changes in machine load hit both alike
    tasks = ["kept", "answers"] + (["peaks"] if cfg.peaks else [])
    theirs = kvpress_side("kept", tasks=tasks)
    ours = kvtrim_kept_and_answers(model, prompts, pairs, cfg)
    if cfg.peaks:
        ours["peaks"] = kvtrim_peaks(model, prompts, pairs, cfg)
    ours["timings"] = []
    progress("kvtrim side: selections and answers done")
    for repeat in range(cfg.repeats):
        theirs["timings"] += kvpress_side(f"time{repeat}", tasks=["timings"], repeats=1, repeat_base=repeat)["timings"]
        ours["timings"] += kvtrim_timings(model, prompts, pairs, cfg, repeat)
        progress(f"timing repeat {repeat + 1}/{cfg.repeats} done on both sides")
    (exchange / "kvtrim.json").write_text(json.dumps(ours))

    rows = compare(prompts, pairs, ours, theirs, lambda ids: tok.decode(ids, skip_special_tokens=True))
    for pid, (index, values) in theirs.get("full_logits", {}).items():
        # the two sides must run the same model: compare the full cache's last-token logits
        diff = max(abs(ours["full_logits"][pid][i] - v) for i, v in zip(index, values))
        for r in rows:
            if r["method"] == "full" and f"sel{r['length']}" == pid:
                r["full_logits_max_abs_diff"] = diff
    ours.pop("full_logits", None)
    result = {
        "schema": SCHEMA,
        "meta": {**asdict(cfg), "command": command, "threads": threads,
                 "kvtrim_env": {"kvtrim": kvtrim.__version__, "transformers": transformers.__version__,
                                "torch": torch.__version__},
                 "kvpress_env": theirs["env"]},
        "rows": rows,
    }
    write_json(result, out_dir / "kvpress_compare.json")
    (out_dir / "kvpress_compare.md").write_text(markdown(result))
    progress(f"wrote {out_dir / 'kvpress_compare.json'} and {out_dir / 'kvpress_compare.md'}")
    return result
