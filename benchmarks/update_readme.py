"""Copy the committed result tables into README.md and the docs pages, between their markers.

    .venv/bin/python benchmarks/update_readme.py

Each `<!-- name -->` ... `<!-- /name -->` block is replaced by the Markdown file that the benchmark
command wrote. SECTIONS names, per block, that source file and the page that holds the markers (README.md
or a page under docs/), so the numbers in the README and in docs/ always come from committed results.
A missing source file leaves its block as it is.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = {  # name: (source written by the benchmark, page holding the markers)
    "rank-table": ("benchmarks/qwen_rank/headline.md", "README.md"),
    "passkey-table": ("benchmarks/passkey/table.md", "docs/results-passkey.md"),
    "eval-table": ("benchmarks/eval_quick/README.md", "docs/results-quick.md"),
    "bench-table": ("benchmarks/bench/README.md", "docs/results-speed.md"),
    "peak-table": ("benchmarks/bench/paths.md", "README.md"),
    "reasoning-table": ("benchmarks/reasoning/preset/README.md", "docs/results-reasoning.md"),
}


def main() -> int:
    pages: dict[str, str] = {}
    for name, (rel, target) in SECTIONS.items():
        page = ROOT / target
        if target not in pages:
            if not page.exists():
                print(f"{target} not found; left the '{name}' block out", file=sys.stderr)
                continue
            pages[target] = page.read_text()
        text = pages[target]
        source = ROOT / rel
        pattern = re.compile(rf"(<!-- {name} -->\n).*?(<!-- /{name} -->)", re.S)
        if not pattern.search(text):
            continue
        if not source.exists():
            print(f"{rel} not found; left the '{name}' block as it is", file=sys.stderr)
            continue
        body = source.read_text().strip() + f"\n\n(from `{rel}`)\n"
        pages[target] = pattern.sub(lambda m: m.group(1) + body + m.group(2), text)
    for target, text in pages.items():
        page = ROOT / target
        if page.read_text() != text:
            page.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
