"""Turn a sample into the token ids the model sees: the compressed part and the part appended after.

With a chat template (default when the tokenizer has one) the user turn holds `context + question`
and the assistant turn starts with `answer_prefix`, as kvpress builds RULER prompts:

    [chat head][context] | [question][end of user turn, start of assistant turn][answer_prefix]
    ^------- prefix -------^ ^-------------------------- suffix ------------------------------^

Query-agnostic (default): the prefix is prefilled and compressed, then the suffix is fed and the
answer decoded. Query-aware: prefix and suffix are one prompt, compressed as a whole.
Without a chat template: prefix = context (with the tokenizer's special tokens, e.g. BOS),
suffix = question + "\\n" + answer_prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.eval.sample import Sample

_MARK = "<<kvtrim-question-starts-here>>"


@dataclass(frozen=True)
class PromptFormat:
    tokenizer: object
    chat: bool = True

    @property
    def uses_chat(self) -> bool:
        return self.chat and bool(getattr(self.tokenizer, "chat_template", None))

    def texts(self, sample: Sample) -> tuple[str, str]:
        """`(prefix, suffix)` strings of `sample`."""
        if self.uses_chat:
            full = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": sample.context + _MARK + sample.question}],
                add_generation_prompt=True, tokenize=False,
            )
            prefix, suffix = full.split(_MARK)
            return prefix, suffix + sample.answer_prefix.lstrip()
        return sample.context, sample.question + "\n" + sample.answer_prefix.strip()

    def encode(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        """`(prefix_ids (1, n), suffix_ids (1, m))`."""
        prefix, suffix = self.texts(sample)
        special = not self.uses_chat  # a chat template already spells its special tokens out
        p = self.tokenizer(prefix, add_special_tokens=special).input_ids
        s = self.tokenizer(suffix, add_special_tokens=False).input_ids
        return torch.tensor([p]), torch.tensor([s])

    def count(self, sample: Sample) -> int:
        """Prompt tokens of `sample` (prefix + suffix)."""
        p, s = self.encode(sample)
        return p.shape[-1] + s.shape[-1]
