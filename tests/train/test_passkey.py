"""Passkey examples (layout, depth, filler files) and the cached passkey scoring."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.train.passkey import (
    NEEDLE,
    QUESTION,
    Filler,
    answer_predictions,
    passkey_accuracy,
    passkey_batch,
    passkey_example,
)

TOKENIZER = lm.ByteTokenizer()


def _text(ids):
    return bytes(int(i) for i in ids).decode()


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_example_layout(depth):
    example = passkey_example(
        np.random.default_rng(0), length=300, tokenizer=TOKENIZER, depth=depth
    )
    tokens, targets, weights = example["tokens"], example["targets"], example["weights"]
    assert tokens.shape == targets.shape == weights.shape == (299,)
    np.testing.assert_array_equal(tokens[1:], targets[:-1])
    sequence = _text(np.concatenate([tokens, targets[-1:]]))
    key = str(example["key"])
    assert len(key) == 5 and key[0] != "0"
    assert sequence.endswith(QUESTION + key)
    needle = NEEDLE.format(key=key)
    start = sequence.index(needle)
    assert start == example["needle_start"]
    filler = len(sequence) - len(needle) - len(QUESTION) - len(key)
    assert start == round(depth * filler)
    # The loss counts exactly the positions that predict the key's digits.
    assert _text(targets[weights == 1]) == key


def test_filler_from_files(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("Call me Ishmael. Some years ago, never mind how long precisely.\n" * 3)
    filler = Filler([str(path)])
    example = passkey_example(
        np.random.default_rng(1), length=500, tokenizer=TOKENIZER, filler=filler
    )
    text = _text(example["tokens"])
    assert "Ishmael" in text and "grass is green" not in text
    batch = passkey_batch(
        np.random.default_rng(2), 3, length=200, tokenizer=TOKENIZER, filler=filler
    )
    assert batch["tokens"].shape == (3, 199)
    with pytest.raises(ValueError, match="is not a file"):
        Filler([str(tmp_path / "missing.txt")])
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="hold no text"):
        Filler([str(tmp_path / "empty.txt")])


def test_bad_arguments():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="too short"):
        passkey_example(rng, length=40, tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match=r"depth must lie in \[0, 1\]"):
        passkey_example(rng, length=300, tokenizer=TOKENIZER, depth=1.5)


def test_cached_predictions_equal_the_full_forward():
    # The scoring prefills in chunks and reads the answer positions through the cache;
    # a random model's argmax there (arbitrary tokens) must equal a full forward pass's.
    config = lm.LMConfig.tiny(vocab_size=259, max_len=256)
    model = lm.Transformer(config)
    params = lm.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(3)
    examples = [passkey_example(rng, length=120, tokenizer=TOKENIZER) for _ in range(3)]
    predicted = answer_predictions(model, params, examples, prefill_chunk=32)
    assert predicted.shape == (3, 5)
    tokens = jnp.asarray(np.stack([e["tokens"] for e in examples]))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = jax.jit(model.apply)({"params": params}, tokens, positions)
    for example, guess, row in zip(examples, predicted, np.asarray(logits)):
        np.testing.assert_array_equal(guess, np.argmax(row, -1)[example["weights"] == 1])
    # A length the model cannot take is not run; the table says so.
    result = passkey_accuracy(
        model, params, TOKENIZER, lengths=[120, 300], depths=[0.5], samples=3, prefill_chunk=32
    )
    assert 0 <= result.accuracy[0, 0] <= 1 and np.isnan(result.accuracy[1, 0])
    assert "| 120 |" in result.table() and "n/a" in result.table()
    assert result.metrics() == {"passkey/accuracy/120/0.5": result.accuracy[0, 0]}


def test_heat_map_draws_depth_by_length(tmp_path, monkeypatch):
    from matplotlib.image import imread

    from lhc import plots
    from lhc.train.passkey import PasskeyResult

    figures, save = [], plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figures.append(fig), save(fig, path)))
    accuracy = np.array([[1.0, 0.5], [np.nan, 0.0]])  # [length, depth]
    PasskeyResult((512, 2048), (0.0, 1.0), accuracy, 4).plot(str(tmp_path / "map.png"))
    (axis, _) = figures[0].axes  # the map and its colour bar
    drawn = axis.images[0].get_array()  # rows: depths, columns: lengths
    np.testing.assert_array_equal(drawn.mask, [[False, True], [False, False]])
    np.testing.assert_array_equal(drawn.filled(-1.0), [[1.0, -1.0], [0.5, 0.0]])
    assert [t.get_text() for t in axis.get_xticklabels()] == ["512", "2K"]
    assert [t.get_text() for t in axis.get_yticklabels()] == ["0", "1"]
    assert [t.get_text() for t in axis.texts] == ["1.00", "n/a", "0.50", "0.00"]
    assert imread(tmp_path / "map.png").shape[:2] == (384, 360)  # 3.0 x 3.2 in at 120 dpi
