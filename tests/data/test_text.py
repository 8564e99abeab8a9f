"""tfds text windows (lhc.data.TfdsText) on a tiny dataset built here, and
configs/gca_pg19.py's input pipeline and GCA loss on it."""

from __future__ import annotations

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from lhc.data.text import TfdsText  # noqa: E402
from lhc.lm.tokenizers import ByteTokenizer  # noqa: E402

TOKENIZER = ByteTokenizer()
EOS = chr(0x2400)  # stands for the end-of-sequence token in the decoded text below


def _documents(split: str) -> list[str]:
    rng = np.random.default_rng(0 if split == "train" else 1)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    # Documents of very different lengths, one shorter than a window.
    sizes = [400, 30, 1200, 250] if split == "train" else [300, 500]
    return [
        f"doc{i} " + " ".join(rng.choice(words, size=n // 6)) + "." for i, n in enumerate(sizes)
    ]


class TinyBooks(tfds.core.GeneratorBasedBuilder):
    """A few generated documents in two splits."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
        )

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(split) for split in ("train", "validation")}

    def _generate_examples(self, split):
        for i, text in enumerate(_documents(split)):
            yield i, {"text": text}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    TinyBooks(data_dir=str(path), file_format="array_record").download_and_prepare()
    return str(path)


def _decode(ids) -> str:
    return "".join(EOS if i == TOKENIZER.eos_id else chr(i) for i in ids)


def test_windows_are_consecutive_text_of_the_documents(data_dir):
    source = TfdsText("tiny_books", split="train", tokenizer=TOKENIZER, data_dir=data_dir)
    assert len(source) == 4
    docs = _documents("train")
    assert sorted(source.document(i) for i in range(4)) == sorted(docs)
    # Any window lies in the documents read in the source's order, joined by EOS.
    stream = EOS.join(source.document(i) for i in range(len(source))) + EOS
    stream = stream + stream  # a window may wrap around to the first document
    rng = np.random.default_rng(3)
    crossed = 0
    for _ in range(40):
        window = source.window(rng, 200)
        assert window.shape == (200,) and window.dtype == np.int32
        text = _decode(window)
        assert text in stream
        crossed += EOS in text
    assert crossed > 0  # some windows run past the end of a document


def test_batches_are_deterministic_next_token_pairs(data_dir):
    source = TfdsText("tiny_books", split="validation", tokenizer=TOKENIZER, data_dir=data_dir)
    first = source.batch([np.random.default_rng(s) for s in (5, 6)], 64)
    again = source.batch([np.random.default_rng(s) for s in (5, 6)], 64)
    for name in ("tokens", "targets", "weights"):
        np.testing.assert_array_equal(first[name], again[name])
    assert first["tokens"].shape == first["targets"].shape == (2, 64)
    np.testing.assert_array_equal(first["tokens"][:, 1:], first["targets"][:, :-1])
    assert np.all(first["weights"] == 1)


def test_bad_dataset_split_or_feature_raise(data_dir, tmp_path):
    with pytest.raises(ValueError, match="not prepared"):
        TfdsText("tiny_books", split="train", tokenizer=TOKENIZER, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="splits"):
        TfdsText("tiny_books", split="test", tokenizer=TOKENIZER, data_dir=data_dir)
    with pytest.raises(ValueError, match="features"):
        TfdsText(
            "tiny_books", split="train", tokenizer=TOKENIZER, data_dir=data_dir, feature="book"
        )


def test_pg19_config_reads_a_local_tfds_dataset_into_its_gca_loss(data_dir):
    import jax

    from lhc.train import build_experiment
    from lhc.train import config as config_lib

    config = config_lib.load_config(
        "configs/gca_pg19.py:runlocal",
        ["data.tfds_name=tiny_books", f"data.data_dir={data_dir}"],
    )
    task = build_experiment(config).task
    spec = task.batch_spec(config.batch_size)
    for batch in (next(task.train_iterator(0, 1)), next(task._eval_iterator(0, 1))):
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
            k: (s.shape, s.dtype) for k, s in spec.items()
        }
        assert batch["tokens"].max() < config.model.vocab_size
    # The model takes the batches (traced, not compiled) to a scalar loss.
    params = jax.eval_shape(task.init_params, jax.random.key(0))
    loss, _ = jax.eval_shape(task.loss, params, spec, jax.random.key(1))
    assert loss.shape == ()
