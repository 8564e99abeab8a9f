"""Tokenizers with one small interface: ``encode``, ``decode``, ``vocab_size``, special
ids, and a chat template.

* ``ByteTokenizer``: UTF-8 bytes (ids 0-255) plus pad/bos/eos and optional named special
  tokens, for generated tasks that need no trained vocabulary.
* ``HFTokenizer``: a ``tokenizer.json`` (Hugging Face ``tokenizers`` library), with the
  special tokens and the chat template taken from ``tokenizer_config.json`` /
  ``chat_template.jinja`` when present (``lhc.lm.gguf`` builds one from a GGUF file).

``tokenizer.apply_chat_template(messages)`` renders the model's chat template as
``transformers`` does (sandboxed Jinja with ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``, ``raise_exception`` and ``strftime_now``).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

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

    @property
    def chat_template(self) -> str | None: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str: ...


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    **names: Any,
) -> str:
    """``template`` rendered as ``transformers`` renders chat templates: sandboxed Jinja
    with ``trim_blocks`` and ``lstrip_blocks``, ``messages``, ``add_generation_prompt``,
    ``raise_exception`` and ``strftime_now``, and ``names`` (``bos_token``, ...).

    Raises:
        ValueError: the template raised (``raise_exception``) or is not valid Jinja.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    try:
        return environment.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **names
        )
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"the chat template failed: {error}") from error


def chat_template_from(path: str | os.PathLike) -> tuple[str | None, dict[str, str]]:
    """The chat template of a Hugging Face tokenizer directory (``chat_template.jinja``,
    or ``tokenizer_config.json``'s ``chat_template``: a string, or the ``default`` of a
    named list) and its special-token strings (``bos_token``, ``eos_token``, ``pad_token``);
    ``(None, {...})`` when it has none."""
    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config: dict[str, Any] = {}
    config_file = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(config_file):
        with open(config_file, encoding="utf-8") as handle:
            config = json.load(handle)
    specials = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[key] = value
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as handle:
            return handle.read(), specials
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template if isinstance(template, str) else None), specials


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

    @property
    def chat_template(self) -> None:
        return None

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
        raise ValueError("a ByteTokenizer has no chat template")

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
        chat_template: the model's Jinja chat template, or None.
        add_bos_token: whether the model expects its bos before plain text (the
            checkpoint's ``add_bos_token``; ``lhc.lm.generate_text`` follows it).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ):
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self.add_bos_token = bool(add_bos_token)
        self.special_tokens_map = {
            name: token
            for name, token in (
                ("bos_token", bos_token),
                ("eos_token", eos_token),
                ("pad_token", pad_token),
            )
            if token is not None
        }
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

        Special tokens not given and the chat template are read from the files beside it
        (``tokenizer_config.json``: ``bos_token``, ``eos_token``, ``pad_token`` as plain
        strings or ``{"content": ...}``, ``chat_template``; ``chat_template.jinja``).

        Raises:
            FileNotFoundError: no ``tokenizer.json``.
        """
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        directory = os.path.dirname(file)
        template, found = chat_template_from(directory)
        given = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        specials = {key: found.get(key) if value is None else value for key, value in given.items()}
        add_bos = False
        config_file = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file, encoding="utf-8") as handle:
                add_bos = bool(json.load(handle).get("add_bos_token", False))
        return cls(
            tokenizers.Tokenizer.from_file(file),
            chat_template=template,
            add_bos_token=add_bos,
            **specials,
        )

    def save(self, directory: str | os.PathLike) -> str:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat
        template, ``add_bos_token``) into ``directory``, which ``from_file`` and
        ``transformers.AutoTokenizer`` read back; returns the directory."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        self._tokenizer.save(os.path.join(directory, "tokenizer.json"))
        config = {
            **self.special_tokens_map,
            "add_bos_token": self.add_bos_token,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        if self._chat_template is not None:
            config["chat_template"] = self._chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        return directory

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

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (a vocabulary entry or an added token), or None."""
        return self._tokenizer.token_to_id(token)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat ``messages`` (``{"role": ..., "content": ...}``) as the model's prompt
        text; encode it without ``add_bos`` (the template writes what it needs).

        Raises:
            ValueError: the tokenizer has no chat template, or the template failed.
        """
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return render_chat_template(
            self._chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )
