"""Decision Transformer and Decision Mixer: the router's selection and capacity, the
routed block against the block run on the gathered tokens, causality at inference."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc.dm.config import DMConfig
from lhc.dm.model import Block, DecisionModel, Router, aux_loss, flops_per_action, kth_largest

S, A, K = 4, 2, 6


def _inputs(seed=0, batch=2):
    rng = np.random.default_rng(seed)
    return dict(
        states=jnp.asarray(rng.normal(size=(batch, K, S)), jnp.float32),
        actions=jnp.asarray(rng.uniform(-1, 1, size=(batch, K, A)), jnp.float32),
        returns_to_go=jnp.asarray(rng.uniform(0, 3, size=(batch, K, 1)), jnp.float32),
        timesteps=jnp.asarray(np.tile(np.arange(10, 10 + K), (batch, 1)), jnp.int32),
    )


def _model(**kwargs):
    config = DMConfig(
        state_dim=S,
        action_dim=A,
        context=K,
        embed_dim=16,
        num_layers=4,
        num_heads=2,
        max_ep_len=64,
        dropout=0.0,
        **kwargs,
    )
    model = DecisionModel(config)
    inputs = _inputs()
    params = nn.meta.unbox(model.init(jax.random.key(0), **inputs)["params"])
    return model, params


def test_kth_largest_against_a_sort():
    scores = jnp.asarray(np.random.default_rng(0).normal(size=(3, 9)), jnp.float32)
    ranked = -np.sort(-np.asarray(scores), axis=-1)
    for k in (1, 4, 9):
        got = kth_largest(scores, jnp.full((3,), float(k)))
        np.testing.assert_allclose(got, ranked[:, k - 1])
    got = kth_largest(scores, jnp.full((3,), 2.25))
    np.testing.assert_allclose(got, 0.75 * ranked[:, 1] + 0.25 * ranked[:, 2], rtol=1e-6)


def test_router_selection_capacity_and_the_routed_block():
    config = DMConfig(state_dim=S, action_dim=A, context=K, embed_dim=16, num_heads=2, dropout=0.0)
    tokens = 3 * K
    x = jax.random.normal(jax.random.key(1), (2, tokens, 16))
    valid = jnp.ones((2, tokens), bool).at[1, :3].set(False)  # row 1: one padded step
    router = Router(config)
    params = router.init(jax.random.key(2), x, valid, selection="topk", deterministic=True)
    out, info = router.apply(params, x, valid, selection="topk", deterministic=True)
    scores, selected = np.asarray(info["scores"]), np.asarray(info["selected"])
    for row in range(2):
        real = np.flatnonzero(np.asarray(valid[row]))
        k = float(info["capacity"][row])
        assert 1 <= k <= tokens
        ranked = -np.sort(-scores[row, real])
        low = int(np.floor(k))
        threshold = (
            ranked[low - 1]
            if low == len(real)
            else ranked[low - 1] + (k - low) * (ranked[low] - ranked[low - 1])
        )
        expected = np.zeros(tokens, bool)
        expected[real] = scores[row, real] > threshold
        np.testing.assert_array_equal(selected[row], expected)
        assert selected[row].sum() == int(np.ceil(k)) - 1  # distinct scores
        # Unselected tokens pass through unchanged.
        np.testing.assert_array_equal(
            np.asarray(out[row])[~expected], np.asarray(x[row])[~expected]
        )
        # Selected tokens: w * block(x) with the block run on the selected tokens alone.
        picked = np.flatnonzero(expected)
        gathered = x[row : row + 1, picked]
        block = Block(config)
        reference = block.apply(
            {"params": params["params"]["block"]},
            gathered,
            jnp.arange(len(picked))[None],
            deterministic=True,
        )[0]
        np.testing.assert_allclose(
            np.asarray(out[row, picked]),
            scores[row, picked, None] * np.asarray(reference),
            rtol=2e-5,
            atol=2e-6,
        )


def test_capacity_predictor_receives_gradient_and_can_be_fixed():
    model, params = _model(router=True)
    inputs = _inputs(1)

    def loss(p):
        predicted, _ = model.apply({"params": p}, **inputs)
        return jnp.sum((predicted - inputs["actions"]) ** 2)

    grads = jax.grad(loss)(params)
    for layer in ("router_1", "router_3"):
        assert float(jnp.abs(grads[layer]["capacity_out"]["kernel"]).sum()) > 0
        assert float(jnp.abs(grads[layer]["score"]["kernel"]).sum()) > 0
    fixed, fixed_params = _model(router=True, fixed_capacity=0.5)
    _, aux = fixed.apply({"params": fixed_params}, **inputs)
    for info in aux["routers"]:
        np.testing.assert_allclose(info["capacity"], 0.5 * 3 * K)
        assert np.all(np.asarray(info["selected"]).sum(1) == int(np.ceil(0.5 * 3 * K)) - 1)


@pytest.mark.parametrize("router", [False, True])
def test_inference_is_causal(router):
    # Changing a later step's state, action or return never changes an earlier
    # selection or action (with the auxiliary predictor's selection at inference).
    model, params = _model(router=router)
    inputs = _inputs(2)
    selection = "aux" if router else "topk"
    base, base_aux = model.apply({"params": params}, **inputs, selection=selection)
    for step in (2, 4):
        changed = dict(inputs)
        for key in ("states", "actions", "returns_to_go"):
            changed[key] = inputs[key].at[:, step].add(3.0)
        out, aux = model.apply({"params": params}, **changed, selection=selection)
        np.testing.assert_allclose(out[:, :step], base[:, :step], rtol=1e-5, atol=1e-6)
        assert not np.allclose(out[:, step:], base[:, step:])
        for a, b in zip(aux["routers"], base_aux["routers"]):
            np.testing.assert_array_equal(
                a["selected"][:, : 3 * step], b["selected"][:, : 3 * step]
            )


def test_top_k_selection_at_training_is_not_causal():
    # Why the released method needs the auxiliary predictor: top-k over the whole
    # window lets a later token change which earlier tokens are selected.
    model, params = _model(router=True)
    inputs = _inputs(3)
    _, base = model.apply({"params": params}, **inputs)
    flips = 0
    for seed in range(4):
        noise = jax.random.normal(jax.random.key(seed), (2, S + A + 1)) * 5
        changed = dict(
            inputs,
            states=inputs["states"].at[:, -1].add(noise[:, :S]),
            actions=inputs["actions"].at[:, -1].add(noise[:, S : S + A]),
            returns_to_go=inputs["returns_to_go"].at[:, -1].add(noise[:, -1:]),
        )
        _, aux = model.apply({"params": params}, **changed)
        for a, b in zip(aux["routers"], base["routers"]):
            flips += int(
                np.sum(np.asarray(a["selected"])[:, :-3] != np.asarray(b["selected"])[:, :-3])
            )
    assert flips > 0


def test_left_padding_with_a_mask_changes_nothing():
    model, params = _model(router=False)
    inputs = _inputs(4, batch=1)
    pad = 2
    padded = {
        key: jnp.concatenate([jnp.zeros_like(value[:, :pad]), value[:, :-pad]], axis=1)
        for key, value in inputs.items()
    }
    mask = jnp.asarray([[False] * pad + [True] * (K - pad)])
    short = DecisionModel(model.config.__class__(**{**model.config.__dict__, "context": K - pad}))
    out_padded, _ = model.apply({"params": params}, **padded, mask=mask)
    out_short, _ = short.apply({"params": params}, **{k: v[:, :-pad] for k, v in inputs.items()})
    np.testing.assert_allclose(out_padded[:, pad:], out_short, rtol=1e-5, atol=1e-6)


def test_aux_loss_against_cross_entropy():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(2, 6, 2)).astype(np.float32)
    topk = rng.random((2, 6)) < 0.5
    valid = np.ones((2, 6), bool)
    valid[0, :2] = False
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.where(topk, log_probs[..., 1], log_probs[..., 0])
    expected = nll[valid].mean()
    got = aux_loss(
        [dict(aux_logits=jnp.asarray(logits), topk=jnp.asarray(topk))], jnp.asarray(valid)
    )
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_flops_per_action():
    config = DMConfig(state_dim=S, action_dim=A, context=20, embed_dim=64, num_layers=4)
    t, d = 60, 64
    assert flops_per_action(config) == pytest.approx(4 * (t * 24 * d * d + 4 * t * t * d))
    mixer = DMConfig(state_dim=S, action_dim=A, context=20, embed_dim=64, num_layers=4, router=True)
    router = 2 * t * d + 2 * t * d * 512 + 2 * t * (d * d // 2 + d)
    block = lambda n: n * 24 * d * d + 4 * n * n * d  # noqa: E731
    assert flops_per_action(mixer, [30, 10]) == pytest.approx(
        2 * block(t) + block(30) + block(10) + 2 * router
    )


def test_config_errors():
    with pytest.raises(ValueError, match="fixed_capacity"):
        DMConfig(state_dim=S, action_dim=A, fixed_capacity=1.5)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        DMConfig(state_dim=S, action_dim=A, embed_dim=10, num_heads=4)
    model, params = _model(router=True)
    with pytest.raises(ValueError, match="selection: expected one of"):
        model.apply({"params": params}, **_inputs(), selection="random")


@pytest.mark.parametrize("router", [False, True])
def test_every_parameter_has_logical_axis_names(router):
    """Each parameter is boxed with one name per axis, each name known to the sharding
    rules, so the model shards with the same rules as every other lhc model."""
    from lhc.parallel.mesh import LOGICAL_AXIS_RULES

    config = DMConfig(
        state_dim=S,
        action_dim=A,
        context=K,
        embed_dim=16,
        num_layers=2,
        num_heads=2,
        max_ep_len=64,
        router=router,
    )
    boxed = DecisionModel(config).init(jax.random.key(0), **_inputs())["params"]
    known = {name for name, _ in LOGICAL_AXIS_RULES}
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(leaf, nn.Partitioned) for leaf in leaves)
    for leaf in leaves:
        assert len(leaf.names) == leaf.value.ndim
        assert {name for name in leaf.names if name is not None} <= known


def test_bfloat16_parameters_and_compute_follow_the_float32_model():
    # The same weights stored in bfloat16 and computed in bfloat16: every parameter is
    # bfloat16 and the actions stay within bfloat16's rounding of the float32 ones.
    model, params = _model(router=True)
    half, _ = _model(router=True, dtype="bfloat16", param_dtype="bfloat16")
    init = half.init(jax.random.key(0), **_inputs())["params"]
    dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(nn.meta.unbox(init))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    inputs = _inputs(3)
    full, _ = model.apply({"params": params}, **inputs, selection="aux")
    cast = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    out, _ = half.apply({"params": cast}, **inputs, selection="aux")
    assert not np.array_equal(out, full)  # computed in bfloat16 ...
    np.testing.assert_allclose(out, full, atol=0.05)  # ... close to float32
    with pytest.raises(ValueError, match="DMConfig.dtype"):
        _model(dtype="float8")
