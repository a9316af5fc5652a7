"""The eviction cost work (issue #15) changed how KeyDiff, LagKV, the shared top-k and the cache's row
gather compute, not what they select: against copies of the implementations they replaced (kept below
as the slow references), the scores are the same bits and the kept sets the same positions, for every
method that uses them, in prefill and over hundreds of decode steps, on tiny random models, on random
keys full of ties and duplicates, and on the real default model."""

from __future__ import annotations

import sys

import pytest
import torch

import kvtrim
from kvtrim.bench.runner import decode, prefill_schedule
from kvtrim.cache import TrimCache, TrimLayer, flat_rows
from kvtrim.methods.base import Phase, _top_by_sort, _top_by_threshold, top_indices
from kvtrim.methods.keydiff import KeyDiff, keydiff_keep, keydiff_scores
from kvtrim.methods.lagkv import lag_relative_scores
from kvtrim.specs import parse_method_spec
from conftest import tiny_model


# ---- the implementations as they were before (main b2a9c15), verbatim in substance ----------------------
def keydiff_scores_before(keys, eps=1e-12):
    k = keys.float()
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(eps)
    anchor = unit.mean(dim=-2, keepdim=True)
    anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(eps)
    return -(unit * anchor).sum(dim=-1)


def top_indices_before(scores, k):
    n = scores.shape[-1]
    if n < 1024 and k < n:
        return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
    positions = torch.arange(n, device=scores.device).expand_as(scores)
    if k >= n:
        return positions
    threshold = scores.kthvalue(n - k, dim=-1, keepdim=True).values
    above = scores > threshold
    tied = scores == threshold
    missing = k - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (tied.cumsum(dim=-1) <= missing))
    slot = (keep.cumsum(dim=-1) - 1).masked_fill(~keep, k)
    out = torch.empty(*scores.shape[:-1], k + 1, dtype=torch.long, device=scores.device)
    return out.scatter_(-1, slot, positions)[..., :k]


def _channel_std_before(x):
    centered = x - x.mean(dim=-1, keepdim=True)
    return (centered.square().sum(dim=-1) / (x.shape[-1] - 1)).sqrt()


def lag_relative_scores_before(keys, values, lag_size, value_weight=1.0, eps=1e-6):
    b, h, n, d = keys.shape
    parts = n // lag_size

    def component(x):
        x = x.float().view(b, h, parts, lag_size, -1)
        ref = x[:, :, 1:]
        lo = ref.amin(dim=-2, keepdim=True)
        hi = ref.amax(dim=-2, keepdim=True)
        normed = (x[:, :, :-1] - lo) / (hi - lo).clamp_min(eps)
        return _channel_std_before(normed).softmax(dim=-1)

    scores = component(keys)
    if value_weight:
        scores = scores + value_weight * component(values)
    return scores


def flat_rows_before(keep, n):
    b, h, _ = keep.shape
    return (keep + n * torch.arange(b * h, device=keep.device).view(b, h, 1)).flatten()


def stable_sort_top(scores, k):
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values


class Calls:
    """The references patched into every module that uses them, with call counts (a comparison whose
    reference never ran would prove nothing)."""

    def __init__(self, monkeypatch):
        self.count: dict[str, int] = {}
        replaced = {"top_indices": top_indices_before, "keydiff_scores": keydiff_scores_before,
                    "lag_relative_scores": lag_relative_scores_before, "flat_rows": flat_rows_before}
        for name, module in list(sys.modules.items()):
            if not name.startswith("kvtrim"):
                continue
            for attr, ref in replaced.items():
                if getattr(module, attr, None) is not None and callable(getattr(module, attr)):
                    monkeypatch.setattr(module, attr, self._counted(attr, ref))

    def _counted(self, name, fn):
        def wrapper(*args, **kwargs):
            self.count[name] = self.count.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper


