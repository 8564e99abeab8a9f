"""Prompts for decoding: token lists left-padded into one array, their positions, stop
ids, and where a batch of prompts and its new tokens sit in a cache.

Prompts of different lengths are left-padded: prompt ``b`` of length ``n_b`` sits in the
last ``n_b`` columns with positions ``start_b .. start_b + n_b - 1`` and the columns
before it have position ``-1`` (padding, never attended to). Widths are rounded up to
buckets (``bucket_length``) so that nearby lengths share one compiled program.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_MIN_STOP_SLOTS = 4


def bucket_length(length: int, minimum: int = 16) -> int:
    """The compiled length that serves ``length``: at least ``minimum``, a multiple of 16
    up to 64, of 64 up to 512, then of an eighth of the power of two below (at most 12.5%
    padding), so that nearby lengths share one program."""
    length = max(int(length), int(minimum))
    if length <= 64:
        step = 16
    elif length <= 512:
        step = 64
    else:
        step = 1 << (length.bit_length() - 4)
    return -(-length // step) * step


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int = 0, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads ragged token sequences.

    Args:
        sequences: B lists of token ids (each non-empty).
        pad_id: filler token id.
        width: P, the padded length (default: the longest sequence).

    Returns:
        ``(tokens, lengths)``: int32 ``[B, P]`` and int32 ``[B]``.
    """
    lengths = np.array([len(s) for s in sequences], np.int32)
    if len(sequences) == 0 or (lengths == 0).any():
        raise ValueError(
            f"left_pad needs at least one non-empty sequence; got lengths {lengths.tolist()}"
        )
    width = int(lengths.max()) if width is None else width
    if width < lengths.max():
        raise ValueError(f"width {width} is shorter than the longest sequence ({lengths.max()})")
    tokens = np.full((len(sequences), width), pad_id, np.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, width - len(sequence) :] = np.asarray(sequence, np.int32)
    return tokens, lengths


