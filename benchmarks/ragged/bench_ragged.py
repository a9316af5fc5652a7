"""Micro-benchmark of the ragged storage and attention (`kvtrim.storage`, `kvtrim.ragged_attention`) on CPU.

    PYTHONPATH=src python benchmarks/ragged/bench_ragged.py --output benchmarks/ragged/results.json

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64), float32, `torch.set_num_threads(2)`
(`--threads`).
Every comparison alternates its two sides repetition by repetition inside one run and reports medians
and the median ratio, so load on the (shared) machine hits both sides alike. Sections:

* `attention`: at equal row lengths, one decode step (q = 1) and one 128-token block, on caches of 1k and
  4k entries, batch 1 and 8. "dense" is today's path: `torch.cat` of the new entries (the dense layer's
  `update`) + transformers' `sdpa_attention_forward` with the mask transformers builds (None for a decode
  step, the causal block mask for a 128-token block). "ragged" is `RaggedKV.append` + `ragged_attention`
  (a padded view gathered from the pool + a mask + SDPA), from storage in the state it has during decoding
  (slots out of order after evictions, so the view needs its gather). `attention_only` times exclude the
  cache update on both sides.
* `eviction`: evict 1 entry per row / half of every row, today's gather of the whole layer
  (`flat_rows` + `select_rows` + positions gather from `kvtrim.cache`) vs `RaggedKV.evict`; and one decode
  step's bookkeeping at a fixed budget (append 1 + evict 1 per row): `torch.cat` + gather vs the slot pool.
* `layout`: why slots and not pages: building the padded view by gathering slots vs pages of 16 entries
  (same bytes), and the bytes a pool of 16-entry pages would allocate for rows of AdaKV-like lengths
  (measured from the pool tensor's storage) vs the slot pool.
* `flex`: FlexAttention (compiled, static shapes: one compile per shape, reported apart) incl.
  `create_block_mask` per step, against the ragged SDPA path on the same view; and whether compiling with
  dynamic shapes works.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from kvtrim.cache import flat_rows, select_rows
from kvtrim.ragged_attention import ragged_attention
from kvtrim.storage import RaggedKV

HQ, HKV, D = 9, 3, 64
DTYPE = torch.float32


class Module(torch.nn.Module):
    """What `sdpa_attention_forward` reads from an attention module."""

    num_key_value_groups = HQ // HKV
    is_causal = True


MODULE = Module()


def pair(fa, fb, repeats: int, setup_a=None, setup_b=None) -> dict:
    """Median seconds of `fa` and `fb`, alternated; `setup_*` (untimed) returns the argument of each call."""
    ta, tb, ratios = [], [], []
    for i in range(repeats + 1):
        args_a = setup_a() if setup_a else None
        t0 = time.perf_counter()
        fa(args_a)
        t1 = time.perf_counter()
        args_b = setup_b() if setup_b else None
        t2 = time.perf_counter()
        fb(args_b)
        t3 = time.perf_counter()
        if i:  # the first round warms up
            ta.append(t1 - t0)
            tb.append(t3 - t2)
            ratios.append((t3 - t2) / (t1 - t0))
    return {"a_ms": 1e3 * statistics.median(ta), "b_ms": 1e3 * statistics.median(tb),
            "ratio_b_over_a": statistics.median(ratios), "repeats": repeats,
            # minimums: the least disturbed repetition, a second view when the shared machine is loaded
            "a_min_ms": 1e3 * min(ta), "b_min_ms": 1e3 * min(tb), "ratio_of_minimums": min(tb) / min(ta)}


def steady_storage(b: int, n: int, seed: int) -> RaggedKV:
    """Storage with `n` entries per row whose slots are out of order, as after decode-time evictions."""
    g = torch.Generator().manual_seed(seed)
    extra = max(1, n // 100)  # evict 1 % at random: free slots inside the pool, no compaction
    store = RaggedKV.from_dense(torch.randn(b, HKV, n + extra, D, generator=g),
                                torch.randn(b, HKV, n + extra, D, generator=g))
    scores = torch.rand(b, HKV, n + extra, generator=g)
    keep = scores.topk(n, dim=-1).indices.sort(-1).values
    store.evict(keep)
    return store


def bench_attention(repeats: int) -> list[dict]:
    rows = []
    for b in (1, 8):
        for n in (1024, 4096):
            for q in (1, 128):
                g = torch.Generator().manual_seed(n + q + b)
                keys, values = torch.randn(b, HKV, n, D, generator=g), torch.randn(b, HKV, n, D, generator=g)
                new_k, new_v = torch.randn(b, HKV, q, D, generator=g), torch.randn(b, HKV, q, D, generator=g)
                query = torch.randn(b, HQ, q, D, generator=g)
                mask = sdpa_mask(batch_size=b, q_length=q, kv_length=n + q, q_offset=n, kv_offset=0, device="cpu")
                store = steady_storage(b, n, seed=n + q)
                qpos = torch.arange(2 * n, 2 * n + q).expand(b, q)  # after every stored position
                scale = D ** -0.5
                full_k, full_v = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
                grown = store.clone()
                grown.append(new_k, new_v, qpos)

                def dense_step(_):
                    k, v = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
                    sdpa_attention_forward(MODULE, query, k, v, mask, scaling=scale)

                def ragged_step(s):
                    s.append(new_k, new_v, qpos)
                    ragged_attention(query, s, qpos, scaling=scale)

                step = pair(dense_step, ragged_step, repeats, setup_b=store.clone)
                att = pair(lambda _: sdpa_attention_forward(MODULE, query, full_k, full_v, mask, scaling=scale),
                           lambda _: ragged_attention(query, grown, qpos, scaling=scale), repeats)
                # exactness at equal lengths (same entries in the same order in both caches)
                view = grown.padded()
                dense_out, _ = sdpa_attention_forward(MODULE, query, view.keys, view.values, mask, scaling=scale)
                diff = (ragged_attention(query, view, qpos, scaling=scale) - dense_out).abs().max().item()
                rows.append({"batch": b, "cache_entries": n, "new_tokens": q,
                             "step_dense_ms": step["a_ms"], "step_ragged_ms": step["b_ms"],
                             "step_ratio_ragged_over_dense": step["ratio_b_over_a"],
                             "attention_only_dense_ms": att["a_ms"], "attention_only_ragged_ms": att["b_ms"],
                             "attention_only_ratio": att["ratio_b_over_a"], "max_abs_diff": diff,
                             "step_ratio_of_minimums": step["ratio_of_minimums"],
                             "attention_only_ratio_of_minimums": att["ratio_of_minimums"],
                             "repeats": repeats})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_eviction(repeats: int) -> list[dict]:
    rows = []
    for b in (1, 8):
        for n in (1024, 4096):
            g = torch.Generator().manual_seed(b * n)
            keys, values = torch.randn(b, HKV, n, D, generator=g), torch.randn(b, HKV, n, D, generator=g)
            positions = torch.arange(n).expand(b, HKV, n).contiguous()
            store = RaggedKV.from_dense(keys, values)
            for what, k in (("evict_1_per_row", n - 1), ("evict_half", n // 2)):
                keep = torch.rand(b, HKV, n, generator=g).topk(k, dim=-1).indices.sort(-1).values

                def dense(_):
                    rows_ = flat_rows(keep, n)
                    select_rows(keys, rows_, k), select_rows(values, rows_, k), positions.gather(2, keep)

                r = pair(dense, lambda s: s.evict(keep), repeats, setup_b=store.clone)
                rows.append({"batch": b, "cache_entries": n, "what": what, "dense_gather_ms": r["a_ms"],
                             "ragged_ms": r["b_ms"], "ratio_ragged_over_dense": r["ratio_b_over_a"],
                             "ratio_of_minimums": r["ratio_of_minimums"], "repeats": repeats})
                print(json.dumps(rows[-1]), flush=True)
            # one decode step of bookkeeping at a fixed budget: append 1 entry and evict 1 per row
            new_k, new_v = torch.randn(b, HKV, 1, D, generator=g), torch.randn(b, HKV, 1, D, generator=g)
            drop = torch.randint(0, n, (b, HKV, 1), generator=g)
            keep_idx = torch.arange(n + 1).expand(b, HKV, n + 1)
            keep_idx = keep_idx[torch.ones(b, HKV, n + 1, dtype=torch.bool).scatter(2, drop, False)].view(b, HKV, n)
            steady = steady_storage(b, n, seed=b + n)
            steady.append(new_k, new_v, torch.full((b, 1), 10 * n))
            steady.evict(keep_idx)  # now in the steady state: free slots = one per row + headroom

            def dense_budget(_):
                k2, v2 = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
                p2 = torch.cat([positions, torch.full((b, HKV, 1), n)], 2)
                rows_ = flat_rows(keep_idx, n + 1)
                select_rows(k2, rows_, n), select_rows(v2, rows_, n), p2.gather(2, keep_idx)

            def ragged_budget(s):
                s.append(new_k, new_v, torch.full((b, 1), 10 * n + 1))
                s.evict(keep_idx)

            r = pair(dense_budget, ragged_budget, repeats, setup_b=steady.clone)
            rows.append({"batch": b, "cache_entries": n, "what": "decode_step_at_budget_append1_evict1",
                         "dense_gather_ms": r["a_ms"], "ragged_ms": r["b_ms"],
                         "ratio_ragged_over_dense": r["ratio_b_over_a"], "ratio_of_minimums": r["ratio_of_minimums"],
                         "repeats": repeats})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_layout(repeats: int) -> dict:
    gathers = []
    for b, n in ((1, 1024), (8, 1024), (8, 4096)):
        total = b * HKV * n
        pool = torch.randn(total, D)
        slots = torch.randperm(total)
        pages = torch.randperm(total // 16)
        page_pool = pool.view(total // 16, 16 * D)
        r = pair(lambda _: pool.index_select(0, slots).view(b, HKV, n, D),
                 lambda _: page_pool.index_select(0, pages).view(b, HKV, n, D), repeats)
        gathers.append({"batch": b, "entries_per_row": n, "slot_gather_ms": r["a_ms"], "page16_gather_ms": r["b_ms"],
                        "ratio_page_over_slot": r["ratio_b_over_a"], "repeats": repeats})
        print(json.dumps(gathers[-1]), flush=True)
    waste = []
    g = torch.Generator().manual_seed(0)
    for budget in (64, 128, 256, 1024):
        for b in (1, 8):
            # AdaKV-like: per-head lengths spread around the budget (0.5x to 1.5x), same total
            lengths = (budget * (0.5 + torch.rand(b, HKV, generator=g))).long()
            ideal = int(lengths.sum()) * D * 2 * 4
            pages = int((lengths + 15).div(16, rounding_mode="floor").sum())
            page_pool = torch.empty(pages * 16, D), torch.empty(pages * 16, D)
            page_bytes = sum(t.untyped_storage().nbytes() for t in page_pool)
            store = RaggedKV.from_dense(torch.randn(b, HKV, int(lengths.max()), D), torch.randn(b, HKV, int(lengths.max()), D),
                                        valid=torch.arange(int(lengths.max())) < lengths[..., None])
            waste.append({"budget": budget, "batch": b, "ideal_bytes": ideal, "page16_bytes": page_bytes,
                          "page16_over_ideal": page_bytes / ideal, "slot_pool_bytes": store.allocated_bytes(),
                          "slot_over_ideal": store.allocated_bytes() / ideal})
            print(json.dumps(waste[-1]), flush=True)
    return {"view_gather": gathers, "allocation": waste}


def bench_flex(repeats: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    out = {"rows": []}
    # dynamic shapes (what per-step widths need): a prompt block, an appended block, decode steps
    dyn = torch.compile(flex_attention, dynamic=True)
    out["dynamic_compile"] = []
    for b, q, w in ((2, 12, 12), (2, 5, 17), (2, 1, 18), (1, 1, 1000), (1, 1, 1001)):
        query, keys, values = torch.randn(b, HQ, q, D), torch.randn(b, HKV, w, D), torch.randn(b, HKV, w, D)
        valid = torch.ones(b, HKV, w, dtype=torch.bool)
        try:
            bm = create_block_mask(lambda bi, h, qi, ki: valid[bi, h // 3, ki], b, HQ, q, w, device="cpu")
            dyn(query, keys, values, block_mask=bm, enable_gqa=True)
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, not raised: the outcome is the finding
            lines = [line for line in str(e).splitlines() if "error:" in line] or str(e).splitlines()[:1]
            outcome = f"{type(e).__name__}: {lines[0].split('error:')[-1].strip()[:160]}"
        out["dynamic_compile"].append({"batch": b, "new_tokens": q, "width": w, "outcome": outcome})
        print("flex dynamic:", out["dynamic_compile"][-1], flush=True)
    static = torch.compile(flex_attention, dynamic=False)
    for b in (1, 8):
        for q in (1, 128):
            n = 1024
            store = steady_storage(b, n, seed=b + q)
            g = torch.Generator().manual_seed(q)
            qpos = torch.arange(2 * n, 2 * n + q).expand(b, q)
            store.append(torch.randn(b, HKV, q, D, generator=g), torch.randn(b, HKV, q, D, generator=g), qpos)
            view = store.padded()
            query = torch.randn(b, HQ, q, D, generator=g)

            def mask_mod(bi, h, qi, ki):
                kh = h // (HQ // HKV)
                return view.valid[bi, kh, ki] & (view.positions[bi, kh, ki] <= qpos[bi, qi])

            def flex(_):
                bm = create_block_mask(mask_mod, b, HQ, q, view.width, device="cpu")
                return static(query, view.keys, view.values, block_mask=bm, enable_gqa=True)

            t0 = time.perf_counter()
            got = flex(None)
            compile_s = time.perf_counter() - t0
            want = ragged_attention(query, view, qpos)
            diff = (got.transpose(1, 2) - want).abs().max().item()
            r = pair(lambda _: ragged_attention(query, view, qpos), flex, repeats)
            bm_only = pair(lambda _: None, lambda _: create_block_mask(mask_mod, b, HQ, q, view.width, device="cpu"),
                           repeats)
            out["rows"].append({"batch": b, "cache_entries": n, "new_tokens": q, "sdpa_view_ms": r["a_ms"],
                                "flex_ms": r["b_ms"], "ratio_flex_over_sdpa": r["ratio_b_over_a"],
                                "create_block_mask_ms": bm_only["b_ms"], "first_call_s": compile_s,
                                "max_abs_diff": diff, "repeats": repeats})
            print(json.dumps(out["rows"][-1]), flush=True)
    return out


def report(result: dict, md_path: Path, png_path: Path) -> None:
    """Markdown tables (benchmarks/ragged/README.md's numbers) and one figure, from the results JSON."""
    lines = [f"Command: `{result['command']}`  ", f"Environment: {json.dumps(result['environment'])}", "",
             "### Attention at equal lengths (ms, medians; ratio = median of per-repetition ratios)", "",
             "| batch | cache | new tokens | dense step | ragged step | ratio | ratio of minimums | dense attention only | ragged attention only | ratio | ratio of minimums | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["attention"]:
        lines.append(f"| {r['batch']} | {r['cache_entries']} | {r['new_tokens']} | {r['step_dense_ms']:.3f} | "
                     f"{r['step_ragged_ms']:.3f} | {r['step_ratio_ragged_over_dense']:.2f} | "
                     f"{r['step_ratio_of_minimums']:.2f} | "
                     f"{r['attention_only_dense_ms']:.3f} | {r['attention_only_ragged_ms']:.3f} | "
                     f"{r['attention_only_ratio']:.2f} | {r['attention_only_ratio_of_minimums']:.2f} | "
                     f"{r['max_abs_diff']:.1e} |")
    lines += ["", "### Eviction (ms, medians)", "", "| batch | cache | what | dense gather | ragged | ratio | ratio of minimums |",
              "|---|---|---|---|---|---|---|"]
    for r in result["eviction"]:
        lines.append(f"| {r['batch']} | {r['cache_entries']} | {r['what']} | {r['dense_gather_ms']:.3f} | "
                     f"{r['ragged_ms']:.3f} | {r['ratio_ragged_over_dense']:.2f} | {r['ratio_of_minimums']:.2f} |")
    lines += ["", "### Layout: building the padded view (ms) and bytes allocated", "",
              "| batch | entries per row | slot gather | page-16 gather | ratio |", "|---|---|---|---|---|"]
    for r in result["layout"]["view_gather"]:
        lines.append(f"| {r['batch']} | {r['entries_per_row']} | {r['slot_gather_ms']:.3f} | "
                     f"{r['page16_gather_ms']:.3f} | {r['ratio_page_over_slot']:.2f} |")
    lines += ["", "| budget | batch | page-16 pool / ideal | slot pool / ideal |", "|---|---|---|---|"]
    for r in result["layout"]["allocation"]:
        lines.append(f"| {r['budget']} | {r['batch']} | {r['page16_over_ideal']:.3f} | {r['slot_over_ideal']:.3f} |")
    if "flex" in result:
        lines += ["", "### FlexAttention (compiled, static shapes) vs the SDPA path on the same view (ms)", "",
                  "| batch | cache | new tokens | SDPA | flex (incl. block mask) | ratio | create_block_mask | first call (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["flex"]["rows"]:
            lines.append(f"| {r['batch']} | {r['cache_entries']} | {r['new_tokens']} | {r['sdpa_view_ms']:.3f} | "
                         f"{r['flex_ms']:.3f} | {r['ratio_flex_over_sdpa']:.2f} | {r['create_block_mask_ms']:.3f} | "
                         f"{r['first_call_s']:.1f} |")
        lines += ["", "Compiling with dynamic shapes:", ""]
        lines += [f"- batch {r['batch']}, {r['new_tokens']} new tokens, width {r['width']}: {r['outcome']}"
                  for r in result["flex"]["dynamic_compile"]]
    md_path.write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    att = result["attention"]
    labels = [f"b{r['batch']} {r['cache_entries'] // 1024}k q{r['new_tokens']}" for r in att]
    x = range(len(att))
    axes[0].bar([i - 0.2 for i in x], [r["step_ratio_ragged_over_dense"] for r in att], 0.4, label="step (update + attention)")
    axes[0].bar([i + 0.2 for i in x], [r["attention_only_ratio"] for r in att], 0.4, label="attention only")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_xticks(list(x), labels, rotation=45, ha="right")
    axes[0].set_ylabel("ragged / dense time (median ratio)")
    axes[0].set_title("Ragged vs dense attention, equal lengths")
    axes[0].legend()
    ev = result["eviction"]
    labels = [f"b{r['batch']} {r['cache_entries'] // 1024}k {r['what'].split('_at_')[0]}" for r in ev]
    axes[1].bar(range(len(ev)), [r["ratio_ragged_over_dense"] for r in ev])
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_yscale("log")
    axes[1].set_xticks(range(len(ev)), labels, rotation=45, ha="right", fontsize=7)
    axes[1].set_ylabel("ragged / dense gather time (median ratio)")
    axes[1].set_title("Eviction bookkeeping")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="benchmarks/ragged/results.json")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--no-flex", action="store_true", help="skip the FlexAttention section (compiles)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the tables and figure from --output")
    args = parser.parse_args()
    out = Path(args.output)
    if args.report_only:
        report(json.loads(out.read_text()), out.with_name("tables.md"), out.with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.time()
    load_before = os.getloadavg()
    result = {
        "command": "PYTHONPATH=src python benchmarks/ragged/bench_ragged.py " + " ".join(
            f"--repeats {args.repeats} --threads {args.threads}".split() + (["--no-flex"] if args.no_flex else [])),
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(), "machine": platform.machine(),
                        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "load_average_before": load_before},
        "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": str(DTYPE)},
        "attention": bench_attention(args.repeats),
        "eviction": bench_eviction(args.repeats),
        "layout": bench_layout(args.repeats),
    }
    if not args.no_flex:
        result["flex"] = bench_flex(max(5, args.repeats // 3))
    result["environment"]["load_average_after"] = os.getloadavg()
    result["environment"]["seconds"] = round(time.time() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    report(result, out.with_name("tables.md"), out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_name('tables.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
