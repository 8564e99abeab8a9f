"""Packed rows (``segment_ids``): each document of a row attends only to itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm

from ..support import forward

LENGTHS = (5, 7, 4)  # three documents in one row of 16 tokens


@pytest.mark.parametrize("scan_layers", [True], ids=["scanned"])
def test_each_packed_document_gets_the_logits_it_gets_alone(scan_layers):
    config = lm.LMConfig.tiny(scan_layers=scan_layers)
    params = lm.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, config.vocab_size, n) for n in LENGTHS]
    tokens = np.concatenate(documents)[None]
    positions = np.concatenate([np.arange(n) for n in LENGTHS])[None]
    segments = np.repeat(np.arange(len(LENGTHS)), LENGTHS)[None]
    logits, cache = lm.Transformer(config).apply(
        {"params": params},
        jnp.asarray(tokens),
        jnp.asarray(positions),
        segment_ids=jnp.asarray(segments),
    )
    assert cache is None
    flat = lm.unstack_layer_params(params) if scan_layers else params
    start = 0
    for document in documents:
        expected = forward(config, jax.tree.map(np.asarray, flat), document)
        got = np.asarray(logits[0, start : start + len(document)])
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)
        start += len(document)


def test_segment_ids_need_the_xla_attention_and_no_cache():
    config = lm.LMConfig.tiny(attention_impl="chunked")
    params = lm.init_params(config, jax.random.key(0))
    tokens = jnp.zeros((1, 4), jnp.int32)
    positions = jnp.arange(4)[None]
    with pytest.raises(ValueError, match="attention_impl='xla'"):
        lm.Transformer(config).apply({"params": params}, tokens, positions, segment_ids=positions)
    with pytest.raises(ValueError, match="segment_ids: expected"):
        lm.Transformer(config.replace(attention_impl="xla")).apply(
            {"params": params}, tokens, positions, segment_ids=positions[:, :3]
        )
