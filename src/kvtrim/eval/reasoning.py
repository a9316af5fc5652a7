"""Generated reasoning tasks: long, checkable answers that keep referring back (decode-time eviction's setting).

Each task is a structured problem (a dataclass), built by a seeded generator, rendered to text, and solved
by a reference solver that reads the structured data only (never the prompt text). The model is asked to
write one numbered line per step, `Step N: ... = VALUE`, and to end with `\\boxed{ANSWER}`; the `trace`
metric (`kvtrim.eval.scoring`) scores the boxed answer exactly and the step values as a partial score.

* `arith_trace`: a start value and N operations (`Step 7: add 4`, `Step 8: subtract 6`); the model writes
  `Step 7: add 4: 31 + 4 = 35`, the running value after each one. Step k copies operation k from the
  prompt (which nothing attended to before: a method that ranks entries by attention history has no
  evidence to keep it) and uses the value it wrote one line earlier.
* `arith_recall`: the same, plus a *memo* the model computes in its first line (`Memo: 12 + 9 = 21`);
  about one operation in four says `add the memo` / `subtract the memo`, and the last one always does: a
  value the model stated at the start comes back again and again, up to the very last step (LazyEviction's
  recurring-token pattern).
* `program_trace`: a straight-line program over four variables (`Step 9: c = a + 5`, `Step 10: b = c - d`);
  the model writes `Step 9: c = a + 5 = 12 + 5 = 17`. Reading a variable means finding the line, possibly
  far back in the model's own output, where it was last assigned. The answer: the last line's variable.
* `var_trace`: the same without arithmetic: lines copy a variable (`b = d`) or assign a fresh 2-digit
  constant; the model writes `Step 9: b = d = 57`. Pure look-back into its own output.
* `list_recall`: a list of words with a number each and a list of lookups (`Step 5: pear`); the model
  writes `Step 5: pear = 52` for each, then `Asked word: W = \\boxed{N}` for the word of its *first* step,
  which no later step looks up: the last line needs a fact about 300 tokens back, both in the prompt and
  in the model's own first line. The lookups revisit words (each word about `steps / words` times), so
  the entries that matter keep coming back (LazyEviction's recurring-token pattern). The one task
  qwen2.5-coder-0.5b solves with the full cache (benchmarks/reasoning: copying is easy for it,
  arithmetic is not).
* `chain_trace`: pointer chasing: shuffled links `417 -> 982` (half of them from other chains); from a start
  code the model writes `Step 3: 417 -> 982` until a code links nowhere. Every step is a lookup in the
  prompt, keyed by the code the model wrote one line earlier.

Values stay in 0 .. `MAX_VALUE` and operands are single digits, so each step is easy; the difficulty is
the length: the number of steps is chosen so that the prompt plus the expected answer fits the target
length in the model's own tokens (`kvtrim.eval.tasks`). Each prompt carries a two- or three-step worked
example: without it qwen2.5-coder-0.5b copied the `<value before>` placeholders of a written-out format.
How well the offline models do: benchmarks/reasoning/README.md.

Query-agnostic split: `context` = the format (instruction and worked example) and the problem data;
`question` = a one-line request to answer it. `answers[0]` is the final answer, `answers[1:]` the value
after each step (the `trace` metric's convention).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtrim.eval.sample import Sample
from kvtrim.methods.base import check

MAX_VALUE = 99  # running values stay in 0 .. MAX_VALUE (two digits at most)
MAX_OPERAND = 9  # operands of `add` / `subtract` are 1 .. MAX_OPERAND
MEMO_EVERY = 4  # arith_recall: about one operation in MEMO_EVERY uses the memo
PROGRAM_VARIABLES = ("a", "b", "c", "d", "e")


# ---- arith_trace / arith_recall ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArithOp:
    sign: int  # +1 add, -1 subtract
    operand: int | None  # None = the memo


@dataclass(frozen=True)
class ArithProblem:
    start: int
    ops: tuple[ArithOp, ...]
    memo: tuple[int, int] | None = None  # the two numbers whose sum is the memo (arith_recall)


def make_arith(rng: random.Random, steps: int, recall: bool = False) -> ArithProblem:
    """`steps` operations keeping the running value in 0 .. MAX_VALUE; with `recall`, a memo (10 .. 30)
    used by about 1 in MEMO_EVERY operations and by the last one."""
    check(steps >= 1, f"a trace needs at least one step, got {steps}")
    memo_parts = (rng.randint(5, 15), rng.randint(5, 15)) if recall else None
    memo = sum(memo_parts) if memo_parts else 0
    value = rng.randint(20, MAX_VALUE - 20)
    start, ops = value, []
    for k in range(steps):
        use_memo = recall and (k == steps - 1 or rng.random() < 1 / MEMO_EVERY)
        operand = memo if use_memo else rng.randint(1, MAX_OPERAND)
        can_add, can_sub = value + operand <= MAX_VALUE, value - operand >= 0
        sign = rng.choice((1, -1)) if can_add and can_sub else (1 if can_add else -1)
        value += sign * operand
        ops.append(ArithOp(sign, None if use_memo else operand))
    return ArithProblem(start, tuple(ops), memo_parts)


def solve_arith(problem: ArithProblem) -> list[int]:
    """The running value after each operation (the reference solver: structured data only)."""
    memo = sum(problem.memo) if problem.memo else None
    values, value = [], problem.start
    for op in problem.ops:
        value += op.sign * (memo if op.operand is None else op.operand)
        values.append(value)
    return values


def _op_text(op: ArithOp) -> str:
    word = "add" if op.sign > 0 else "subtract"
    return f"{word} {'the memo' if op.operand is None else op.operand}"


ARITH_EXAMPLE = (
    "Apply a list of operations in order, starting from the start value. Write one line per operation: the "
    "operation, then the value before, the operation and the value after. After the last step, write the "
    "final value in a box.\n\n"
    "Example problem:\nStart value: 10\nStep 1: add 5\nStep 2: subtract 3\n"
    "Example answer:\nStep 1: add 5: 10 + 5 = 15\nStep 2: subtract 3: 15 - 3 = 12\n\\boxed{12}\n"
)
RECALL_EXAMPLE = (
    "First compute the memo. Then apply a list of operations in order, starting from the start value; "
    "\"the memo\" means the memo number you computed. Write one line per operation: the operation, then the "
    "value before, the operation and the value after. After the last step, write the final value in a box."
    "\n\nExample problem:\nMemo: 4 + 6\nStart value: 10\nStep 1: add 5\nStep 2: subtract the memo\n"
    "Example answer:\nMemo: 4 + 6 = 10\nStep 1: add 5: 10 + 5 = 15\nStep 2: subtract the memo: 15 - 10 = 5\n"
    "\\boxed{5}\n"
)
ARITH_QUESTION = "Now answer the problem above in the same way: every step, then the final value in a box."


def render_arith(problem: ArithProblem) -> tuple[str, str]:
    """`(context, question)`: the context holds the format (a worked example) and the problem. Operations
    are numbered `Step N:` as the answer's lines are, so that finding operation N is a copy."""
    lines = [RECALL_EXAMPLE if problem.memo else ARITH_EXAMPLE, "Problem:"]
    if problem.memo:
        lines.append(f"Memo: {problem.memo[0]} + {problem.memo[1]}")
    lines.append(f"Start value: {problem.start}")
    lines += [f"Step {k}: {_op_text(op)}" for k, op in enumerate(problem.ops, start=1)]
    return "\n".join(lines) + "\n\n", ARITH_QUESTION


def arith_reference_answer(problem: ArithProblem) -> str:
    """The ideal answer text (what a perfect model writes; used to size samples and in tests)."""
    memo = sum(problem.memo) if problem.memo else None
    lines = [f"Memo: {problem.memo[0]} + {problem.memo[1]} = {memo}"] if problem.memo else []
    before = problem.start
    for k, (op, after) in enumerate(zip(problem.ops, solve_arith(problem)), start=1):
        operand = memo if op.operand is None else op.operand
        lines.append(f"Step {k}: {_op_text(op)}: {before} {'+' if op.sign > 0 else '-'} {operand} = {after}")
        before = after
    lines.append(f"\\boxed{{{before}}}")
    return "\n".join(lines)


# ---- program_trace ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Assign:
    """`target = left` (sign 0, right None) or `target = left +/- right`; operands are names or numbers."""

    target: str
    left: str | int
    sign: int = 0
    right: str | int | None = None


@dataclass(frozen=True)
class Program:
    lines: tuple[Assign, ...]
    result: str  # the variable whose final value is the answer
    copies_only: bool = False  # var_trace: `x = 57` and `x = y` lines only, no arithmetic


def _value(env: dict[str, int], x: str | int) -> int:
    return env[x] if isinstance(x, str) else x


def make_program(rng: random.Random, steps: int, n_vars: int = 4) -> Program:
    """A program of `steps` lines: first each variable gets a constant, then assignments that read one or two
    variables (`c = a + 5`, `b = c - d`), each value in 0 .. MAX_VALUE. The answer is the last line's target."""
    check(2 <= n_vars <= len(PROGRAM_VARIABLES), f"n_vars must be in 2..{len(PROGRAM_VARIABLES)}, got {n_vars}")
    check(steps >= n_vars + 1, f"a program over {n_vars} variables needs at least {n_vars + 1} lines, got {steps}")
    names = PROGRAM_VARIABLES[:n_vars]
    env: dict[str, int] = {}
    lines = []
    for name in names:
        env[name] = rng.randint(10, MAX_VALUE - 10)
        lines.append(Assign(name, env[name]))
    last_target = None
    for _ in range(steps - n_vars):
        target = rng.choice([n for n in names if n != last_target])  # no two lines in a row to one variable
        left = rng.choice(names)
        if rng.random() < 0.5:  # variable +/- constant
            right: str | int = rng.randint(1, MAX_OPERAND)
        else:  # variable +/- another variable
            right = rng.choice([n for n in names if n != left])
        options = [s for s in (1, -1) if 0 <= env[left] + s * _value(env, right) <= MAX_VALUE]
        if not options:  # two variables whose sum and difference both leave the range: use a constant
            right = rng.randint(1, MAX_OPERAND)
            options = [s for s in (1, -1) if 0 <= env[left] + s * right <= MAX_VALUE]
        sign = rng.choice(options)
        lines.append(Assign(target, left, sign, right))
        env[target] = env[left] + sign * _value(env, right)
        last_target = target
    return Program(tuple(lines), lines[-1].target)


