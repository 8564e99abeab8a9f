"""Tokenizers with one small interface: ``encode``, ``decode``, ``vocab_size``, special ids.

* ``ByteTokenizer``: UTF-8 bytes (ids 0-255) plus pad/bos/eos and optional named special
  tokens, for generated tasks that need no trained vocabulary.
* ``HFTokenizer``: a ``tokenizer.json`` (Hugging Face ``tokenizers`` library), with the
  special tokens taken from ``tokenizer_config.json`` / ``config.json`` when present.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Protocol

import tokenizers


class Tokenizer(Protocol):
    """What the rest of lhc expects of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int | None: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens, with special tokens after the 256 byte ids.

    Ids: 0-255 bytes, 256 pad, 257 bos, 258 eos, then ``special_tokens`` in order.
    A special token's text (e.g. ``"[CALL]"``) in the input to ``encode`` becomes its id.

    Args:
        special_tokens: extra tokens, each a non-empty string.
    """

    PAD, BOS, EOS = 256, 257, 258

    def __init__(self, special_tokens: Sequence[str] = ()):
        special_tokens = tuple(special_tokens)
        if len(set(special_tokens)) != len(special_tokens) or any(not t for t in special_tokens):
            raise ValueError(
                f"special_tokens must be distinct non-empty strings, got {special_tokens}"
            )
        self.special_tokens = special_tokens
        self._special_ids = {token: 259 + i for i, token in enumerate(special_tokens)}
        self._special_text = {i: token for token, i in self._special_ids.items()}
        # Longest first, so a token that contains another wins.
        ordered = sorted(special_tokens, key=len, reverse=True)
        self._pattern = (
            re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None
        )

    @property
    def vocab_size(self) -> int:
        return 259 + len(self.special_tokens)

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def pad_id(self) -> int:
        return self.PAD

    def token_id(self, token: str) -> int:
        """Id of a special token."""
        if token not in self._special_ids:
            raise ValueError(f"unknown special token {token!r}; known: {self.special_tokens}")
        return self._special_ids[token]

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        pieces = self._pattern.split(text) if self._pattern else [text]
        ids = [self.BOS] if add_bos else []
        for piece in pieces:
            if piece in self._special_ids:
                ids.append(self._special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        if add_eos:
            ids.append(self.EOS)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        buffer = bytearray()
        named = {self.PAD: "<pad>", self.BOS: "<bos>", self.EOS: "<eos>"}
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} outside [0, {self.vocab_size})")
            if token < 256:
                buffer.append(token)
                continue
            out.append(buffer.decode("utf-8", errors="replace"))
            buffer.clear()
            if token in self._special_text:
                out.append(self._special_text[token])  # task tokens are content, always kept
            elif not skip_special_tokens:
                out.append(named[token])
        out.append(buffer.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        bos_token, eos_token, pad_token: special token strings (``None`` if absent).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ):
        self._tokenizer = tokenizer
        self._ids = {}
        for role, token in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
            if token is None:
                self._ids[role] = None
                continue
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{role}_token {token!r} is not in the tokenizer's vocabulary")
            self._ids[role] = token_id

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> HFTokenizer:
        """Loads ``path`` (a ``tokenizer.json`` or a directory holding one).

        Special tokens not given are read from ``tokenizer_config.json`` beside it
        (``bos_token``, ``eos_token``, ``pad_token``, plain strings or ``{"content": ...}``).

        Raises:
            FileNotFoundError: no ``tokenizer.json``.
        """
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        specials = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file) as f:
                tokenizer_config = json.load(f)
            for key, value in specials.items():
                if value is None:
                    found = tokenizer_config.get(key)
                    specials[key] = found.get("content") if isinstance(found, dict) else found
        return cls(tokenizers.Tokenizer.from_file(file), **specials)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self._ids["eos"]

    @property
    def pad_id(self) -> int | None:
        return self._ids["pad"]

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        # Special tokens come only from add_bos/add_eos, never from a template inside the
        # tokenizer, so a prompt is encoded the same way whatever the checkpoint.
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but the tokenizer has no bos token")
            ids = [self.bos_id, *ids]
        if add_eos:
            if self.eos_id is None:
                raise ValueError("add_eos=True but the tokenizer has no eos token")
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=skip_special_tokens
        )


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """``HFTokenizer.from_file(path)``."""
    return HFTokenizer.from_file(path)
