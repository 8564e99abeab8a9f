"""Passkey retrieval: a number hidden at some depth of long filler, asked for at the end.

One example, as text::

    <filler> The pass key is 40715. Remember it. 40715 is the pass key. <filler>
    What is the pass key? The pass key is 40715

The needle sits after a fraction ``depth`` of the filler; the loss counts only the
answer digits. Filler is generated (the repeated sentences of the usual passkey test)
or drawn from text files a user supplies (random snippets, in order). Text becomes
tokens through any tokenizer with ``encode(str) -> list[int]`` (``lhc.lm.ByteTokenizer``
for models trained here); the sequence is exactly ``length`` tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

GENERATED_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "


class Filler:
    """A source of filler text: generated, or the concatenated text of files.

    Args:
        paths: text files (UTF-8) to draw snippets from; ``None`` for the generated
            filler. Each snippet starts at a random offset of the concatenated text and
            wraps around at its end.

    Raises:
        ValueError: a path that is not a readable file, or files with no text.
    """

    def __init__(self, paths: Sequence[str] | None = None):
        if paths is None:
            self.text = GENERATED_FILLER
            self.generated = True
            return
        texts = []
        for path in paths:
            if not os.path.isfile(path):
                raise ValueError(f"filler paths: {path!r} is not a file")
            with open(path, encoding="utf-8") as handle:
                texts.append(handle.read())
        self.text = " ".join(" ".join(t.split()) for t in texts)
        if not self.text.strip():
            raise ValueError(f"filler paths {list(paths)} hold no text")
        self.generated = False

    def _snippet(self, offset: int, chars: int) -> tuple[str, int]:
        """``chars`` characters from ``offset`` on, wrapping around; and the next offset."""
        parts = []
        while chars > 0:
            part = self.text[offset : offset + chars]
            parts.append(part)
            chars -= len(part)
            offset = (offset + len(part)) % len(self.text)
        return "".join(parts), offset

    def tokens(self, tokenizer, rng: np.random.Generator, count: int) -> list[int]:
        """``count`` filler tokens (the generated filler starts at a sentence)."""
        if count <= 0:
            return []
        offset = 0 if self.generated else int(rng.integers(len(self.text)))
        ids: list[int] = []
        while len(ids) < count:
            # A few characters per missing token; tokenized, then cut to `count` tokens.
            piece, offset = self._snippet(offset, 8 * (count - len(ids)) + 64)
            new = list(tokenizer.encode(piece))
            if not new:
                raise ValueError("the filler text tokenizes to no tokens")
            ids.extend(new)
        return ids[:count]


def passkey_example(
    rng: np.random.Generator,
    *,
    length: int,
    tokenizer,
    filler: Filler | None = None,
    depth: float | None = None,
    digits: int = 5,
) -> dict[str, np.ndarray]:
    """One passkey sequence of exactly ``length`` tokens.

    Args:
        rng: randomness for the key, the depth (when not given) and the filler.
        length: tokens in the sequence (inputs plus the last target).
        tokenizer: any object with ``encode(str) -> list[int]``.
        filler: a ``Filler``; the generated one by default.
        depth: where the needle goes, as a fraction of the filler before it (0: at the
            start, 1: just before the question); uniform in [0, 1] when ``None``.
        digits: digits of the key (no leading zero).

    Returns:
        ``tokens``, ``targets`` int32 ``[length - 1]`` and ``weights`` float32
        ``[length - 1]`` (1 on the positions that predict the answer's tokens), plus
        ``key`` (int) and ``needle_start`` (the needle's first token index).

    Raises:
        ValueError: a length too short for the needle, question and answer, or a depth
            outside [0, 1].
    """
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    filler = filler or Filler()
    key = int(rng.integers(10 ** (digits - 1), 10**digits))
    needle = list(tokenizer.encode(NEEDLE.format(key=key)))
    question = list(tokenizer.encode(QUESTION))
    answer = list(tokenizer.encode(str(key)))
    fixed = len(needle) + len(question) + len(answer)
    if length < fixed + 1:
        raise ValueError(
            f"length {length} is too short for the needle, question and answer ({fixed} tokens)"
        )
    filler_count = length - fixed
    depth = float(rng.random()) if depth is None else depth
    before = int(round(depth * filler_count))
    text = filler.tokens(tokenizer, rng, filler_count)
    sequence = text[:before] + needle + text[before:] + question + answer
    sequence = np.asarray(sequence, np.int32)
    weights = np.zeros(length - 1, np.float32)
    weights[length - 1 - len(answer) :] = 1.0
    return {
        "tokens": sequence[:-1],
        "targets": sequence[1:],
        "weights": weights,
        "key": key,
        "needle_start": before,
    }


def passkey_batch(rng: np.random.Generator, batch_size: int, **kwargs) -> dict[str, np.ndarray]:
    """``batch_size`` examples of ``passkey_example`` stacked (``tokens, targets, weights``)."""
    examples = [passkey_example(rng, **kwargs) for _ in range(batch_size)]
    return {
        name: np.stack([example[name] for example in examples])
        for name in ("tokens", "targets", "weights")
    }