def make_copy_program(rng: random.Random, steps: int, n_vars: int = 4, new_every: int = 4) -> Program:
    """var_trace: each variable first gets a constant; then each line copies another variable (`b = d`) or,
    about one line in `new_every`, gets a fresh constant. Every constant is a different 2-digit number, so a
    value tells where it came from; no variable is assigned twice in a row. The answer is the last line's
    target."""
    check(2 <= n_vars <= len(PROGRAM_VARIABLES), f"n_vars must be in 2..{len(PROGRAM_VARIABLES)}, got {n_vars}")
    check(steps >= n_vars + 1, f"a program over {n_vars} variables needs at least {n_vars + 1} lines, got {steps}")
    names = PROGRAM_VARIABLES[:n_vars]
    fresh = iter(rng.sample(range(10, 100), 90))
    lines = [Assign(name, next(fresh)) for name in names]
    last_target = None
    for _ in range(steps - n_vars):
        target = rng.choice([n for n in names if n != last_target])
        constant = next(fresh, None) if rng.random() < 1 / new_every else None
        source = constant if constant is not None else rng.choice([n for n in names if n != target])
        lines.append(Assign(target, source))
        last_target = target
    return Program(tuple(lines), lines[-1].target, copies_only=True)


def solve_program(program: Program) -> list[int]:
    """The value assigned at each line (the reference solver: structured data only)."""
    env: dict[str, int] = {}

    def value(x: str | int) -> int:
        return env[x] if isinstance(x, str) else x

    values = []
    for line in program.lines:
        v = value(line.left) if line.right is None else value(line.left) + line.sign * value(line.right)
        env[line.target] = v
        values.append(v)
    return values


def program_answer(program: Program) -> int:
    """The final value of `program.result`."""
    last = max(i for i, line in enumerate(program.lines) if line.target == program.result)
    return solve_program(program)[last]


def _expr(line: Assign) -> str:
    if line.right is None:
        return str(line.left)
    return f"{line.left} {'+' if line.sign > 0 else '-'} {line.right}"


PROGRAM_EXAMPLE = (
    "Run a program line by line. For each line, write the line, the expression with the current values of "
    "its variables filled in, and the result. At the end, write the asked value in a box.\n\n"
    "Example problem:\nStep 1: a = 3\nStep 2: b = a + 4\nStep 3: a = b - a\nWhat is the final value of a?\n"
    "Example answer:\nStep 1: a = 3\nStep 2: b = a + 4 = 3 + 4 = 7\nStep 3: a = b - a = 7 - 3 = 4\n"
    "\\boxed{4}\n\n"
)
COPY_EXAMPLE = (
    "Run a program line by line. For each line, write the line, and for a line that copies a variable, the "
    "current value of that variable. At the end, write the asked value in a box.\n\n"
    "Example problem:\nStep 1: a = 31\nStep 2: b = a\nStep 3: a = 57\nStep 4: c = b\n"
    "What is the final value of c?\n"
    "Example answer:\nStep 1: a = 31\nStep 2: b = a = 31\nStep 3: a = 57\nStep 4: c = b = 31\n\\boxed{31}\n\n"
)
PROGRAM_QUESTION = ("Now answer the problem above in the same way: every line, then the final value of {result} "
                    "in a box.")


def render_program(program: Program) -> tuple[str, str]:
    """`(context, question)`: the context holds the format (a worked example) and the program, its lines
    numbered `Step N:` as the answer's lines are (finding line N is a copy; finding a variable's value is not)."""
    body = "\n".join(f"Step {k}: {line.target} = {_expr(line)}" for k, line in enumerate(program.lines, start=1))
    example = COPY_EXAMPLE if program.copies_only else PROGRAM_EXAMPLE
    return (f"{example}Problem:\n{body}\nWhat is the final value of {program.result}?\n\n",
            PROGRAM_QUESTION.format(result=program.result))


def program_reference_answer(program: Program) -> str:
    env: dict[str, int] = {}
    out = []
    for k, (line, v) in enumerate(zip(program.lines, solve_program(program)), start=1):
        if line.right is None and isinstance(line.left, int):
            out.append(f"Step {k}: {line.target} = {v}")
        elif line.right is None:
            out.append(f"Step {k}: {line.target} = {line.left} = {v}")
        else:
            filled = Assign(line.target, env[line.left] if isinstance(line.left, str) else line.left, line.sign,
                            env[line.right] if isinstance(line.right, str) else line.right)
            out.append(f"Step {k}: {line.target} = {_expr(line)} = {_expr(filled)} = {v}")
        env[line.target] = v
    out.append(f"\\boxed{{{env[program.result]}}}")
    return "\n".join(out)


# ---- chain_trace -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chain:
    links: tuple[tuple[int, int], ...]  # (code, next code), in the order the prompt lists them
    start: int


