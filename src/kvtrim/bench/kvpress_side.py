"""The kvpress side of `kvtrim bench --vs-kvpress`. Runs inside .venv-kvpress (scripts/kvpress_env.sh):
kvpress 0.5.5 with transformers 4.57; it imports only kvpress, transformers, torch and the standard
library (never kvtrim: it ships inside the kvtrim package only so that an installed kvtrim has it, and is
run by path, not imported as `kvtrim.bench.kvpress_side`, whose package needs transformers 5.x).

    .venv-kvpress/bin/python "$(python -c 'import kvtrim.bench, os; print(os.path.dirname(kvtrim.bench.__file__))')/kvpress_side.py" \
        --input exchange/in.json --output exchange/out.json

Input (written by kvtrim): the model directory (safetensors), the compression ratio, the presses to run,
the prompts as token ids (role "selection": timing and kept indices; role "passkey": answers), the tasks
to do ("kept", "timings", "answers"), repeats (numbered from "repeat_base"), new tokens, torch threads. Output: per press and selection prompt, the kept indices per layer and KV
head (recovered by matching the compressed keys against the keys before compression) and the
timings of each repeat (prefill wall time, time inside `press.compress`), and ("peaks") the peak tensor
memory of the prompt plus one decode step (`TensorPeak`, as kvtrim's side measures it); per passkey prompt,
the greedy answer ids. kvpress compresses during the prefill only; decoding then runs with explicit
position ids continuing from the original length, as its pipeline does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache


def load(model_dir: str):
    """The model in float32 with SDPA. The directory was saved by transformers 5.x, which keeps RoPE's
    theta inside `rope_parameters`; transformers 4.x reads `rope_theta` (and would silently fall back to
    its default 10000), so it is copied over."""
    config = AutoConfig.from_pretrained(model_dir)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        config.rope_theta = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            config.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def build_press(name: str, ratio: float, params: dict):
    """The press called `name` (None = no press: the full cache)."""
    # imported here, so that the helpers below can be tested where kvpress is not installed
    from kvpress import BlockPress, KeyDiffPress, LagKVPress, SnapKVPress, StreamingLLMPress

    if name == "full":
        return None
    if name == "lagkv":
        return LagKVPress(compression_ratio=ratio, n_sink=params.get("n_sink", 4),
                          lag_size=params.get("lag_size", 128))
    if name == "keydiff":
        return KeyDiffPress(compression_ratio=ratio)
    if name == "block_keydiff":
        return BlockPress(press=KeyDiffPress(compression_ratio=ratio), block_size=params.get("block_size", 128))
    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=params.get("window_size", 64),
                           kernel_size=params.get("kernel_size", 5))
    if name == "streaming":
        return StreamingLLMPress(compression_ratio=ratio, n_sink=params.get("n_sink", 4))
    raise SystemExit(f"unknown press '{name}'")


class CompressTimer:
    """Wall time spent inside `press.compress` (an instance attribute shadows the method: no patching)."""

    def __init__(self, press):
        self.seconds = 0.0
        if press is not None:
            inner = press.compress

            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                out = inner(*args, **kwargs)
                self.seconds += time.perf_counter() - t0
                return out

            press.compress = timed
            self._press = press

    def remove(self):
        if hasattr(self, "_press"):
            del self._press.compress


def match_rows(full: torch.Tensor, kept: torch.Tensor) -> list[int]:
    """Indices into `full` `(n, d)` of the rows of `kept` `(k, d)` (exact copies made by a gather)."""
    probe = torch.randn(full.shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    f = full.double() @ probe
    k = kept.double() @ probe
    order = f.argsort()
    pos = torch.searchsorted(f[order], k).clamp(max=full.shape[0] - 1)
    idx = order[pos]
    ok = (full[idx] == kept).all(-1)
    if not bool(ok.all()):  # a projection collision: fall back to exact comparison for those rows
        for i in (~ok).nonzero().flatten().tolist():
            hits = (full == kept[i]).all(-1).nonzero().flatten()
            if len(hits) == 0:
                raise RuntimeError("a kept key has no exact match before compression")
            idx[i] = hits[0]
    return sorted(idx.tolist())


class KeptRecorder:
    """Forward hooks around the press hooks: the first (registered before the press) keeps a reference
    to each layer's keys before compression, the second (after) reads the compressed keys."""

    def __init__(self, model):
        self.model = model
        self.before: dict[int, torch.Tensor] = {}
        self.kept: dict[int, list[list[int]]] = {}
        self.handles = []

    def _layers(self):
        return self.model.model.layers

    def add_before(self):
        for layer in self._layers():
            self.handles.append(layer.self_attn.register_forward_hook(self._before, with_kwargs=True))

    def add_after(self):
        for layer in self._layers():
            self.handles.append(layer.self_attn.register_forward_hook(self._after, with_kwargs=True))

    def _before(self, module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        self.before[module.layer_idx] = cache.layers[module.layer_idx].keys

    def _after(self, module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        full = self.before.pop(module.layer_idx)
        kept = cache.layers[module.layer_idx].keys
        self.kept[module.layer_idx] = [match_rows(full[0, h], kept[0, h]) for h in range(kept.shape[1])]

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


@torch.no_grad()
def prefill(model, ids: torch.Tensor, press, record: bool = False):
    """Prefill `ids` under `press`; returns (last logits, cache, prefill seconds, compress seconds, kept)."""
    cache = DynamicCache()
    timer = CompressTimer(press)
    recorder = KeptRecorder(model) if record else None
    try:
        if recorder:
            recorder.add_before()
        with press(model) if press is not None else contextlib.nullcontext():
            if recorder:
                recorder.add_after()  # after the press's hooks, so it records what the press kept
            t0 = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            seconds = time.perf_counter() - t0
    finally:
        timer.remove()
        if recorder:
            recorder.remove()
    kept = [recorder.kept[i] for i in sorted(recorder.kept)] if recorder else None
    return out.logits[:, -1], cache, seconds, timer.seconds, kept


@torch.no_grad()
def greedy(model, cache, logits: torch.Tensor, start: int, new_tokens: int) -> list[int]:
    """Greedy decoding with explicit positions from the original length (as kvpress's pipeline does)."""
    token = logits.argmax(-1, keepdim=True)
    out = [int(token)]
    for i in range(new_tokens - 1):
        pos = torch.tensor([[start + i]])
        logits = model(input_ids=token, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        out.append(int(token))
    return out


def tensor_peak():
    """`kvtrim.bench.memory.TensorPeak`, loaded from its file next to this one: that module needs only torch,
    while importing the kvtrim package would need transformers 5.x (the same measurement on both sides)."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().with_name("memory.py")
    spec = importlib.util.spec_from_file_location("kvtrim_bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module.TensorPeak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    import kvpress

    spec = json.loads(open(args.input).read())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec.get("seed", 0))
    model = load(spec["model_dir"])
    ratio = spec["compression_ratio"]
    presses = spec["presses"]  # [{"name": ..., "params": {...}}]
    prompts = spec["prompts"]
    selection = [p for p in prompts if p["role"] == "selection"]
    passkey = [p for p in prompts if p["role"] == "passkey"]
    result = {
        "env": {"kvpress": getattr(kvpress, "__version__", "0.5.5"), "transformers": transformers.__version__,
                "torch": torch.__version__, "python": platform.python_version(),
                "torch_threads": torch.get_num_threads()},
        "rope_theta": getattr(model.config, "rope_theta", None),
        "kept": {}, "timings": [], "answers": [], "full_logits": {},
    }

    tasks = spec.get("tasks", ["kept", "timings", "answers"])
    # kept indices: one untimed pass per press and selection prompt (it also warms up)
    for p in selection if "kept" in tasks else []:
        ids = torch.tensor([p["ids"]])
        for pr in presses:
            logits, _, _, _, kept = prefill(model, ids, build_press(pr["name"], ratio, pr.get("params", {})),
                                            record=True)
            result["kept"][f"{pr['name']}@{p['id']}"] = kept
            if pr["name"] == "full":  # same model on both sides? kvtrim compares these last-token logits
                top = logits[0].topk(20)
                result["full_logits"][p["id"]] = [top.indices.tolist(), top.values.tolist()]
    # timings: interleaved, the press order rotating by one each repeat
    if "timings" in tasks and "kept" not in tasks:  # warm up: one untimed prefill per press
        ids = torch.tensor([selection[0]["ids"]])
        for pr in presses:
            prefill(model, ids, build_press(pr["name"], ratio, pr.get("params", {})))
    first = spec.get("repeat_base", 0)
    for repeat in range(first, first + spec["repeats"]) if "timings" in tasks else []:
        for p in selection:
            ids = torch.tensor([p["ids"]])
            k = repeat % len(presses)
            for pr in presses[k:] + presses[:k]:
                _, _, seconds, compress, _ = prefill(model, ids, build_press(pr["name"], ratio, pr.get("params", {})))
                result["timings"].append({"press": pr["name"], "prompt": p["id"], "repeat": repeat,
                                          "prefill_s": seconds, "compress_s": compress})
    # peak tensor memory: the prompt (compressed by the press inside its forward) and one greedy decode step
    TensorPeak = tensor_peak() if "peaks" in tasks else None
    for p in selection if "peaks" in tasks else []:
        ids = torch.tensor([p["ids"]])
        for pr in presses:
            press = build_press(pr["name"], ratio, pr.get("params", {}))
            with TensorPeak("cpu") as mem:
                logits, cache, _, _, _ = prefill(model, ids, press)
                greedy(model, cache, logits, ids.shape[-1], 2)
                del cache, logits
            result.setdefault("peaks", []).append({"press": pr["name"], "prompt": p["id"],
                                                   "peak_bytes": mem.reading.peak_bytes})
    # passkey answers
    for p in passkey if "answers" in tasks else []:
        ids = torch.tensor([p["ids"]])
        for pr in presses:
            logits, cache, _, _, _ = prefill(model, ids, build_press(pr["name"], ratio, pr.get("params", {})))
            tokens = greedy(model, cache, logits, ids.shape[-1], spec["new_tokens"])
            result["answers"].append({"press": pr["name"], "prompt": p["id"], "tokens": tokens})
    with open(args.output, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
