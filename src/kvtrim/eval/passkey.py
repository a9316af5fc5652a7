"""Passkey retrieval as evaluation samples (the prompts themselves: `kvtrim.passkey`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtrim.passkey import passkey_context, random_key  # noqa: F401  (random_key: re-exported for tasks)

if TYPE_CHECKING:  # pragma: no cover
    from kvtrim.eval.sample import Sample


# ---- as evaluation samples (kvtrim eval) --------------------------------------------------------------
# The 5-digit key is the classic Landmark / LongLoRA test; the 64-digit key is the harder variant the
# LagKV paper takes from Yuan et al. 2024 (there hidden in essays; here in the usual filler), scored by
# exact and partial match (`kvtrim.eval.scoring.passkey_scores`).
PASSKEY_TASKS = {"passkey": 5, "passkey_64": 64}
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER_PREFIX = "The pass key is"


def passkey_max_new_tokens(digits: int) -> int:
    """Room for the key plus a few words, whatever the tokenizer does with digits (one token each at worst)."""
    return digits + 12


def passkey_eval_sample(task: str, sample_id: str, key: str, depth: float, n_fillers: int,
                        target_length: int, haystack: str = "synthetic") -> Sample:
    """A passkey sample split for the eval harness: `context` holds the haystack and the needle.

    `haystack="essay"`: the filler is `n_fillers` words of Paul Graham's essays (as the LagKV paper's
    64-digit test, after Yuan et al. 2024), the needle between two sentences (`kvtrim.eval.essays`)."""
    from kvtrim.eval.sample import Sample

    if haystack == "essay":
        from kvtrim.eval.essays import essay_haystack
        from kvtrim.passkey import INTRO, NEEDLE

        context = INTRO + essay_haystack(n_fillers, [NEEDLE.format(key=key).strip()], [depth]) + "\n\n"
    else:
        context = passkey_context(n_fillers, depth, key)
    meta = {"units": n_fillers, **({"haystack": "essay"} if haystack == "essay" else {})}
    return Sample(
        id=sample_id, task=task, context=context, question=PASSKEY_QUESTION, answers=[key],
        max_new_tokens=passkey_max_new_tokens(len(key)), answer_prefix=PASSKEY_ANSWER_PREFIX,
        metric="passkey", length=target_length, depth=depth, meta=meta,
    )
