"""The tokenizer of a llama.cpp GGUF file (``tokenizer.ggml.*``), built with the
``tokenizers`` library:

* ``model == "gpt2"``: byte-level BPE over ``tokens`` and ``merges``, text split as the
  ``pre`` type says (the GPT-2 pattern; the Llama 3, Qwen2, Tekken and GPT-4o patterns;
  digits one by one before the GPT-2 pattern for SmolLM and StarCoder, as llama.cpp and
  their ``tokenizer.json`` do); Llama 3 vocabularies take a word that is a vocabulary
  entry whole (``ignore_merges``). An unknown ``pre`` is an error, not a guess.
* ``model == "llama"``: SentencePiece-style BPE: ``"▁"`` for spaces (one prepended to the
  text when ``add_space_prefix``), merges from ``merges`` or else ranked by the
  ``scores`` of the merged pieces, unknown characters as ``<0xXX>`` byte tokens.

Tokens typed CONTROL or UNKNOWN become special added tokens (matched whole in the text,
dropped by ``decode(skip_special_tokens=True)``), USER_DEFINED ones plain added tokens.

``stop_tokens`` gives the end-of-generation ids (end of sequence, of turn, of message).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from lhc.lm.gguf_file import GGUFFile, read_gguf
from lhc.lm.tokenizers import HFTokenizer

# llama.cpp's tokenizer.ggml.token_type values.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# Split patterns of byte-level vocabularies, by tokenizer.ggml.pre (those of the
# models' own tokenizer.json files, which llama.cpp re-implements).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
}
# The GPT-2 pattern itself (the ByteLevel pre-tokenizer's own); "default" is what the
# converter writes for a vocabulary it does not recognise.
_GPT2_PRE = ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais")
# Digits one by one, then the GPT-2 pattern.
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
# A word that is itself a vocabulary entry is one token, whatever the merges (Llama 3's
# tokenizer.json has ignore_merges; llama.cpp sets it for these).
_IGNORE_MERGES_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")


def _byte_level_bpe(file: GGUFFile, tokens: Sequence[str]) -> tokenizers.Tokenizer:
    pre = file.get("tokenizer.ggml.pre", "default")
    merges = [tuple(merge.split(" ", 1)) for merge in file.get("tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES_PRE)
    )
    if pre in _SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGITS_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    elif pre in _GPT2_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        known = sorted({*_SPLITS, *_GPT2_PRE, *_DIGITS_PRE})
        raise ValueError(
            f"{file.path}: tokenizer.ggml.pre {pre!r} is not supported; known: {known}"
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary, which has scores instead of merges.

    SentencePiece merges the adjacent pair whose union scores highest, so every split of
    a normal piece into two vocabulary pieces becomes a merge, ranked by the piece's
    score (then longer left, longer right parts; then the parts' ids).
    """
    ids = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for token, score, kind in zip(tokens, scores, types):
        if kind != _NORMAL:
            continue  # control, byte and user-defined pieces are never merged into
        splits = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in ids and token[cut:] in ids
        ]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked += [(score, left, right) for left, right in splits]
    ranked.sort(key=lambda merge: (-merge[0], -len(merge[1]), -len(merge[2])))
    return [(left, right) for _, left, right in ranked]


def _sentencepiece_bpe(
    file: GGUFFile, tokens: Sequence[str], types: Sequence[int]
) -> tokenizers.Tokenizer:
    merges = file.get("tokenizer.ggml.merges", None)
    if merges is None:
        merges = _sentencepiece_merges(tokens, file.get("tokenizer.ggml.scores"), types)
    else:
        merges = [tuple(merge.split(" ", 1)) for merge in merges]
    unknown_id = file.get("tokenizer.ggml.unknown_token_id", None)
    tokenizer = tokenizers.Tokenizer(
        models.BPE(
            {token: index for index, token in enumerate(tokens)},
            merges,
            unk_token=None if unknown_id is None else tokens[unknown_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = bool(file.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer and chat template of a GGUF file.

    ``bos_token``, ``eos_token`` and ``pad_token`` are the tokens of
    ``tokenizer.ggml.{bos,eos,padding}_token_id``; the chat template is
    ``tokenizer.chat_template``. Encoding adds no special tokens by itself (see
    ``HFTokenizer.encode``'s ``add_bos``).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a GGUF file, no vocabulary, an unsupported tokenizer model or
            pre-tokenizer, or a special token id outside the vocabulary.
    """
    file = read_gguf(path)
    tokens = file.get("tokenizer.ggml.tokens")
    types = file.get("tokenizer.ggml.token_type", None) or [_NORMAL] * len(tokens)
    kind = file.get("tokenizer.ggml.model", None)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(file, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(file, tokens, types)
    else:
        raise ValueError(
            f"{file.path}: tokenizer.ggml.model {kind!r} is not supported; expected 'gpt2' "
            "(byte-level BPE) or 'llama' (SentencePiece BPE)"
        )
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, types)
            if token and token_type in (_CONTROL, _UNKNOWN)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, token_type in zip(tokens, types)
            if token and token_type == _USER_DEFINED
        ]
    )
    specials = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = file.get(f"tokenizer.ggml.{key}_token_id", None)
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise ValueError(
                f"{file.path}: tokenizer.ggml.{key}_token_id {token_id} is outside the "
                f"vocabulary of {len(tokens)} tokens"
            )
        specials[f"{name}_token"] = tokens[token_id]
    return HFTokenizer(
        tokenizer,
        chat_template=file.get("tokenizer.chat_template", None),
        add_bos_token=bool(file.get("tokenizer.ggml.add_bos_token", False)),
        **specials,
    )


def stop_tokens(path: str | os.PathLike) -> tuple[int, ...]:
    """End-of-generation ids of a GGUF file, for ``generate(..., stop_tokens=...)``:
    ``tokenizer.ggml.eos_token_id``, then the end-of-turn and end-of-message ids
    (``eot_token_id``, ``eom_token_id``) when present and different."""
    file = read_gguf(path)
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        token_id = file.get(f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return tuple(ids)
