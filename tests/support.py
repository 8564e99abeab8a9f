"""Helpers shared by test packages (import them as ``from ..support import ...`` or
``from .support import ...``; pytest imports the tests with ``--import-mode=importlib``
as modules of the package ``tests``).

* ``random_params``: random parameters of an ``lhc.lm`` decoder, from
  ``lhc.lm.params.random_params``, rescaled when a test needs another scale.
* ``forward``: a float64 numpy forward pass of the Llama/Qwen2 decoder, written loop by
  loop: one unpadded sequence, explicit loops over heads, causal mask by index, RoPE
  through complex multiplication. It shares nothing with lhc's einsums, masks and cache.
  ``inv_frequencies``, ``rms_norm``, ``rotate``, ``layer_norm``, ``silu`` and ``gelu``
  are its parts.
* ``fixed_timings``: ``lhc.bench``'s timers made to report chosen seconds, so that a
  bench's rates and speedups can be checked against closed forms.
* ``optimizing_env``: the environment for a subprocess whose time goes into running
  what XLA compiled rather than into compiling it (``tests/conftest.py`` turns LLVM's
  optimisation off for the suite).
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from lhc.lm.params import random_params as _library_random_params


def random_params(config, seed=0, scale=None, norms=None):
    """Random parameters of the ``lhc.lm`` decoder ``config``: those of
    ``lhc.lm.params.random_params(config, seed)`` (normal, standard deviation
    ``embed_dim ** -0.5``), rescaled to standard deviation ``scale`` when it is given.

    ``norms``: when given, the norm layers' scales are ``1 + norms * z`` (``z`` the same
    standard normal draws), non-trivial scales near one as in a trained model, instead of
    small ones around zero.
    """
    drawn = _library_random_params(config, seed)
    unit = config.embed_dim**-0.5

    def rescale(path, leaf):
        z = leaf / unit  # the library's standard normal draws
        keys = [getattr(k, "key", None) for k in path]
        if norms is not None and keys[-1] == "scale" and str(keys[-2]).endswith("norm"):
            return (1 + norms * z).astype(leaf.dtype)
        return leaf if scale is None else (z * scale).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(rescale, drawn)


def fixed_timings(monkeypatch, timed=None, interleaved=None):
    """Makes ``lhc.bench.timed`` report ``timed[i]`` seconds at its i-th call and
    ``lhc.bench.interleaved_best`` report ``interleaved(key)`` seconds for each key of
    the functions it times. The functions still run (and are still timed): what they
    return is theirs. Returns the real measurements, a list of seconds in call order,
    for the test to check that they are positive and finite."""
    import lhc.bench

    measured = []
    real_timed, real_interleaved = lhc.bench.timed, lhc.bench.interleaved_best

    def fake_timed(fn, repeats, **kwargs):
        seconds, out = real_timed(fn, repeats, **kwargs)
        measured.append(seconds)
        return timed[len(measured) - 1], out

    def fake_interleaved(fns, repeats, **kwargs):
        best = real_interleaved(fns, repeats, **kwargs)
        measured.extend(best.values())
        return {key: interleaved(key) for key in best}

    if timed is not None:
        monkeypatch.setattr(lhc.bench, "timed", fake_timed)
    if interleaved is not None:
        monkeypatch.setattr(lhc.bench, "interleaved_best", fake_interleaved)
    return measured


# The numpy reference decoder -----------------------------------------------------------


def inv_frequencies(head_dim, rope_theta, rope_scaling=None):
    """Per-pair inverse frequencies, the Llama-3 rule applied one frequency at a time."""
    freqs = []
    for i in range(head_dim // 2):
        freq = 1.0 / rope_theta ** (2 * i / head_dim)
        if rope_scaling is not None:
            kind = rope_scaling["rope_type"]
            factor = rope_scaling["factor"]
            if kind == "linear":
                freq = freq / factor
            elif kind == "llama3":
                original = rope_scaling["original_max_position_embeddings"]
                low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
                wavelength = 2 * math.pi / freq
                if wavelength < original / high:
                    pass  # high frequency: unchanged
                elif wavelength > original / low:
                    freq = freq / factor
                else:
                    smooth = (original / wavelength - low) / (high - low)
                    freq = (1 - smooth) * freq / factor + smooth * freq
            else:
                raise ValueError(kind)
        freqs.append(freq)
    return np.array(freqs, np.float64)


def rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotate(x, positions, freqs):
    """x [T, H]: pairs (i, i + H/2) rotated as complex numbers by position * freq."""
    half = x.shape[-1] // 2
    z = x[:, :half] + 1j * x[:, half:]
    z = z * np.exp(1j * positions[:, None] * freqs[None, :])
    return np.concatenate([z.real, z.imag], axis=-1)


def layer_norm(x, scale, eps):
    centred = x - x.mean(axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + eps) * scale


def silu(x):
    return x / (1 + np.exp(-x))


def gelu(x):
    """The exact GELU, x * Phi(x), through math.erf."""
    return x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _layer_params(params, layer):
    if "layers" in params:
        return {k: v for k, v in _index_tree(params["layers"], layer).items()}
    return params[f"layers_{layer}"]


def _index_tree(tree, i):
    if isinstance(tree, dict):
        return {k: _index_tree(v, i) for k, v in tree.items()}
    return np.asarray(tree)[i]


def forward(
    config,
    params,
    tokens,
    positions=None,
    *,
    window=None,
    residual_add=None,
    attention_add=None,
    inputs=None,
    key_mask=None,
    masked_from=0,
    probs=None,
    states=None,
):
    """Logits [T, V] (float64) of one sequence of token ids [T].

    ``inputs``: [T, D] input embeddings used instead of the tokens' (rows of NaN keep
    the token's). ``key_mask``: {layer: bool [K, T]}, the keys each key/value head of
    that layer may attend to from the queries at indices ``>= masked_from``. ``probs``:
    a dict filled with {layer: [N, T, T]}, the attention probabilities (query, key).
    ``states``: a dict filled with {(site, layer): [T, D]} for the sites
    ``"layer_input"``, ``"attention"`` (after ``attention_add``) and ``"residual"``.

    ``window``: a query at index t sees keys at indices (t - window, t]. ``residual_add`` /
    ``attention_add``: {layer: vector [D] or [T, D]} added to the residual stream after
    that block / to that block's attention output.
    """
    residual_add = residual_add or {}
    attention_add = attention_add or {}
    as64 = lambda x: np.asarray(x, np.float64)
    tokens = np.asarray(tokens)
    length = len(tokens)
    positions = np.arange(length) if positions is None else np.asarray(positions)
    freqs = inv_frequencies(
        config.head_dim,
        config.rope_theta,
        None if config.rope_scaling is None else dict(config.rope_scaling),
    )
    embedding = as64(params["embed"]["embedding"])
    x = embedding[tokens]
    if inputs is not None:
        inputs = as64(inputs)
        x = np.where(np.isnan(inputs), x, inputs)
    key_mask = key_mask or {}
    group = config.num_heads // config.num_kv_heads
    norm = layer_norm if getattr(config, "norm_type", "rmsnorm") == "layernorm" else rms_norm
    states = {} if states is None else states
    for layer in range(config.num_layers):
        states["layer_input", layer] = x
        p = _layer_params(params, layer)
        att = p["attention"]
        h = norm(x, as64(p["attention_norm"]["scale"]), config.norm_eps)
        head_outputs = []
        for n in range(config.num_heads):
            kv_head = n // group
            q = h @ as64(att["query"]["kernel"])[:, n, :]
            k = h @ as64(att["key"]["kernel"])[:, kv_head, :]
            v = h @ as64(att["value"]["kernel"])[:, kv_head, :]
            if config.qkv_bias:
                q = q + as64(att["query"]["bias"])[n]
                k = k + as64(att["key"]["bias"])[kv_head]
                v = v + as64(att["value"]["bias"])[kv_head]
            q, k = rotate(q, positions, freqs), rotate(k, positions, freqs)
            out = np.zeros_like(q)
            seen = np.asarray(key_mask.get(layer, np.ones((config.num_kv_heads, length), bool)))
            for t in range(length):
                first = 0 if window is None else max(0, t - window + 1)
                keys = [s for s in range(first, t + 1) if t < masked_from or seen[kv_head, s]]
                scores = np.array([q[t] @ k[s] for s in keys])
                scores = scores / math.sqrt(config.head_dim)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[t] = weights @ v[keys]
                if probs is not None:
                    probs.setdefault(layer, np.zeros((config.num_heads, length, length)))
                    probs[layer][n, t, keys] = weights
            head_outputs.append(out @ as64(att["out"]["kernel"])[n])
        attended = sum(head_outputs)
        if layer in attention_add:
            attended = attended + as64(attention_add[layer])
        states["attention", layer] = attended
        x = x + attended
        h = norm(x, as64(p["mlp_norm"]["scale"]), config.norm_eps)
        mlp = p["mlp"]
        if getattr(config, "mlp_type", "swiglu") == "gelu":
            hidden = gelu(h @ as64(mlp["up"]["kernel"]))
        else:
            hidden = silu(h @ as64(mlp["gate"]["kernel"])) * (h @ as64(mlp["up"]["kernel"]))
        x = x + hidden @ as64(mlp["down"]["kernel"])
        if layer in residual_add:
            x = x + as64(residual_add[layer])
        states["residual", layer] = x
    x = norm(x, as64(params["final_norm"]["scale"]), config.norm_eps)
    if config.tie_embeddings:
        return x @ embedding.T
    return x @ as64(params["lm_head"]["kernel"])


def optimizing_env() -> dict[str, str]:
    """``os.environ`` without the suite's fast-compile XLA flags, for a
    subprocess that runs many steps of a small program: its code then runs about twice
    as fast (the tiny associative-recall config: 75 ms a step instead of 155 ms)."""
    fast = ("--xla_backend_optimization_level=", "--xla_llvm_disable_expensive_passes=")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(fast)]
    return {**os.environ, "XLA_FLAGS": " ".join(flags)}
