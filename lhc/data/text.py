"""Language-modelling windows from a tensorflow-datasets text dataset (PG-19 and the like).

``TfdsText`` reads a prepared tfds dataset through ``builder.as_data_source(split)``
(random access to its ``array_record`` files; TensorFlow is not needed) and cuts
fixed-length token windows from its documents: window ``r`` of batch ``i`` depends only
on ``(seed, i, r)``, so a run resumes exactly and processes share batches without
talking. A window starts at a random character of a random document (the partial first
token dropped) and, where the document ends first, continues into the next documents
with an end-of-sequence token between them, so no window is short and nothing is padded.

The dataset must already be prepared under ``data_dir`` (``tfds build pg19`` where its
source is reachable, or any builder whose examples have a text feature); nothing is
downloaded here.
"""

from __future__ import annotations

import numpy as np

# Characters tokenized per missing token: generous for BPE on English (about 4 per token).
_CHARS_PER_TOKEN = 8


def _as_text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        return _as_text(value.item())
    return str(value)


class TfdsText:
    """Random token windows from the documents of one split of a prepared tfds dataset.

    Args:
        name: the tfds dataset name (``"pg19"``).
        split: the split (``"train"``, ``"validation"``, ``"test"``).
        tokenizer: anything with ``encode(str) -> list[int]`` and an ``eos_id``.
        data_dir: where the dataset was prepared (tfds's default when ``None``).
        feature: the text feature of each example (``"book_text"`` for PG-19).

    Raises:
        ValueError: a dataset that is not prepared, a missing split or feature, or a
            split with no documents.
    """

    def __init__(self, name: str, *, split: str, tokenizer, data_dir=None, feature="text"):
        import tensorflow_datasets as tfds

        try:
            builder = tfds.builder(name, data_dir=data_dir)
        except Exception as error:
            raise ValueError(f"tfds dataset {name!r} could not be loaded: {error}") from error
        if not builder.is_prepared():
            raise ValueError(
                f"tfds dataset {name!r} is not prepared under data_dir={data_dir!r}; build it "
                f"first (for example `tfds build {name} --data_dir ...` where its source is "
                "reachable)"
            )
        if split not in builder.info.splits:
            raise ValueError(
                f"tfds dataset {name!r} has splits {sorted(builder.info.splits)}, not {split!r}"
            )
        if feature not in builder.info.features:
            raise ValueError(
                f"tfds dataset {name!r} has features {sorted(builder.info.features)}, "
                f"not {feature!r}"
            )
        self.source = builder.as_data_source(split=split)
        if len(self.source) == 0:
            raise ValueError(f"tfds dataset {name!r} split {split!r} has no documents")
        if getattr(tokenizer, "eos_id", None) is None:
            raise ValueError("tokenizer: needs an end-of-sequence token (eos_id) to join documents")
        self.tokenizer = tokenizer
        self.feature = feature

    def __len__(self) -> int:
        return len(self.source)

    def document(self, index: int) -> str:
        return _as_text(self.source[int(index) % len(self.source)][self.feature])

    def window(self, rng: np.random.Generator, num_tokens: int) -> np.ndarray:
        """int32 ``[num_tokens]``: consecutive tokens from a random place."""
        doc = int(rng.integers(len(self.source)))
        text = self.document(doc)
        offset = int(rng.integers(len(text))) if text else 0
        ids: list[int] = []
        first = True
        while len(ids) < num_tokens:
            need = num_tokens - len(ids)
            piece = text[offset : offset + _CHARS_PER_TOKEN * need + 64]
            new = list(self.tokenizer.encode(piece)) if piece else []
            if first and offset > 0 and new:
                new = new[1:]  # the window may start inside a word
            first = False
            offset += len(piece)
            ids.extend(new[:need])
            if len(ids) < num_tokens and offset >= len(text):
                ids.append(int(self.tokenizer.eos_id))  # on into the next document
                doc += 1
                text, offset = self.document(doc), 0
        return np.asarray(ids[:num_tokens], np.int32)

    def batch(self, rngs, length: int) -> dict[str, np.ndarray]:
        """One row per generator: ``tokens``, ``targets`` (``[len(rngs), length]``, the
        next tokens) and ``weights`` (all 1)."""
        windows = np.stack([self.window(rng, length + 1) for rng in rngs])
        return {
            "tokens": windows[:, :-1],
            "targets": windows[:, 1:],
            "weights": np.ones((len(rngs), length), np.float32),
        }
