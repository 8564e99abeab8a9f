"""The pretraining prompts of ``lhc.icl.classification``."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc.icl.classification import LABEL_WORDS, SEPARATOR, query_targets, training_row
from lhc.train import config as config_lib
from lhc.train.trainer import build_experiment

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def _blocks(tokens):
    text = bytes(int(t) for t in tokens if t).decode()
    return [block.split("\n") for block in text.split("\n\n\n")]


def test_training_prompts_show_every_class_before_the_query():
    for seed in range(30):
        row = training_row(np.random.default_rng(seed), max_classes=5, max_shots=2, width=144)
        tokens = np.concatenate([row["tokens"][0, :1], row["targets"][0]])
        blocks = _blocks(tokens)
        labels = [label for _, label in blocks]
        assert all(label in LABEL_WORDS for label in labels)
        support, query = labels[:-1], labels[-1]
        counts = {label: support.count(label) for label in set(support)}
        # Every class the same number of times (1 or 2), and the query's label among them.
        assert len(set(counts.values())) == 1 and set(counts.values()) <= {1, 2}
        assert query in counts and 2 <= len(counts) <= 5
        # The loss weighs exactly the label words (5 letters each), nothing else.
        weights = row["weights"][0]
        weighted = bytes(int(t) for t in row["targets"][0][weights > 0]).decode()
        assert weighted == "".join(labels) and weights.sum() == 5 * len(labels)
        # Inputs: 4 upper-case letters before each separator.
        assert all(len(x) == 4 and x.isalpha() and x.isupper() for x, _ in blocks)
        assert SEPARATOR == ord("\n")


def test_evaluation_scores_the_query_label_against_a_direct_computation():
    config = config_lib.load_config(str(CONFIGS / "icl_classification.py") + ":runlocal")
    exp = build_experiment(config)
    params = nn.meta.unbox(exp.task.init_params(jax.random.key(0)))
    metrics = exp.task.evaluate(params)
    iterator = exp.task._eval_iterator(0, 1)
    hits, chance = [], []
    for _ in range(int(config.eval_batches)):
        batch = next(iterator)
        positions = np.broadcast_to(np.arange(batch["tokens"].shape[1]), batch["tokens"].shape)
        logits, _ = exp.task.model.apply({"params": params}, batch["tokens"], positions)
        for tokens, targets, row_logits in zip(
            batch["tokens"], batch["targets"], np.asarray(logits)
        ):
            # The query's label is the prompt's last five tokens.
            first = np.flatnonzero(targets)[-1] - 4
            assert bytes(targets[first : first + 5].tolist()).decode() in LABEL_WORDS
            hits.append(row_logits[first].argmax() == targets[first])
            labels = {label for _, label in _blocks(np.concatenate([tokens[:1], targets]))}
            chance.append(1 / len(labels))
    assert metrics["eval/query_accuracy"] == pytest.approx(np.mean(hits))
    assert metrics["eval/query_chance"] == pytest.approx(np.mean(chance))


def test_query_accuracy_reads_the_query_position_only(monkeypatch):
    config = config_lib.load_config(str(CONFIGS / "icl_classification.py") + ":runlocal")
    exp = build_experiment(config)

    def oracle(params, batch, rng=None):
        # Right everywhere but at the query's first label token in even rows.
        targets = batch["targets"]
        rows, width = jnp.arange(targets.shape[0]), targets.shape[1]
        query = width - 1 - jnp.argmax(targets[:, ::-1] != 0, axis=1) - 4
        wrong = (jnp.arange(width)[None] == query[:, None]) & (rows[:, None] % 2 == 0)
        return jax.nn.one_hot(jnp.where(wrong, targets + 1, targets), 256)

    monkeypatch.setattr(exp.task, "_logits", oracle)
    metrics = exp.task.evaluate(None)
    assert metrics["eval/query_accuracy"] == 0.5  # batches of 4 rows, 2 odd
    assert metrics["eval/accuracy"] < 1


def test_prompts_without_separator_are_the_same_prompts_with_the_separators_taken_out():
    for seed in range(10):
        kwargs = dict(max_classes=4, max_shots=2, width=112, input_length=1)
        with_sep = training_row(np.random.default_rng(seed), **kwargs)
        plain = training_row(np.random.default_rng(seed), separator=False, **kwargs)
        full = bytes(np.concatenate([with_sep["tokens"][0, :1], with_sep["targets"][0]]).tolist())
        text = bytes(np.concatenate([plain["tokens"][0, :1], plain["targets"][0]]).tolist())
        # The separator is the single newline between an input letter and its label.
        want = b"\n\n\n".join(
            b"".join(block.split(b"\n")) for block in full.rstrip(b"\0").split(b"\n\n\n")
        )
        assert text.rstrip(b"\0") == want
        labels = [block[1:] for block in want.split(b"\n\n\n")]
        weighted = bytes(plain["targets"][0][plain["weights"][0] > 0].tolist())
        assert weighted == b"".join(labels)


def test_stages_set_the_prompts_of_each_step_and_evaluation_uses_the_final_ones():
    config = config_lib.load_config(str(CONFIGS / "icl_classification.py") + ":runlocal")
    config.unlock()
    config.data.stages = [dict(steps=3, separator=False, max_classes=2), dict(steps=2, max_shots=1)]
    task = build_experiment(config).task

    def newlines(batch):  # per row: the newline count (3 per block, plus the separators)
        return (np.concatenate([batch["tokens"][:, :1], batch["targets"]], 1) == SEPARATOR).sum(1)

    def classes(batch):
        return query_targets(batch["targets"], batch["weights"])[1]

    rows = range(4)
    for step in range(3):
        batch = task._make_batch(0, step, rows)
        assert (classes(batch) == 2).all()
        blocks = [
            len(_blocks(np.concatenate([t[:1], u])))
            for t, u in zip(batch["tokens"], batch["targets"])
        ]
        assert (newlines(batch) == 3 * (np.array(blocks) - 1)).all()  # no separators
    for step in (3, 4):
        batch = task._make_batch(0, step, rows)
        blocks = [
            _blocks(np.concatenate([t[:1], u])) for t, u in zip(batch["tokens"], batch["targets"])
        ]
        # One demonstration per class and the query: classes + 1 blocks, separators back.
        assert [len(b) for b in blocks] == (classes(batch) + 1).tolist()
        assert all(len(block) == 2 for b in blocks for block in b)
    assert (
        task._data(5)
        == task._data(None)
        == {k: v for k, v in config.data.items() if k not in ("name", "stages")}
    )
    np.testing.assert_array_equal(
        task._make_eval_batch(0, 5, rows)["tokens"], task._make_batch(0, 5, rows)["tokens"]
    )
    # Evaluation at a step of the first stage: the final prompts, separators included.
    batch = task._make_eval_batch(0, 1, rows)
    blocks = [
        _blocks(np.concatenate([t[:1], u])) for t, u in zip(batch["tokens"], batch["targets"])
    ]
    assert all(len(block) == 2 for b in blocks for block in b)
    config.data.stages = [dict(steps=3, width=64)]
    with pytest.raises(ValueError, match=r"config.data.stages: .*width"):
        build_experiment(config).task._make_batch(0, 0, rows)


def test_a_separator_probability_mixes_the_two_prompt_formats():
    kwargs = dict(max_classes=3, max_shots=2, width=72, input_length=1)
    formats = []
    for seed in range(40):
        row = training_row(np.random.default_rng(seed), separator=0.5, **kwargs)
        blocks = _blocks(np.concatenate([row["tokens"][0, :1], row["targets"][0]]))
        sizes = {len(block) for block in blocks}
        assert sizes in ({1}, {2})  # all blocks with the separator, or none
        formats.append(sizes == {2})
    assert 10 < sum(formats) < 30
    with pytest.raises(ValueError, match="separator must be a bool or a probability"):
        training_row(np.random.default_rng(0), separator=1.5, **kwargs)
