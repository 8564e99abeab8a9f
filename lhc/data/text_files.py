"""Language-modelling windows from a user's own text files, documents kept apart.

``TextFiles(paths, tokenizer)`` reads text files (a file, a folder of them, or several
of either), one document per file (or per ``separator``-delimited part of a file),
tokenizes each once (the tokenizer's bos first when it asks for one, its eos last) and
holds the tokens in memory: a few million tokens fit easily, and a fine-tune of a
pretrained model reads no more.

The last ``eval_fraction`` of each document's tokens is held out. Each part (training,
held-out) is one stream of the documents' tokens in order, cut into windows of
``length + 1`` tokens with a stride of ``length`` (every token is a target once per
epoch). A window packs whatever documents it covers: ``segment_ids`` tell them apart,
``positions`` restart at each document's first token, and the target that would cross
a boundary weighs 0, so a model given ``segment_ids`` (``lhc.lm.packing``) treats each
document as if it were alone. Training visits the windows in a fresh permutation per
epoch, drawn from the seed; row ``r`` of batch ``i`` is example ``i * B + r``, so the
position in the data is the batch index alone (resumed exactly, shared by processes
without talking), the random-access sampling that grain's index sampler does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np


def text_file_paths(paths: str | Sequence[str]) -> list[str]:
    """The files that ``paths`` names: comma-separated (or a sequence of) files and
    folders, a folder giving its files (not hidden ones) recursively in sorted order.

    Raises:
        FileNotFoundError: a path that does not exist, or no file at all.
    """
    given = [p.strip() for p in paths.split(",")] if isinstance(paths, str) else list(paths)
    files = []
    for path in filter(None, given):
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
        else:
            raise FileNotFoundError(f"data.paths: no file or folder at {path!r}")
    if not files:
        raise FileNotFoundError(f"data.paths: no text file in {paths!r}")
    return files


def positions_in_documents(segment_ids: np.ndarray) -> np.ndarray:
    """int32 ``[T]``: each token's index since the first token of its run of equal
    ``segment_ids`` (its document, as far as this window sees it)."""
    index = np.arange(len(segment_ids))
    starts = np.ones(len(segment_ids), bool)
    starts[1:] = segment_ids[1:] != segment_ids[:-1]
    return (index - np.maximum.accumulate(np.where(starts, index, 0))).astype(np.int32)


class TextFiles:
    """Packed token windows of local text files (see the module docstring).

    Args:
        paths: files and folders (``text_file_paths``).
        tokenizer: ``encode(text)``, ``eos_id``, ``bos_id``, ``add_bos_token``
            (``lhc.lm.HFTokenizer``).
        length: tokens per window (the model's input length).
        eval_fraction: the share of each document's tokens held out, in ``[0, 1)``.
        separator: when given, each file is split into documents at this string.

    Raises:
        FileNotFoundError: from ``text_file_paths``.
        ValueError: a bad ``length`` or ``eval_fraction``, a file that is not UTF-8
            text, or fewer tokens than one training window.
    """

    def __init__(
        self,
        paths: str | Sequence[str],
        tokenizer,
        length: int,
        *,
        eval_fraction: float = 0.01,
        separator: str | None = None,
    ):
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"data.length: expected an int >= 1, got {length!r}")
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(
                f"data.eval_fraction: expected a number in [0, 1), got {eval_fraction!r}"
            )
        self.files = text_file_paths(paths)
        self.length = length
        train, held_out = [], []
        for document in self._documents(separator):
            ids = tokenizer.encode(document)
            if getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_id is not None:
                ids = [tokenizer.bos_id, *ids]
            if tokenizer.eos_id is not None:
                ids.append(tokenizer.eos_id)
            cut = len(ids) - int(round(len(ids) * eval_fraction))
            train.append(ids[:cut])
            held_out.append(ids[cut:])
        self._orders: dict[tuple[int, int], np.ndarray] = {}  # the last epochs' permutations
        self.train = _Stream(train, length)
        self.held_out = _Stream(held_out, length)
        if not self.train.num_windows:
            raise ValueError(
                f"data.paths: {self.train.num_tokens} training tokens in {len(self.files)} "
                f"file(s), fewer than one window of data.length + 1 = {length + 1}"
            )

    def _documents(self, separator: str | None):
        for path in self.files:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError as error:
                raise ValueError(f"data.paths: {path!r} is not UTF-8 text ({error})") from None
            parts = [text] if not separator else text.split(separator)
            yield from (part for part in parts if part.strip())

    def train_batch(self, seed: int, index: int, rows, batch_size: int) -> dict[str, np.ndarray]:
        """Rows ``rows`` (global row indices) of training batch ``index`` of
        ``batch_size`` rows: example ``index * batch_size + r``."""
        examples = [index * batch_size + row for row in rows]
        return self.train.windows([self._train_window(seed, e) for e in examples])

    def eval_batch(self, index: int, rows, batch_size: int) -> dict[str, np.ndarray]:
        """Rows of held-out batch ``index``: the held-out windows in order, cyclically.

        Raises:
            ValueError: nothing is held out (``eval_fraction`` 0 or documents too short).
        """
        count = self.held_out.num_windows
        if not count:
            raise ValueError(
                f"data.eval_fraction: the held-out part has {self.held_out.num_tokens} tokens, "
                f"fewer than one window of {self.length + 1}; raise it or set eval_batches=0"
            )
        return self.held_out.windows([(index * batch_size + row) % count for row in rows])

    def _train_window(self, seed: int, example: int) -> int:
        epoch, k = divmod(example, self.train.num_windows)
        return int(self._permutation(seed, epoch)[k])

    def _permutation(self, seed: int, epoch: int) -> np.ndarray:
        key = (int(seed), int(epoch))
        if key not in self._orders:
            if len(self._orders) > 1:
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = np.random.default_rng(key).permutation(self.train.num_windows)
        return self._orders[key]


class _Stream:
    """Documents' tokens in a row, cut into windows of ``length + 1``."""

    def __init__(self, documents: list[list[int]], length: int):
        self.tokens = np.fromiter(
            (t for ids in documents for t in ids), np.int32, sum(map(len, documents))
        )
        self.documents = np.repeat(
            np.arange(len(documents), dtype=np.int32), list(map(len, documents))
        )
        self.length = length
        self.num_tokens = len(self.tokens)
        self.num_windows = max(self.num_tokens - 1, 0) // length

    def windows(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """``tokens``, ``targets``, ``positions``, ``segment_ids`` (int32) and
        ``weights`` (float32), ``[len(indices), length]``."""
        rows = []
        for w in indices:
            span = slice(w * self.length, w * self.length + self.length + 1)
            tokens, documents = self.tokens[span], self.documents[span]
            rows.append(
                {
                    "tokens": tokens[:-1],
                    "targets": tokens[1:],
                    "positions": positions_in_documents(documents[:-1]),
                    "segment_ids": documents[:-1] - documents[0],
                    "weights": (documents[1:] == documents[:-1]).astype(np.float32),
                }
            )
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}