def make_chain(rng: random.Random, steps: int, distractors: float = 1.0) -> Chain:
    """A chain of `steps` links from `start` to a code that links nowhere, listed shuffled among about
    `distractors x steps` links of other chains; every code is a distinct 3-digit number and links from it
    at most once, so each lookup is unambiguous."""
    check(steps >= 1, f"a chain needs at least one link, got {steps}")
    n_other = max(1, round(distractors * steps))
    codes = rng.sample(range(100, 1000), steps + 1 + n_other + (n_other + 3) // 4)
    chain, rest = codes[: steps + 1], codes[steps + 1:]
    links = list(zip(chain, chain[1:]))
    # distractors: short chains (up to 4 links each) over the other codes
    i = 0
    while i < len(rest) - 1 and len(links) < steps + n_other:
        run = rest[i: i + 5]
        links += list(zip(run, run[1:]))[: steps + n_other - len(links)]
        i += 5
    rng.shuffle(links)
    return Chain(tuple(links), chain[0])


def solve_chain(chain: Chain) -> list[int]:
    """The code reached after each link, until a code that links nowhere (the reference solver)."""
    following = dict(chain.links)
    out, code = [], chain.start
    while code in following:
        code = following[code]
        out.append(code)
    return out


CHAIN_EXAMPLE = (
    "Each line of a list links a code to the next code. Follow the links from the start code until you reach "
    "a code that links nowhere. Write one line per link: the code and the code it links to. At the end, write "
    "the last code in a box.\n\n"
    "Example problem:\n305 -> 718\n640 -> 951\n112 -> 305\n718 -> 264\nStart code: 112\n"
    "Example answer:\nStep 1: 112 -> 305\nStep 2: 305 -> 718\nStep 3: 718 -> 264\n\\boxed{264}\n\n"
)
CHAIN_QUESTION = "Now answer the problem above in the same way: every link, then the last code in a box."


def render_chain(chain: Chain) -> tuple[str, str]:
    body = "\n".join(f"{a} -> {b}" for a, b in chain.links)
    return f"{CHAIN_EXAMPLE}Problem:\n{body}\nStart code: {chain.start}\n\n", CHAIN_QUESTION


def chain_reference_answer(chain: Chain) -> str:
    codes = [chain.start] + solve_chain(chain)
    lines = [f"Step {k}: {a} -> {b}" for k, (a, b) in enumerate(zip(codes, codes[1:]), start=1)]
    return "\n".join(lines + [f"\\boxed{{{codes[-1]}}}"])


# ---- list_recall -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WordList:
    entries: tuple[tuple[str, int], ...]  # (word, number), in the order the prompt lists them
    lookups: tuple[str, ...]  # the word of each step
    asked: str  # the word whose number is the final answer (the first step's, never looked up again)


LIST_WORDS_PER_STEP = 0.6  # list size / steps: each word is looked up about 1.7 times


def make_list_recall(rng: random.Random, steps: int) -> WordList:
    """A list of `max(3, round(LIST_WORDS_PER_STEP x steps))` distinct nouns with distinct 2-digit numbers
    and `steps` lookups: every word at least once where `steps` allows, no word twice in a row, and the
    first step's word (the asked one) never again."""
    from kvtrim.eval.words import NOUNS

    check(steps >= 2, f"list_recall needs at least two steps, got {steps}")
    n_words = max(3, round(LIST_WORDS_PER_STEP * steps))
    words = rng.sample(NOUNS, n_words)
    entries = tuple(zip(words, rng.sample(range(10, 100), n_words)))
    asked, others = words[0], words[1:]
    lookups = [asked]
    pool = rng.sample(others, len(others))  # each other word once, in random order, then random picks
    while len(lookups) < steps:
        choices = [w for w in (pool or others) if w != lookups[-1]]
        word = choices[0] if pool else rng.choice(choices)
        if pool:
            pool.remove(word)
        lookups.append(word)
    order = list(entries)
    rng.shuffle(order)  # the list order says nothing about the lookup order
    return WordList(tuple(order), tuple(lookups), asked)


def solve_list_recall(problem: WordList) -> list[int]:
    """The number of each step's word (the reference solver: structured data only)."""
    number = dict(problem.entries)
    return [number[w] for w in problem.lookups]


LIST_EXAMPLE = (
    "Each word in the list has a number. Look up the words of the steps in order: write one line per step, "
    "the word and its number. At the end, write the asked word with its number in a box.\n\n"
    "Example problem:\nList:\nlamp: 41\nriver: 17\nstone: 88\n"
    "Step 1: river\nStep 2: stone\nStep 3: lamp\nStep 4: stone\nAsked word: river\n"
    "Example answer:\nStep 1: river = 17\nStep 2: stone = 88\nStep 3: lamp = 41\nStep 4: stone = 88\n"
    "Asked word: river = \\boxed{17}\n\n"
)
LIST_QUESTION = "Now answer the problem above in the same way: every step, then the asked word with its number in a box."


def render_list_recall(problem: WordList) -> tuple[str, str]:
    entries = "\n".join(f"{w}: {n}" for w, n in problem.entries)
    steps = "\n".join(f"Step {k}: {w}" for k, w in enumerate(problem.lookups, start=1))
    return f"{LIST_EXAMPLE}Problem:\nList:\n{entries}\n{steps}\nAsked word: {problem.asked}\n\n", LIST_QUESTION


def list_recall_reference_answer(problem: WordList) -> str:
    number = dict(problem.entries)
    lines = [f"Step {k}: {w} = {number[w]}" for k, w in enumerate(problem.lookups, start=1)]
    return "\n".join(lines + [f"Asked word: {problem.asked} = \\boxed{{{number[problem.asked]}}}"])


# ---- the tasks as evaluation samples ------------------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningTask:
    name: str
    min_steps: int  # programs: one constant line per variable (4 by default) plus one more
    tokens_per_step: int  # rough guess for the first sizing probe (the sizing itself counts real tokens)


REASONING_TASKS = {
    t.name: t
    for t in (
        ReasoningTask("arith_trace", 1, 14),
        ReasoningTask("arith_recall", 1, 15),
        ReasoningTask("program_trace", 5, 24),
        ReasoningTask("var_trace", 5, 14),
        ReasoningTask("chain_trace", 1, 24),
        ReasoningTask("list_recall", 2, 14),
    )
}


def reasoning_problem(task: str, rng: random.Random, steps: int):
    """The structured problem of `task` with `steps` steps."""
    if task == "arith_trace":
        return make_arith(rng, steps)
    if task == "arith_recall":
        return make_arith(rng, steps, recall=True)
    if task == "program_trace":
        return make_program(rng, steps)
    if task == "var_trace":
        return make_copy_program(rng, steps)
    if task == "chain_trace":
        return make_chain(rng, steps)
    if task == "list_recall":
        return make_list_recall(rng, steps)
    raise KeyError(task)


def solution(problem) -> tuple[int, list[int], str]:
    """`(final answer, step values, reference answer text)` of a problem."""
    if isinstance(problem, Program):
        return program_answer(problem), solve_program(problem), program_reference_answer(problem)
    if isinstance(problem, Chain):
        codes = solve_chain(problem)
        return codes[-1], codes, chain_reference_answer(problem)
    if isinstance(problem, WordList):
        return dict(problem.entries)[problem.asked], solve_list_recall(problem), list_recall_reference_answer(problem)
    values = solve_arith(problem)
    return values[-1], values, arith_reference_answer(problem)


def render(problem) -> tuple[str, str]:
    if isinstance(problem, Chain):
        return render_chain(problem)
    if isinstance(problem, WordList):
        return render_list_recall(problem)
    return render_program(problem) if isinstance(problem, Program) else render_arith(problem)


def reasoning_sample(task: str, sample_id: str, steps: int, max_new_tokens: int = 1, length: int = 0) -> Sample:
    """One sample of `task` with `steps` steps, seeded by `sample_id` (deterministic in its arguments).

    `meta` holds `steps` and the reference answer text (`reference`), for sizing and inspection."""
    problem = reasoning_problem(task, random.Random(sample_id), steps)
    context, question = render(problem)
    final, values, reference = solution(problem)
    return Sample(
        id=sample_id, task=task, context=context, question=question,
        answers=[str(final)] + [str(v) for v in values], max_new_tokens=max_new_tokens, metric="trace",
        length=length, meta={"steps": steps, "reference": reference},
    )
