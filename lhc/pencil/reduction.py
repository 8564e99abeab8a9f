"""PENCIL's reduction rule and the training sub-sequences it defines.

The rule, on a sequence that contains the special tokens ``[CALL]``, ``[SEP]`` and
``[RETURN]``::

    C [CALL] T [SEP] A [RETURN]   ->   C A

One step takes the first ``[RETURN]`` that has a ``[SEP]`` before it with a ``[CALL]``
before that, the last such ``[SEP]`` and the last such ``[CALL]``, and erases the call
``[CALL] T [SEP]`` together with the ``[RETURN]``, keeping the answer ``A``. A
``[RETURN]`` with no ``[SEP]`` before it, or whose ``[SEP]`` has no ``[CALL]`` before it,
is an ordinary token and stays. Calls nest (the innermost call returns first), and an
answer may itself open a call: ``[CALL] T [SEP] [CALL] S [RETURN]`` becomes ``[CALL] S``,
a tail call that replaces a long thought by its summary ``S``.

During generation the rule runs whenever ``[RETURN]`` is generated; everything before
it is then already reduced, so the ``[RETURN]`` just generated is the first one that
matches. ``reduce`` applies the rule until nothing matches, which gives the same
sequence as generating the tokens one by one and reducing as they come.

Training data (``subsequences``): a complete trace is replayed in generation order; each
reduction emits the context at that moment (ending with its ``[RETURN]``), and the last
emits the final context (ending with the end-of-text token). Each sub-sequence is
trained from the first token generated after the previous reduction (after the prompt,
for the first), so every token of the trace is trained exactly once, in the context
in which it is generated.

Every function takes a sequence of hashable tokens: the token strings
(``reduce(["[CALL]", ...])``) or integer ids with the special ids given
(``reduce_ids(ids, call_id=..., sep_id=..., return_id=...)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

CALL = "[CALL]"
SEP = "[SEP]"
RETURN = "[RETURN]"


def find_reduction(
    tokens: Sequence[Hashable], call: Hashable = CALL, sep: Hashable = SEP, ret: Hashable = RETURN
) -> tuple[int, int, int] | None:
    """Indices ``(call, sep, return)`` of the next reduction, or ``None`` if none matches.

    The ``[RETURN]`` is the first that has a ``[SEP]`` before it with a ``[CALL]`` before
    that; the ``[SEP]`` is the last before the ``[RETURN]``, the ``[CALL]`` the last before
    the ``[SEP]``.
    """
    last_call = last_sep = call_before_sep = -1
    for index, token in enumerate(tokens):
        if token == call:
            last_call = index
        elif token == sep:
            last_sep, call_before_sep = index, last_call
        elif token == ret and call_before_sep >= 0:
            return call_before_sep, last_sep, index
    return None


def _apply(tokens: list, found: tuple[int, int, int]) -> list:
    call_index, sep_index, return_index = found
    return tokens[:call_index] + tokens[sep_index + 1 : return_index] + tokens[return_index + 1 :]


def reduce_once(
    tokens: Sequence[Hashable], call: Hashable = CALL, sep: Hashable = SEP, ret: Hashable = RETURN
) -> list:
    """One step of the rule (what generation does when it emits ``[RETURN]``).

    Args:
        tokens: the sequence (strings, or ids with ``call``/``sep``/``ret`` given as ids).

    Returns:
        A new list: the sequence with its first matching call reduced, or unchanged.
    """
    tokens = list(tokens)
    found = find_reduction(tokens, call, sep, ret)
    return tokens if found is None else _apply(tokens, found)


def reduce(
    tokens: Sequence[Hashable], call: Hashable = CALL, sep: Hashable = SEP, ret: Hashable = RETURN
) -> list:
    """The rule applied until no ``[RETURN]`` has a matching ``[SEP]`` and ``[CALL]``."""
    tokens = list(tokens)
    while (found := find_reduction(tokens, call, sep, ret)) is not None:
        tokens = _apply(tokens, found)
    return tokens


def reduce_once_ids(ids: Sequence[int], *, call_id: int, sep_id: int, return_id: int) -> list[int]:
    """``reduce_once`` on integer token ids."""
    return [int(i) for i in reduce_once([int(i) for i in ids], call_id, sep_id, return_id)]


def reduce_ids(ids: Sequence[int], *, call_id: int, sep_id: int, return_id: int) -> list[int]:
    """``reduce`` on integer token ids."""
    return [int(i) for i in reduce([int(i) for i in ids], call_id, sep_id, return_id)]


@dataclasses.dataclass(frozen=True)
class Subsequence:
    """One training example of PENCIL: a context as generation sees it.

    Attributes:
        tokens: the context, ending with the ``[RETURN]`` that triggers the next
            reduction, or with the end-of-text token for the last one.
        loss_start: index of the first token trained; ``tokens[loss_start:]`` were
            generated in this context (the tokens before come from the prompt or from
            earlier reductions).
    """

    tokens: tuple
    loss_start: int

    @property
    def trained(self) -> tuple:
        """The tokens trained on this example."""
        return self.tokens[self.loss_start :]

    def loss_mask(self) -> np.ndarray:
        """bool ``[len(tokens)]``: True at the tokens trained (as next-token targets)."""
        mask = np.zeros(len(self.tokens), bool)
        mask[self.loss_start :] = True
        return mask


def subsequences(
    prompt: Sequence[Hashable],
    trace: Sequence[Hashable],
    call: Hashable = CALL,
    sep: Hashable = SEP,
    ret: Hashable = RETURN,
) -> list[Subsequence]:
    """The sub-sequences of PENCIL's training data for one example.

    Replays the trace token by token after the prompt, reducing at every matching
    ``[RETURN]`` as generation would.

    Args:
        prompt: the prompt (never trained), e.g. ending with ``<|endofprompt|>``.
        trace: the generated part, with its special tokens, e.g. ending with
            ``<|endoftext|>``.

    Returns:
        One ``Subsequence`` per reduction plus the final context; concatenating their
        ``trained`` parts gives ``trace`` back.

    Raises:
        ValueError: an empty prompt or trace.
    """
    if not len(prompt) or not len(trace):
        raise ValueError(
            f"subsequences needs a non-empty prompt and trace, got {len(prompt)} and "
            f"{len(trace)} tokens"
        )
    context = list(prompt)
    loss_start = len(context)
    out = []
    for token in trace:
        context.append(token)
        if token != ret:
            continue
        found = find_reduction(context, call, sep, ret)
        if found is None:
            continue
        out.append(Subsequence(tuple(context), loss_start))
        context = _apply(context, found)
        loss_start = len(context)
    out.append(Subsequence(tuple(context), loss_start))
    return out
