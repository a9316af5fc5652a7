"""Passkey retrieval prompts (Landmark / LongLoRA style), generated offline and sized in the model's tokens.

Neutral ground: the benchmark, the kvpress side-by-side and the eval harness (`kvtrim.eval.passkey`)
all build their passkey prompts here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


def passkey_context(n_fillers: int, depth: float, key: str) -> str:
    """The haystack with the needle at `depth`, without the question (the part a query-agnostic
    protocol compresses)."""
    split = round(depth * n_fillers)
    return INTRO + FILLER * split + NEEDLE.format(key=key) + FILLER * (n_fillers - split) + "\n\n"
