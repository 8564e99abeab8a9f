"""The word-level tokenizer of PENCIL's reasoning tasks.

Every symbol of a task (a variable, ``¬``, ``Question:``, a colour) is one token, and
text is split on whitespace. The vocabulary is fixed by the task's parameters rather
than read off data, so that a model trained on one dataset decodes another of the same
task: id 0 is ``<UNK>``, which is also the padding id (ignored by the loss), then the
task's symbols in order, then the special tokens, with the end-of-text token last.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lhc.pencil.reduction import CALL, RETURN, SEP

UNK = "<UNK>"
BOS = "<|startoftext|>"
END_OF_PROMPT = "<|endofprompt|>"
EOS = "<|endoftext|>"
SPECIAL_TOKENS = (BOS, END_OF_PROMPT, CALL, SEP, RETURN)


class PencilTokenizer:
    """Whitespace tokenizer over a fixed vocabulary.

    Ids: ``0`` ``<UNK>`` (padding), ``1 .. len(symbols)`` the symbols, then
    ``<|startoftext|>``, ``<|endofprompt|>``, ``[CALL]``, ``[SEP]``, ``[RETURN]`` and
    ``<|endoftext|>`` (the last id).

    Args:
        symbols: the task's tokens, distinct, none of them special or containing
            whitespace.
    """

    def __init__(self, symbols: Iterable[str]):
        symbols = tuple(symbols)
        reserved = set(SPECIAL_TOKENS) | {UNK, EOS}
        bad = [s for s in symbols if not isinstance(s, str) or not s or s.split() != [s]]
        if bad or reserved & set(symbols) or len(set(symbols)) != len(symbols):
            raise ValueError(
                "symbols must be distinct non-empty strings without whitespace and none of "
                f"{sorted(reserved)}; got duplicates or bad entries {bad or symbols}"
            )
        self.tokens = (UNK, *symbols, *SPECIAL_TOKENS, EOS)
        self._ids = {token: i for i, token in enumerate(self.tokens)}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return self._ids[BOS]

    @property
    def eos_id(self) -> int:
        return self._ids[EOS]

    @property
    def end_of_prompt_id(self) -> int:
        return self._ids[END_OF_PROMPT]

    @property
    def call_id(self) -> int:
        return self._ids[CALL]

    @property
    def sep_id(self) -> int:
        return self._ids[SEP]

    @property
    def return_id(self) -> int:
        return self._ids[RETURN]

    def token_id(self, token: str) -> int:
        """The id of one token; ``ValueError`` if it is not in the vocabulary."""
        try:
            return self._ids[token]
        except KeyError:
            raise ValueError(
                f"token {token!r} is not in this task's vocabulary ({self.vocab_size} tokens)"
            ) from None

    def encode(self, text: str | Sequence[str]) -> list[int]:
        """Ids of ``text`` (split on whitespace) or of a list of tokens.

        Raises:
            ValueError: a token outside the vocabulary.
        """
        tokens = text.split() if isinstance(text, str) else text
        return [self.token_id(token) for token in tokens]

    def decode_tokens(self, ids: Iterable[int]) -> list[str]:
        """The tokens of ``ids``.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside [0, vocab_size={self.vocab_size})")
            out.append(self.tokens[i])
        return out

    def decode(self, ids: Iterable[int], *, skip_padding: bool = True) -> str:
        """``ids`` as space-separated text (padding ids dropped unless asked)."""
        ids = [int(i) for i in ids]
        if skip_padding:
            ids = [i for i in ids if i != self.pad_id]
        return " ".join(self.decode_tokens(ids))
