"""Copy the committed result tables into README.md, between their markers.

    .venv/bin/python benchmarks/update_readme.py

Each `<!-- name -->` ... `<!-- /name -->` block of the README is replaced by the Markdown file that the
benchmark command wrote (see SECTIONS), so the README's numbers always come from committed results.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = {
    "passkey-table": "benchmarks/passkey/table.md",
    "eval-table": "benchmarks/eval_quick/README.md",
    "bench-table": "benchmarks/bench/README.md",
    "reasoning-table": "benchmarks/reasoning/preset/README.md",
}


def main() -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    for name, rel in SECTIONS.items():
        source = ROOT / rel
        pattern = re.compile(rf"(<!-- {name} -->\n).*?(<!-- /{name} -->)", re.S)
        if not pattern.search(text):
            continue
        if not source.exists():
            print(f"{rel} not found; left the '{name}' block as it is", file=sys.stderr)
            continue
        body = source.read_text().strip() + f"\n\n(from `{rel}`)\n"
        text = pattern.sub(lambda m: m.group(1) + body + m.group(2), text)
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