def prepare_prompts(
    prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
    prompt_lengths: jax.Array | np.ndarray | None,
    pad_id: int,
    vocab_size: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Validated left-padded prompts: ``(tokens int32 [B, P], lengths int32 [B])``.

    Args:
        prompts: B token lists, or a left-padded int ``[B, P]`` array.
        prompt_lengths: int ``[B]`` real lengths of a padded array (default: all ``P``).
        pad_id: filler for token lists.
        vocab_size: token ids must lie in ``[0, vocab_size)`` (unchecked if None).

    Raises:
        ValueError: a prompt array that is not 2-D, lengths outside ``[1, P]``, lengths
            given with token lists, token ids outside the vocabulary.
    """
    if isinstance(prompts, (jax.Array, np.ndarray)):
        tokens = np.asarray(prompts)
        if tokens.ndim != 2:
            raise ValueError(
                f"prompts must be int [B, P] or a list of token lists, got {tokens.shape=}"
            )
        lengths = (
            np.full(tokens.shape[0], tokens.shape[1], np.int32)
            if prompt_lengths is None
            else np.asarray(prompt_lengths)
        )
    else:
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths applies to a padded array, not to token lists")
        _check_token_lists(prompts)
        tokens, lengths = left_pad(prompts, pad_id)
    batch_size, width = tokens.shape
    if lengths.shape != (batch_size,) or (lengths < 1).any() or (lengths > width).any():
        raise ValueError(
            f"prompt_lengths must be [B={batch_size}] values in [1, {width}], got {lengths.tolist()}"
        )
    if vocab_size is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"prompt token ids must lie in [0, vocab_size={vocab_size}); got min {tokens.min()} "
            f"max {tokens.max()}"
        )
    return tokens.astype(np.int32), lengths.astype(np.int32)


def _check_token_lists(prompts) -> None:
    """A one-line ``ValueError`` for prompts that are not B non-empty token lists."""
    expected = "prompts: expected B token lists or an int [B, P] array"
    if isinstance(prompts, (str, bytes)):
        raise ValueError(f"{expected}, got a string; tokenize it first (tokenizer.encode)")
    if not isinstance(prompts, Sequence):
        raise ValueError(f"{expected}, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError(f"{expected}, got no prompts")
    if any(isinstance(p, (int, np.integer)) for p in prompts):
        raise ValueError(f"{expected}, got a flat list of ints; one prompt is [tokens]")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(
            f"prompts: every prompt needs at least one token; prompts {empty} are empty"
        )


def left_padded_positions(
    prompt_lengths: jax.Array, width: int, start: jax.Array | int = 0
) -> jax.Array:
    """int32 ``[B, P]`` positions of left-padded prompts, ``-1`` on the padding.

    Prompt ``b`` gets positions ``start[b] .. start[b] + prompt_lengths[b] - 1``.
    """
    offsets = jnp.arange(width, dtype=jnp.int32)[None, :] - (width - prompt_lengths[:, None])
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), prompt_lengths.shape)
    return jnp.where(offsets >= 0, start[:, None] + offsets, -1).astype(jnp.int32)


def stop_token_array(stop_tokens: Sequence[int], vocab_size: int | None = None) -> np.ndarray:
    """int32 stop ids padded with -1 (never a token) to a bucketed length; each id must
    lie in ``[0, vocab_size)`` (unchecked if None)."""
    stop_tokens = [int(t) for t in stop_tokens]
    outside = [t for t in stop_tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:
        raise ValueError(
            f"stop_tokens: ids must lie in [0, vocab_size={vocab_size}), got {outside}"
        )
    slots = max(_MIN_STOP_SLOTS, 1 << max(len(stop_tokens) - 1, 0).bit_length())
    out = np.full((slots,), -1, np.int32)
    out[: len(stop_tokens)] = stop_tokens
    return out


def prompt_layout(tokens, lengths, cache, cache_len, max_len, max_new_tokens, pad_id):
    """``generate``'s plan: the prompts left-padded to a bucketed width, each sequence's
    first position, the bucketed output buffer and the new cache's length (``None`` when
    continuing a cache). Raises when the prompts and ``max_new_tokens`` do not fit."""
    batch_size, width = tokens.shape
    if cache is None:
        start = np.zeros((batch_size,), np.int32)
        used = 0
    else:
        start = np.asarray(cache.next_positions(), np.int32)
        used = int(np.max(np.asarray(cache.lengths))) if batch_size else 0
        if np.asarray(cache.lengths).shape != (batch_size,):
            raise ValueError(
                f"cache holds {np.asarray(cache.lengths).shape[0]} sequences, prompts {batch_size}"
            )
    last_position = int(np.max(start + lengths)) + max_new_tokens - 1
    if last_position >= max_len:
        raise ValueError(
            f"prompt width {width} + max_new_tokens {max_new_tokens} (last position "
            f"{last_position}) exceeds the model's max_len {max_len}"
        )
    buffer_len = bucket_length(max_new_tokens)
    # The cache needs width + N - 1 slots (the last token is never fed); buckets round
    # both up, within what the model and the cache allow.
    needed = width + max_new_tokens - 1
    if cache is not None:
        room = None if cache.capacity is None else cache.capacity - used
        limit = "the cache's free capacity"
    else:
        room = max_len if cache_len is None else int(cache_len)
        limit = "cache_len" if cache_len is not None else "the model's max_len"
    if room is not None and needed > room:
        raise ValueError(
            f"{limit} {room} is too small for prompts of width {width} plus {max_new_tokens} "
            f"new tokens ({needed} slots; the last token is never fed)"
        )
    bucketed = bucket_length(width)
    if room is not None:
        bucketed = max(width, min(bucketed, room - max_new_tokens + 1))
    padding_room = getattr(cache, "padding_room", None)
    held = None if cache is None else np.asarray(cache.lengths) > 0
    if padding_room is not None and held.any():
        # A ring keeps the last slots, padding included: more padding between a
        # sequence's tokens than its spare slots would push out keys the window needs.
        padding = width - int(np.min(lengths[held]))
        if padding > padding_room:
            raise ValueError(
                f"prompts continuing a sliding-window cache may differ in length by at most "
                f"its {padding_room} spare slots; got lengths {lengths.tolist()}"
            )
        bucketed = min(bucketed, width + padding_room - padding)
    if bucketed > width:
        padding = np.full((batch_size, bucketed - width), pad_id, np.int32)
        tokens = np.concatenate([padding, tokens], axis=1)
    if cache is None and cache_len is None:
        # One spare slot keeps the length a multiple of 16 (it shards evenly).
        cache_len = min(max_len, bucketed + buffer_len)
    return tokens, start, buffer_len, None if cache is not None else int(cache_len)