# ---- pure functions: the same bits ------------------------------------------------------------------------
def _keys(seed: int, shape, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 10
    if kind == "levels":  # few distinct values: duplicate keys, tied scores
        return torch.randint(-2, 3, shape, generator=g).float()
    if kind == "aligned":  # keys close to one direction, as real keys are: scores crowd together
        return torch.randn(shape[-1], generator=g) * 4 + torch.randn(shape, generator=g) * 0.05
    keys = torch.randn(shape, generator=g)
    keys[..., 3, :] = 0  # a zero key (norm clamped)
    keys[..., 7, :] = keys[..., 2, :]  # an exact duplicate
    return keys


@pytest.mark.parametrize("kind", ["gauss", "levels", "aligned", "special"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_keydiff_scores_are_the_same_bits(kind, dtype):
    for seed, shape in enumerate([(1, 3, 1147, 64), (2, 2, 37, 16), (1, 1, 9, 128), (1, 4, 300, 32)]):
        keys = _keys(seed, shape, kind).to(dtype)
        assert torch.equal(keydiff_scores(keys), keydiff_scores_before(keys))
        assert keydiff_scores(keys).dtype == torch.float32


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1023, 1024, 1147, 3000])
@pytest.mark.parametrize("levels", [0, 2, 5, 1000])  # 0 = continuous; small = heavy ties
def test_top_indices_equals_its_predecessor_and_a_stable_sort(n, levels):
    g = torch.Generator().manual_seed(n * 7 + levels)
    for trial in range(4):
        if levels:
            scores = torch.randint(0, levels, (2, 3, n), generator=g).float()
        else:
            scores = torch.randn(2, 3, n, generator=g)
        if trial == 1:
            scores[..., : min(3, n)] = float("inf")  # protected entries, as keep_top marks them
        if trial == 2:
            scores = scores * 0  # all ties, and signed zeros: -0.0 == 0.0 must tie
            scores[0, 0, n // 2] = -0.0
        if trial == 3:
            scores = scores[:, 1:, :]  # a non-contiguous slice
        for k in sorted({0, 1, n // 3, n // 2, n - 1, n, n + 3}):
            got = top_indices(scores, k)
            assert torch.equal(got, top_indices_before(scores, k)), (k, trial)
            assert torch.equal(got, stable_sort_top(scores, min(k, n)))


def slow_top(scores, k):
    """The definition, one row at a time in Python: the `k` best, ties to the earlier entry, in order."""
    rows = []
    for row in scores.reshape(-1, scores.shape[-1]).tolist():
        rows.append(sorted(sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]))
    return torch.tensor(rows, dtype=torch.long).view(*scores.shape[:-1], k)


@pytest.mark.parametrize("kind", ["gauss", "levels", "aligned", "special"])
@pytest.mark.parametrize("n_keep", [1019, 1024, 1])
def test_keydiff_block_eviction_keeps_what_the_definition_keeps(kind, n_keep):
    """One block-wise eviction at SmolLM2's layer shape (1019 or 1024 kept of 1147 candidates): the kept
    indices equal the slow definition (Python sort of the previous float32 scores, ties to the earlier
    entry), with protected entries too."""
    keys = _keys(11, (1, 3, 1147, 64), kind)
    scores = keydiff_scores_before(keys)
    assert torch.equal(keydiff_keep(keys, n_keep), slow_top(scores, n_keep))
    protected = scores.clone()
    protected[..., :4] = float("inf")  # sink_size=4, recent_size=16: kept first, ties go to the earliest
    protected[..., -16:] = float("inf")
    want = slow_top(protected, n_keep)
    assert torch.equal(keydiff_keep(keys, n_keep, sink_size=4, recent_size=16), want)


@pytest.mark.parametrize("n", [5, 300, 1024, 2049])
def test_the_other_device_paths_agree_with_a_stable_sort(n):
    """`_top_by_sort` and `_top_by_threshold` are what non-CPU devices (and CPU ties) use: run them here."""
    g = torch.Generator().manual_seed(n)
    for scores in (torch.randn(2, 2, n, generator=g), torch.randint(0, 3, (2, 2, n), generator=g).float()):
        for k in sorted({1, n // 2, n - 1}):
            want = stable_sort_top(scores, k)
            assert torch.equal(_top_by_sort(scores, k), want)
            assert torch.equal(_top_by_threshold(scores, k), want)


@pytest.mark.parametrize("value_weight", [1.0, 0.5, 0.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lag_relative_scores_are_the_same_bits(value_weight, dtype):
    for seed, (h, parts, lag, d) in enumerate([(3, 31, 128, 64), (2, 4, 16, 8), (1, 2, 3, 5)]):
        g = torch.Generator().manual_seed(seed)
        keys = torch.randn(1, h, parts * lag, d, generator=g)
        values = torch.randn(1, h, parts * lag, d, generator=g)
        keys[..., 1] = 0.25  # a constant channel (zero range, clamped)
        values[0, 0, :lag] = -0.0
        values[0, -1, lag:] = torch.randint(0, 2, (parts * lag - lag, d), generator=g).float()  # ties
        keys, values = keys.to(dtype), values.to(dtype)
        got = lag_relative_scores(keys, values, lag, value_weight)
        assert torch.equal(got, lag_relative_scores_before(keys, values, lag, value_weight))
        assert got.shape == (1, h, parts - 1, lag) and got.dtype == torch.float32


def test_lag_relative_scores_leave_their_inputs_alone():
    keys, values = torch.randn(1, 2, 48, 8), torch.randn(1, 2, 48, 8)
    k0, v0 = keys.clone(), values.clone()
    lag_relative_scores(keys[:, :, 16:], values[:, :, 16:], 16)  # a slice, as LagKV passes it
    assert torch.equal(keys, k0) and torch.equal(values, v0)


def test_keydiff_scores_leave_their_input_alone():
    keys = torch.randn(1, 2, 40, 8)
    k0 = keys.clone()
    keydiff_scores(keys)
    assert torch.equal(keys, k0)


def test_flat_rows_are_unchanged():
    g = torch.Generator().manual_seed(0)
    for b, h, n, k in [(1, 3, 1147, 1019), (2, 2, 10, 4), (3, 1, 5, 5)]:
        keep = torch.rand(b, h, n, generator=g).argsort(dim=-1)[..., :k].sort(dim=-1).values
        assert torch.equal(flat_rows(keep, n), flat_rows_before(keep, n))
        assert torch.equal(flat_rows(keep[:, :, ::2], n), flat_rows_before(keep[:, :, ::2], n))  # strided


# ---- whole runs: the same kept positions after every forward --------------------------------------------
def _record(model, spec: str, ids: torch.Tensor, steps: int) -> tuple[list, TrimCache]:
    method = parse_method_spec(spec).build()
    cache = TrimCache(method, config=model.config)
    sizes, _ = prefill_schedule(method, ids.shape[-1])
    history = []

    def snapshot():
        history.append([layer.positions.clone() for layer in cache.trim_layers()])

    with torch.no_grad():
        logits = kvtrim.prefill(model, ids, cache, chunk_sizes=sizes)
        snapshot()
        tokens = decode(model, cache, logits, steps, each_step=snapshot)
    history.append(tokens)
    return history, cache


def _same(a, b):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), "generated tokens differ"
        else:
            assert all(torch.equal(p, q) for p, q in zip(x, y)), f"kept positions differ after forward {step}"


SPECS = [
    # KeyDiff: block-wise budget mode (prefill blocks, decode evictions every block_size steps), with
    # and without protected entries; ratio mode (once at the prompt's end)
    ("keydiff:budget=40:block_size=16", "keydiff_scores"),
    ("keydiff:budget=40:block_size=16:sink_size=2:recent_size=5", "keydiff_scores"),
    ("keydiff:compression_ratio=0.6", "keydiff_scores"),
    # LagKV: reference mode (prefill and every lag_size decode steps), global-budget mode
    ("lagkv:lag_size=16:sink_size=4", "lag_relative_scores"),
    ("lagkv:lag_size=16:sink_size=4:compression_ratio=0.5", "top_indices"),
    # everything else that selects with the shared top-k
    ("h2o:budget=48", "top_indices"),
    ("tova:budget=48", None),
    ("snapkv:budget=48:window=8", "top_indices"),
    ("lazyeviction:budget=48:window=16", "top_indices"),
    ("knorm:budget=48", "top_indices"),
    ("streaming:budget=48", None),
]


@pytest.mark.parametrize("spec,reference", SPECS, ids=[s for s, _ in SPECS])
def test_tiny_model_runs_keep_the_same_positions_as_before(spec, reference, monkeypatch):
    model = kvtrim.enable(tiny_model("llama", layers=2, kv_heads=2, head_dim=16))
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(1))
    ours, cache = _record(model, spec, ids, steps=200)
    assert sum(layer.evictions for layer in cache.trim_layers()) > 0  # the comparison covers evictions
    calls = Calls(monkeypatch)
    before, _ = _record(model, spec, ids, steps=200)
    if reference:
        assert calls.count.get(reference, 0) > 0, f"{reference} was not used by {spec}"
    _same(ours, before)


@pytest.mark.parametrize("kind", ["levels", "special", "aligned"])
@pytest.mark.parametrize("protect", [(0, 0), (3, 4)])
def test_keydiff_layer_replay_with_ties_matches_before(kind, protect, monkeypatch):
    """Random keys with duplicates and tied scores through one cache layer: blocks, then 300 decode
    steps (an eviction every block_size steps); positions and stored keys compared after every update."""
    b, h, d, budget, block = 1, 3, 8, 48, 16
    keys = _keys(5, (b, h, 200 + 300, d), kind)

    def replay():
        layer = TrimLayer(KeyDiff(budget=budget, block_size=block, sink_size=protect[0], recent_size=protect[1]), 0)
        out = []
        for s in range(0, 200, block):
            layer.update(keys[:, :, s : s + block], keys[:, :, s : s + block] * 2)
            out.append((layer.positions.clone(), layer.keys.clone()))
        for s in range(200, 500):
            layer.update(keys[:, :, s : s + 1], keys[:, :, s : s + 1] * 2)
            out.append((layer.positions.clone(), layer.keys.clone()))
        assert layer._forward[0] is Phase.DECODE and layer.evictions > 20
        return out

    ours = replay()
    calls = Calls(monkeypatch)
    before = replay()
    assert calls.count["keydiff_scores"] > 20 and calls.count["top_indices"] > 20
    for step, ((p, k), (q, kk)) in enumerate(zip(ours, before)):
        assert torch.equal(p, q) and torch.equal(k, kk), f"update {step}"


@pytest.mark.integration
def test_real_model_keydiff_and_lagkv_keep_the_same_positions_as_before(smollm, monkeypatch):
    """Real keys (SmolLM2-135M, 30 layers, a passkey prompt): block-wise KeyDiff at block 128 with 96
    evictions per layer over prefill and decode, and LagKV, select the same entries as before."""
    model, tok = smollm
    from kvtrim.bench.runner import prompt_ids

    ids = prompt_ids(tok, 1500, seed=3)
    runs = {}
    for spec in ("keydiff:budget=256", "keydiff:budget=512:block_size=64", "lagkv:sink_size=4:lag_size=64"):
        runs[spec] = _record(kvtrim.enable(model), spec, ids, steps=130)[0]
    Calls(monkeypatch)
    for spec, ours in runs.items():
        _same(ours, _record(model, spec, ids, steps=130)[0])
