import math
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lhc.train.optim import make_optimizer, make_schedule, weight_decay_mask

CONFIGS = pathlib.Path(__file__).parents[2] / "configs"


def _opt(**kw):
    base = dict(
        name="adamw",
        learning_rate=1.0,
        warmup_steps=10,
        schedule="cosine",
        end_lr_fraction=0.1,
        weight_decay=0.0,
        grad_clip_norm=0.0,
    )
    base.update(kw)
    return ml_collections.ConfigDict(base)


def test_warmup_then_cosine_matches_closed_form():
    schedule = make_schedule(_opt(), num_steps=110)
    for step in [0, 5, 10, 35, 60, 110]:
        if step < 10:
            want = step / 10
        else:
            t = (step - 10) / 100
            want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
        assert float(schedule(step)) == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_unknown_schedule_and_optimizer():
    with pytest.raises(ValueError, match="optimizer.schedule"):
        make_schedule(_opt(schedule="zigzag"), 10)
    with pytest.raises(ValueError, match="optimizer.name"):
        make_optimizer(_opt(name="lion2"), 10)


def test_adamw_step_matches_hand_computation_with_mask_and_clipping():
    params = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones((2,))}
    grads = {"kernel": jnp.full((2, 2), 3.0), "bias": jnp.full((2,), 4.0)}
    tx, _ = make_optimizer(
        _opt(
            warmup_steps=0,
            schedule="constant",
            learning_rate=0.1,
            weight_decay=0.5,
            grad_clip_norm=1.0,
            b1=0.9,
            b2=0.95,
            eps=1e-8,
        ),
        10,
    )
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    norm = math.sqrt(4 * 9 + 2 * 16)
    # First Adam step: m_hat = g, v_hat = g^2, so the direction is sign(g) (|g| >> eps).
    for name, g in grads.items():
        clipped = np.asarray(g) / norm
        direction = clipped / (np.abs(clipped) + 1e-8)
        decay = 0.5 * np.asarray(params[name]) if name == "kernel" else 0.0
        np.testing.assert_allclose(updates[name], -0.1 * (direction + decay), rtol=1e-5)
    assert weight_decay_mask(params) == {"kernel": True, "bias": False}


def test_frozen_prefixes_get_zero_updates():
    params = {
        "col_embedder": {"w": jnp.ones((2, 2))},
        "icl": {"decoder": {"w": jnp.ones((2, 2))}, "ln": {"scale": jnp.ones((2,))}},
    }
    grads = jax.tree.map(jnp.ones_like, params)
    tx, _ = make_optimizer(_opt(frozen=("col_embedder", "icl/decoder"), warmup_steps=0), 10)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert float(jnp.abs(updates["col_embedder"]["w"]).max()) == 0.0
    assert float(jnp.abs(updates["icl"]["decoder"]["w"]).max()) == 0.0
    assert float(jnp.abs(updates["icl"]["ln"]["scale"]).min()) > 0.0


def test_polynomial_schedule_closed_form():
    schedule = make_schedule(
        _opt(schedule="polynomial", decay_power=2.0, warmup_steps=0, end_lr_fraction=0.25), 100
    )
    for step in [0, 30, 100]:
        want = (1.0 - 0.25) * (1 - step / 100) ** 2 + 0.25
        assert float(schedule(step)) == pytest.approx(want, rel=1e-5)


def test_warmup_and_decay_follow_a_num_steps_override():
    # The config computes no schedule lengths: warm-up (5% of the run) and the cosine
    # decay to 0.1 x the peak are drawn from num_steps as overridden.
    from lhc.train.config import load_config

    spec = str(CONFIGS / "lm_assoc_recall.py") + ":tiny"
    config = load_config(spec, ["--config.num_steps=60"])
    _, schedule = make_optimizer(config.optimizer, config.num_steps)
    peak = config.optimizer.learning_rate
    assert float(schedule(3)) == pytest.approx(peak) and float(schedule(1)) < peak
    t = (30 - 3) / (60 - 3)
    middle = peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
    assert float(schedule(30)) == pytest.approx(middle, rel=1e-5)
    assert float(schedule(60)) == pytest.approx(0.1 * peak, rel=1e-5)
    # An explicit warmup_steps wins over the fraction.
    fixed = load_config(spec, ["num_steps=60", "optimizer.warmup_steps=20"])
    _, schedule = make_optimizer(fixed.optimizer, fixed.num_steps)
    assert float(schedule(10)) == pytest.approx(peak / 2) and float(schedule(20)) == pytest.approx(
        peak
    )
