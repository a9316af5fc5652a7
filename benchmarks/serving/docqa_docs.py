"""The documents and questions of the document-QA load (`docqa.py`; `docqa_reference.py` asks them in-process)."""

from __future__ import annotations

import random

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "The river runs past the old mill, and the mill wheel turns all day. ")


def documents(tok, docs: int, questions: int, doc_tokens: int, seed: int):
    """[(document ids, [(question ids, key)])]: filler with `questions` needles spread through it."""
    rng = random.Random(seed)
    out = []
    per_sentence = len(tok(FILLER, add_special_tokens=False).input_ids)
    for d in range(docs):
        keys = [str(rng.randint(10000, 99999)) for _ in range(questions)]
        chunks = max(1, doc_tokens // per_sentence)
        spots = {int((j + 0.5) * chunks / questions): j for j in range(questions)}
        text = f"Document {d}. There are {questions} doors; each has a pass key. Remember them.\n"
        for c in range(chunks):
            text += FILLER
            if c in spots:
                j = spots[c]
                text += f"The pass key of door {j} is {keys[j]}. Remember it. "
        ids = tok(text, add_special_tokens=False).input_ids
        qs = [(tok(f"\nWhat is the pass key of door {j}? The pass key of door {j} is",
                   add_special_tokens=False).input_ids, keys[j]) for j in range(questions)]
        out.append((ids, qs))
    return out
