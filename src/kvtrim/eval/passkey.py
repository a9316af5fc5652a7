"""Passkey retrieval (Landmark / LongLoRA style), generated offline and sized in the model's tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from kvtrim.eval.sample import Sample

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass
class PasskeySample:
    prompt: str
    key: str
    depth: float  # 0 = start of the haystack, 1 = right before the question
    n_tokens: int


def random_key(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def passkey_prompt(n_fillers: int, depth: float, key: str) -> str:
    split = round(depth * n_fillers)
    return INTRO + FILLER * split + NEEDLE.format(key=key) + FILLER * (n_fillers - split) + QUESTION


def make_passkey(tokenizer, target_tokens: int, depth: float, key: str) -> PasskeySample:
    """A passkey prompt whose token count is as close to `target_tokens` as whole filler sentences allow."""
    count = lambda n: len(tokenizer(passkey_prompt(n, depth, key)).input_ids)  # noqa: E731
    per_filler = max(1, count(11) - count(10))
    n = max(0, (target_tokens - count(0)) // per_filler)
    prompt = passkey_prompt(n, depth, key)
    return PasskeySample(prompt, key, depth, count(n))


def passkey_samples(tokenizer, target_tokens: int, trials: int, seed: int = 0, digits: int = 5) -> list[PasskeySample]:
    """`trials` samples with depths evenly spaced over [0, 1] and seeded random keys."""
    rng = random.Random(seed)
    depths = [i / (trials - 1) if trials > 1 else 0.5 for i in range(trials)]
    return [make_passkey(tokenizer, target_tokens, d, random_key(rng, digits)) for d in depths]


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
                        target_length: int) -> Sample:
    """A passkey sample split for the eval harness: `context` holds the haystack and the needle."""
    from kvtrim.eval.sample import Sample

    split = round(depth * n_fillers)
    context = INTRO + FILLER * split + NEEDLE.format(key=key) + FILLER * (n_fillers - split) + "\n\n"
    return Sample(
        id=sample_id, task=task, context=context, question=PASSKEY_QUESTION, answers=[key],
        max_new_tokens=passkey_max_new_tokens(len(key)), answer_prefix=PASSKEY_ANSWER_PREFIX,
        metric="passkey", length=target_length, depth=depth, meta={"units": n_fillers},
    )
