"""The many-shot classification episodes, the patch-encoder LM and ``lhc bench emloc``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.emloc import bench, manyshot
from lhc.emloc.manyshot import IMAGE_TOKEN, NEWLINE, ManyShot


@pytest.mark.parametrize("modality", ["text", "image"])
def test_training_rows_teach_labels_that_only_the_context_names(modality):
    task = ManyShot(modality=modality)
    rows = [manyshot.training_row(np.random.default_rng(seed), task, shots=30) for seed in (0, 1)]
    for row in rows:
        tokens = np.concatenate([row["tokens"][0], row["targets"][0, -1:]])
        assert tokens.size == 30 * task.demo_length
        demos = tokens.reshape(30, task.demo_length)
        assert np.all(demos[:, -1] == NEWLINE)
        labels = demos[:, -2]
        assert np.all((labels >= ord("A")) & (labels <= ord("Z")))
        # The loss is on the labels only.
        np.testing.assert_array_equal(row["targets"][0][row["weights"][0] > 0], labels)
        assert row["weights"].sum() == 30
        if modality == "text":
            # Without noise, a label's inputs use its own 3 keywords and no other label's.
            clean = ManyShot(modality="text", noise=0.0)
            clean_row = manyshot.training_row(np.random.default_rng(7), clean, shots=30)
            clean_demos = np.concatenate([clean_row["tokens"][0], clean_row["targets"][0, -1:]])
            clean_demos = clean_demos.reshape(30, clean.demo_length)
            words = {
                label: set(clean_demos[clean_demos[:, -2] == label, :-2].ravel())
                for label in np.unique(clean_demos[:, -2])
            }
            assert all(len(w) <= 3 for w in words.values())
            assert sum(len(w) for w in words.values()) == len(set().union(*words.values()))
        else:
            assert np.all(demos[:, :-2] == IMAGE_TOKEN)
            features = row["features"][0][: -(task.demo_length - 1) or None]
            assert features.shape[1] == task.feature_dim
    # Episodes differ: labels are drawn anew.
    first = [np.concatenate([r["tokens"][0], r["targets"][0, -1:]]) for r in rows]
    assert set(first[0][task.demo_length - 2 :: task.demo_length]) != set(
        first[1][task.demo_length - 2 :: task.demo_length]
    ) or not np.array_equal(first[0], first[1])


def test_rows_of_fewer_shots_are_right_padded_and_weigh_nothing_there():
    task = ManyShot(modality="text", input_length=1, keywords=1)
    counts = set()
    for seed in range(12):
        row = manyshot.training_row(np.random.default_rng(seed), task, shots=6, min_shots=2)
        assert row["tokens"].shape == (1, 6 * task.demo_length - 1)
        tokens = np.concatenate([row["tokens"][0], row["targets"][0, -1:]])
        real = int(np.sum(tokens != 0))
        assert real % task.demo_length == 0 and np.all(tokens[real:] == 0)
        counts.add(real // task.demo_length)
        assert row["weights"].sum() == real // task.demo_length
        assert np.all(row["weights"][0, real - 1 :] == 0)
    assert counts <= set(range(2, 7)) and len(counts) > 2


def test_image_prototypes_are_recoverable_from_the_features():
    task = ManyShot(modality="image", noise=0.1, pixel_noise=0.2)
    ep = manyshot.episode(np.random.default_rng(3), task, shots=40, queries=10)
    labels = np.array([d.tokens[-2] for d in ep.demonstrations])
    pixels = np.array([f[: task.patches, : task.patch**2].ravel() for f in ep.features[:40]])
    means = {label: pixels[labels == label].mean(0) for label in np.unique(labels)}
    # Each query's nearest class mean is its answer's (the task is learnable from context).
    for query, answer in zip(ep.features[40:], ep.answers):
        x = query[: task.patches, : task.patch**2].ravel()
        nearest = min(means, key=lambda label: np.sum((means[label] - x) ** 2))
        assert nearest == answer


def test_patch_lm_puts_encoded_patches_in_place_of_image_tokens():
    config = lm.LMConfig.tiny(vocab_size=manyshot.VOCAB_SIZE, scan_layers=False)
    model = manyshot.PatchLM(config)
    task = ManyShot(modality="image")
    row = manyshot.training_row(np.random.default_rng(0), task, shots=3)
    tokens, features = jnp.asarray(row["tokens"]), jnp.asarray(row["features"])
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    params = model.init(jax.random.key(0), tokens, positions, features=features)["params"]
    logits, _ = model.apply({"params": params}, tokens, positions, features=features)
    encoded = manyshot.PatchEncoder(config.embed_dim).apply({"params": params["encoder"]}, features)
    expected, _ = lm.Transformer(config).apply(
        {"params": params["lm"]},
        tokens,
        positions,
        embeddings=encoded,
        embedding_mask=tokens == IMAGE_TOKEN,
    )
    np.testing.assert_allclose(logits, expected, rtol=1e-6)
    text_only, _ = lm.Transformer(config).apply({"params": params["lm"]}, tokens, positions)
    assert not np.allclose(logits, text_only)


def test_bad_episode_settings_are_refused():
    with pytest.raises(ValueError, match="modality must be"):
        ManyShot(modality="audio")
    with pytest.raises(ValueError, match="exceeds the 26 lower-case letters"):
        ManyShot(classes=10, keywords=3)
    with pytest.raises(ValueError, match="must divide image_size"):
        ManyShot(modality="image", patch=3)


def test_bench_table_on_a_random_image_model(capsys):
    config = lm.LMConfig.tiny(vocab_size=manyshot.VOCAB_SIZE, scan_layers=False)
    model = manyshot.PatchLM(config)
    task = ManyShot(modality="image")
    row = manyshot.training_row(np.random.default_rng(0), task, shots=1)
    tokens = jnp.asarray(row["tokens"])
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    params = model.init(jax.random.key(0), tokens, positions, features=jnp.asarray(row["features"]))
    args = bench._parser().parse_args(
        "--workdir unused --shots 8 --episodes 1 --queries 3 --chunk-size 4 --deltas 0.01".split()
    )
    make = bench._generated_episodes(model, params["params"], task, shots=8, queries=3)
    lm_model, lm_params = lm.Transformer(config), params["params"]["lm"]
    result = bench.evaluate(lm_model, lm_params, {"image": make}, "image", args)
    out = capsys.readouterr().out
    head = "| task | method | delta | accuracy | kept | memory (KiB) | compression (s) |"
    assert head + " compiling (s) |\n" in out
    assert "\n|---|---|---:|---:|---:|---:|---:|---:|\n| image | full context | — | " in out
    assert "\n| image | EMLoC | 0.01 | " in out
    methods = {(t["method"], t["delta"]) for t in result["table"]}
    assert methods == {("full context", None)} | {
        (m, 0.01) for m in ("EMLoC", "uniform", "SnapKV-style", "fewer shots")
    }
    full = next(t for t in result["table"] if t["method"] == "full context")
    assert full["kept"] == 1.0
    context = 8 * task.demo_length
    per_token = 2 * config.num_kv_heads * config.head_dim * 4 / 1024
    assert full["memory_kib"] == pytest.approx(context * per_token * config.num_layers)
    emloc_row = next(r for r in result["rows"] if r["method"] == "EMLoC")
    for r in result["rows"]:  # the baselines get EMLoC's budget
        assert 0 < r["kept"] <= 1 and 0 <= r["accuracy"] <= 1
        if r["method"] in ("uniform", "SnapKV-style", "fewer shots"):
            assert r["kept"] <= max(emloc_row["kept"], 8 / context) + 1e-9
