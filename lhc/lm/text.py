"""Text in, text out: prompts (plain, or user messages through the model's chat
template) generated with ``lhc.lm.generate``, optionally streamed as they are sampled.

    ckpt = lm.load_checkpoint("smollm2-135m-instruct")
    replies = lm.generate_text(ckpt, ["What is the capital of France?"], chat=True,
                               max_new_tokens=64, on_text=lambda row, text: print(text, end=""))

Streaming works through a step hook that hands each sampled token to the host
(``jax.debug.callback``) while the decode loop runs on the device; the text shown is
the decoding of every token so far, so multi-token characters appear whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from lhc.lm.decoding import DecodeState, generate
from lhc.lm.sampling import SamplingParams

# The stream of the generate_text call in progress. The step hook is one module-level
# function, so that every call shares one compiled program, and the callback may run on
# another thread than the caller's: a module-level slot, not a context variable.
_ACTIVE: list[_Stream] = []


class _Stream:
    """Decodes the growing token list of each row and reports the new text."""

    def __init__(self, tokenizer, stop_tokens: Sequence[int], on_text: Callable[[int, str], Any]):
        self.tokenizer, self.stop_tokens, self.on_text = tokenizer, set(stop_tokens), on_text
        self.ids: dict[int, list[int]] = {}
        self.shown: dict[int, str] = {}
        self.counts: dict[int, int] = {}

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """The tokens just sampled and each row's length: a row whose length grew
        sampled its token now (a stopped row samples nothing)."""
        for row, (token, length) in enumerate(zip(tokens.tolist(), lengths.tolist())):
            if length <= self.counts.get(row, 0):
                continue
            self.counts[row] = length
            if token in self.stop_tokens:
                continue
            self.ids.setdefault(row, []).append(int(token))
            text = self.tokenizer.decode(self.ids[row])
            if text.endswith("\ufffd"):  # a character cut between tokens: wait for the rest
                continue
            new = text[len(self.shown.get(row, "")) :]
            if new:
                self.shown[row] = text
                self.on_text(row, new)

    def finish(self) -> None:
        """Shows what was held back (bytes that never completed a character)."""
        for row, ids in self.ids.items():
            text = self.tokenizer.decode(ids)
            new = text[len(self.shown.get(row, "")) :]
            if new:
                self.shown[row] = text
                self.on_text(row, new)


def _emit(tokens, lengths) -> None:
    if _ACTIVE:
        _ACTIVE[-1].add(np.asarray(tokens), np.asarray(lengths))


def _stream_hook(state: DecodeState) -> DecodeState:
    jax.debug.callback(_emit, state.token, state.lengths, ordered=True)
    return state


def chat_prompt(tokenizer, message: str | Sequence[Mapping[str, str]]) -> list[int]:
    """The tokens of a chat turn: a user message (or a list of messages) rendered with
    the tokenizer's chat template and the generation prompt.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    messages = [{"role": "user", "content": message}] if isinstance(message, str) else message
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def generate_text(
    checkpoint,
    prompts: Sequence[str],
    *,
    chat: bool = False,
    max_new_tokens: int = 128,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    on_text: Callable[[int, str], Any] | None = None,
    add_bos: bool | None = None,
) -> list[str]:
    """Generates a reply to each prompt.

    Args:
        checkpoint: an ``lhc.lm.Checkpoint`` (model, params, tokenizer, stop tokens).
        prompts: B texts.
        chat: render each prompt as a user message with the chat template.
        max_new_tokens: N.
        sampling: temperature / top-k / top-p (greedy when None).
        seed: the sampling seed.
        on_text: ``on_text(row, new_text)``, called as tokens are sampled (a stop token
            ends a row and is not shown).
        add_bos: prepend the bos token to plain prompts (default: when the tokenizer asks
            for it, ``add_bos_token``); a chat template writes its own.

    Returns:
        The B replies, stop tokens and special tokens removed.

    Raises:
        ValueError: no prompts, an empty prompt, or ``chat`` without a chat template.
    """
    tokenizer = checkpoint.tokenizer
    if not prompts:
        raise ValueError("prompts must hold at least one text")
    if add_bos is None:
        add_bos = bool(getattr(tokenizer, "add_bos_token", False)) and tokenizer.bos_id is not None
    if chat:
        token_prompts = [chat_prompt(tokenizer, prompt) for prompt in prompts]
    else:
        token_prompts = [tokenizer.encode(prompt, add_bos=add_bos) for prompt in prompts]
    for index, tokens in enumerate(token_prompts):
        if not tokens:
            raise ValueError(f"prompt {index} is empty")
    sampling = sampling or SamplingParams()
    stream = _Stream(tokenizer, checkpoint.stop_tokens, on_text) if on_text else None
    if stream is not None:
        _ACTIVE.append(stream)
    try:
        out = generate(
            checkpoint.model,
            checkpoint.params,
            token_prompts,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            rng=jax.random.key(seed),
            stop_tokens=checkpoint.stop_tokens,
            step_hook=_stream_hook if stream is not None else None,
        )
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        if stream is not None:
            stream.finish()
    finally:
        if stream is not None:
            _ACTIVE.remove(stream)
    stops = set(checkpoint.stop_tokens)
    replies = []
    for row, length in zip(tokens, lengths):
        ids = [int(t) for t in row[:length] if int(t) not in stops]
        replies.append(tokenizer.decode(ids))
    return replies
