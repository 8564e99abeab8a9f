"""Official ``.ckpt`` reading, Orbax conversion and the errors of bad checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from lhc.tabicl import (
    TabICLConfig,
    convert_to_orbax,
    load_checkpoint,
    load_orbax,
    params_to_state_dict,
)

torch = pytest.importorskip("torch")


def _state_dict_numpy(path):
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return checkpoint["config"], {k: v.numpy() for k, v in checkpoint["state_dict"].items()}


def test_checkpoint_round_trips_to_the_same_tensors(small_ckpt):
    config_dict, state = _state_dict_numpy(small_ckpt)
    config, params = load_checkpoint(small_ckpt)
    assert config == TabICLConfig(**config_dict)
    back = params_to_state_dict(config, params)
    assert set(back) == set(state)
    for key, value in state.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)


def test_orbax_conversion_keeps_config_and_tensors(small_ckpt, tmp_path):
    config_dict, state = _state_dict_numpy(small_ckpt)
    directory = convert_to_orbax(small_ckpt, tmp_path / "orbax")
    config, params = load_orbax(directory)
    assert config == TabICLConfig(**config_dict)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params))
    back = params_to_state_dict(config, params)
    for key, value in state.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)


def _write(path, config, state):
    torch.save({"config": config, "state_dict": state}, path)
    return path


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (
            lambda s: s.pop("icl_predictor.decoder.2.bias"),
            r"missing.*'icl_predictor\.decoder\.2\.bias'.*\(10,\)",
        ),
        (
            lambda s: s.__setitem__("col_embedder.extra.weight", torch.zeros(3)),
            r"does not define.*'col_embedder\.extra\.weight'",
        ),
        (
            lambda s: s.__setitem__("row_interactor.cls_tokens", torch.zeros(3, 16)),
            r"'row_interactor\.cls_tokens' has shape \(3, 16\), expected \(2, 16\)",
        ),
        (
            lambda s: s["col_embedder.in_linear.weight"].__setitem__(0, float("nan")),
            r"'col_embedder\.in_linear\.weight' contains NaN",
        ),
        (lambda s: s["row_interactor.tf_row.rope.freqs"].mul_(2.0), r"rope\.freqs.*row_rope_base"),
        (
            lambda s: s.__setitem__(
                "icl_predictor.y_encoder.bias", torch.zeros(32, dtype=torch.int64)
            ),
            r"'icl_predictor\.y_encoder\.bias' has dtype int64",
        ),
    ],
)
def test_mismatched_state_dicts_name_the_tensor(small_ckpt, tmp_path, edit, pattern):
    checkpoint = torch.load(small_ckpt, weights_only=True)
    state = {k: v.clone() for k, v in checkpoint["state_dict"].items()}
    edit(state)
    path = _write(tmp_path / "bad.ckpt", checkpoint["config"], state)
    with pytest.raises(ValueError, match=pattern):
        load_checkpoint(path)


def test_config_that_does_not_fit_the_weights(small_ckpt, tmp_path):
    checkpoint = torch.load(small_ckpt, weights_only=True)
    config = dict(checkpoint["config"], icl_num_blocks=3)
    path = _write(tmp_path / "deeper.ckpt", config, checkpoint["state_dict"])
    with pytest.raises(ValueError, match=r"missing.*'icl_predictor\.tf_icl\.blocks\.2\."):
        load_checkpoint(path)
    config = dict(checkpoint["config"], embed_dims=16)
    path = _write(tmp_path / "typo.ckpt", config, checkpoint["state_dict"])
    with pytest.raises(ValueError, match="unknown TabICL config keys.*embed_dims"):
        load_checkpoint(path)


def test_unreadable_or_incomplete_files(small_ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(tmp_path / "absent.ckpt")
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(open(small_ckpt, "rb").read()[:1000])
    with pytest.raises(ValueError, match="could not read"):
        load_checkpoint(garbage)
    torch.save(torch.zeros(3), tmp_path / "tensor.ckpt")
    with pytest.raises(ValueError, match="expected a dict"):
        load_checkpoint(tmp_path / "tensor.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "noconfig.ckpt")
    with pytest.raises(ValueError, match="no 'config' entry"):
        load_checkpoint(tmp_path / "noconfig.ckpt")


def test_orbax_checkpoint_with_a_wrong_config(small_ckpt, tmp_path):
    directory = convert_to_orbax(small_ckpt, tmp_path / "orbax")
    meta_file = directory / "tabicl_config.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["col_num_inds"] = 4
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"ind_vectors' has shape \(8, 16\), expected \(4, 16\)"):
        load_orbax(directory)
    with pytest.raises(FileNotFoundError, match="not an lhc TabICL Orbax checkpoint"):
        load_orbax(tmp_path)
    with pytest.raises(ValueError, match="already exists"):
        convert_to_orbax(small_ckpt, directory)


@pytest.mark.slow
def test_orbax_checkpoint_predicts_without_torch(small_ckpt, tmp_path):
    """Runtime code never needs torch: import of torch is made to fail in a fresh process."""
    directory = convert_to_orbax(small_ckpt, tmp_path / "orbax")
    script = textwrap.dedent(
        f"""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked")

        sys.meta_path.insert(0, NoTorch())
        from sklearn.datasets import load_iris
        from lhc.tabicl import TabICLClassifier

        X, y = load_iris(return_X_y=True)
        clf = TabICLClassifier(n_estimators=2, model_path={str(directory)!r}).fit(X[::2], y[::2])
        proba = clf.predict_proba(X[1::2])
        assert proba.shape == (75, 3) and abs(proba.sum(1) - 1).max() < 1e-5
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
