"""Low-rank adapters: the adapted model against the numpy reference with W + s A B."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.nn.lora import LoRA, combine, merge, split

from ..support import forward

TARGETS = ("attention/(query|value)", "mlp/down")


def _adapted(kernel_layout, scan_layers=False):
    config = lm.LMConfig.tiny(kernel_layout=kernel_layout, scan_layers=scan_layers)
    lora = LoRA(rank=3, alpha=6.0, targets=TARGETS)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, 12)))
    positions = jnp.arange(12)[None]

    @jax.jit
    def init(rng):
        with lora.applied():
            return lm.Transformer(config).init(rng, tokens, positions)["params"]

    return config, lora, tokens, positions, nn.meta.unbox(init(jax.random.key(0)))


def _logits(config, params, tokens, positions, lora=None):
    """The model's logits, jitted (inside ``lora.applied()`` when given)."""

    @jax.jit
    def apply(params):
        with lora.applied() if lora else contextlib.nullcontext():
            return lm.Transformer(config).apply({"params": params}, tokens, positions)[0]

    return np.asarray(apply(params))


def test_a_fresh_adapter_leaves_the_logits_unchanged():
    config, lora, tokens, positions, params = _adapted("in_out")
    base, adapters = split(params)
    assert float(jnp.abs(adapters["layers_0"]["attention"]["query"]["lora_a"]).max()) > 0
    plain = _logits(config, base, tokens, positions)
    adapted = _logits(config, params, tokens, positions, lora)
    np.testing.assert_allclose(adapted, plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kernel_layout", ["in_out", "out_in"])
def test_adapters_add_scale_a_b_to_their_kernels(kernel_layout):
    config, lora, tokens, positions, params = _adapted(kernel_layout)
    base, adapters = split(params)
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), adapters)
    adapted = _logits(config, combine(base, adapters), tokens, positions, lora)
    # The reference: numpy, each adapted kernel W + alpha / rank * A B in in_out form.
    reference = jax.tree.map(np.asarray, lm.convert_kernel_layout(base, config, "in_out"))
    for layer in range(config.num_layers):
        for path in (("attention", "query"), ("attention", "value"), ("mlp", "down")):
            pair = adapters[f"layers_{layer}"][path[0]][path[1]]
            entry = reference[f"layers_{layer}"][path[0]][path[1]]
            a, b = np.asarray(pair["lora_a"], np.float64), np.asarray(pair["lora_b"], np.float64)
            entry["kernel"] = entry["kernel"] + (2.0 * a @ b).reshape(entry["kernel"].shape)
    in_out = config.replace(kernel_layout="in_out")
    expected = forward(in_out, reference, np.asarray(tokens[0]))
    np.testing.assert_allclose(adapted[0], expected, atol=2e-4, rtol=2e-4)
    # Merged into the kernels: the plain model gives the same logits.
    merged = merge(combine(base, adapters), lora, kernel_layout)
    plain = _logits(config, merged, tokens, positions)
    np.testing.assert_allclose(plain[0], expected, atol=2e-4, rtol=2e-4)


def test_scanned_layers_get_stacked_adapters_and_the_gradient_reaches_them():
    config, lora, tokens, positions, params = _adapted("in_out", scan_layers=True)
    base, adapters = split(params)
    query = adapters["layers"]["attention"]["query"]
    assert query["lora_a"].shape == (config.num_layers, config.embed_dim, 3)
    assert query["lora_b"].shape == (config.num_layers, 3, config.num_heads * config.head_dim)

    def loss(adapters):
        with lora.applied():
            logits, _ = lm.Transformer(config).apply(
                {"params": combine(base, adapters)}, tokens, positions
            )
        return logits.sum()

    grads = jax.jit(jax.grad(loss))(adapters)
    # B starts at zero: A gets no gradient yet, B does, in every layer.
    assert float(jnp.abs(grads["layers"]["mlp"]["down"]["lora_a"]).max()) == 0.0
    assert all(float(jnp.abs(g).max()) > 0 for g in grads["layers"]["mlp"]["down"]["lora_b"])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="lora.rank"):
        LoRA(rank=0)
    with pytest.raises(ValueError, match="not a regular expression"):
        LoRA(rank=2, targets=("attention/(query",))
    assert LoRA.from_config({"rank": 0}) is None
