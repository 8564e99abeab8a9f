"""Fixtures of the TabICL tests: random reference models from ``tabicl`` 0.1.4.

Every reference parameter is perturbed (the zero-initialised ``out_proj`` and
``linear2`` included) so that no branch of the network is silently zero. The rotary
frequencies stay as the reference computes them from ``row_rope_base``.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

# One small architecture shared by most tests, so that compiled programs are reused.
SMALL_CONFIG = dict(
    max_classes=10,
    embed_dim=16,
    col_num_blocks=2,
    col_nhead=2,
    col_num_inds=8,
    row_num_blocks=2,
    row_nhead=2,
    row_num_cls=2,
    row_rope_base=100000,
    icl_num_blocks=2,
    icl_nhead=2,
    ff_factor=2,
    dropout=0.0,
    activation="gelu",
    norm_first=True,
)

# Every architecture switch away from the default: post-norm, ReLU, other widths and
# head counts, rope base, feed-forward factor, and fewer native classes.
OTHER_CONFIG = dict(
    max_classes=5,
    embed_dim=24,
    col_num_blocks=1,
    col_nhead=3,
    col_num_inds=5,
    row_num_blocks=3,
    row_nhead=3,
    row_num_cls=3,
    row_rope_base=1000.0,
    icl_num_blocks=1,
    icl_nhead=4,
    ff_factor=3,
    dropout=0.0,
    activation="relu",
    norm_first=False,
)


def make_reference_model(config: dict, seed: int = 0, scale: float = 0.1):
    """A ``tabicl.TabICL`` in eval mode with every parameter perturbed."""
    torch = pytest.importorskip("torch")
    tabicl = pytest.importorskip("tabicl")
    torch.manual_seed(seed)
    model = tabicl.TabICL(**config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("rope.freqs"):
                param.add_(scale * torch.randn_like(param))
    return model.eval()


def save_reference(model, config: dict, path) -> str:
    torch = pytest.importorskip("torch")
    torch.save({"config": dict(config), "state_dict": model.state_dict()}, path)
    return str(path)


@pytest.fixture(scope="session")
def small_reference():
    return make_reference_model(SMALL_CONFIG, seed=0)


@pytest.fixture(scope="session")
def small_ckpt(small_reference, tmp_path_factory):
    return save_reference(
        small_reference, SMALL_CONFIG, tmp_path_factory.mktemp("tabicl") / "small.ckpt"
    )


@pytest.fixture(scope="session")
def small_lhc(small_reference):
    """``(model, params)`` of lhc converted from ``small_reference``."""
    from lhc.tabicl import TabICL, TabICLConfig, state_dict_to_params

    config = TabICLConfig(**SMALL_CONFIG)
    return TabICL(config), state_dict_to_params(config, small_reference.state_dict())


def random_table(rng: np.random.Generator, tables: int, rows: int, features: int):
    """Gaussian cells with a few heavy-tailed columns, float32 ``[tables, rows, features]``."""
    X = rng.normal(size=(tables, rows, features))
    X[..., ::3] = np.sinh(2 * X[..., ::3])
    return X.astype(np.float32)


def random_labels(rng: np.random.Generator, tables: int, rows: int, classes: int):
    """Each table's labels are a shuffled balanced 0..classes-1 (every class present)."""
    return np.stack([rng.permutation(np.arange(rows) % classes) for _ in range(tables)])


@pytest.fixture(scope="session")
def tabicl_helpers():
    """The configs and helpers above (test modules cannot import this conftest by name)."""
    return types.SimpleNamespace(
        SMALL_CONFIG=SMALL_CONFIG,
        OTHER_CONFIG=OTHER_CONFIG,
        make_reference_model=make_reference_model,
        save_reference=save_reference,
        random_table=random_table,
        random_labels=random_labels,
    )
