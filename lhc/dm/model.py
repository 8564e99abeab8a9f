"""Decision Transformer and Decision Mixer in Flax.

**Decision Transformer** (Chen et al., 2021, as in its official code): a trajectory
window of K steps becomes 3K tokens ``(R_1, s_1, a_1, R_2, s_2, a_2, ...)`` (return to
go, state, action), each embedded by its own linear map plus a learned embedding of the
step's timestep, then LayerNorm; GPT-2 blocks (pre-LayerNorm, causal attention, GELU
MLP of 4d) without positional embeddings; the action is read from the state token
(``tanh(Linear(h))``). Letters: B batch, K steps, T = 3K tokens, D width, S state and
A action sizes.

**Decision Mixer** (Zheng et al., 2025) wraps every odd layer (1, 3, 5, ...) in a
router:

1. a per-token score ``w = Linear(D -> 1)(x)`` (unbounded);
2. a per-sequence capacity ``k = clip(sigmoid(MLP(flatten(x))) * T, 1, T)`` with
   ``MLP = Linear(T D -> 512), LeakyReLU, Linear(512 -> 1)``;
3. the tokens scoring strictly above the k-th largest score go through the block,
   attending only to each other (causally); their output is ``w * block(x)`` (the
   block's output includes its residual); the others pass through unchanged;
4. an auxiliary predictor ``MLP(D -> D/2, SiLU, -> 2)`` on the detached input learns the
   selection (cross-entropy against the mask), and at inference the selection is its
   per-token argmax, which depends on each token alone and so is causal.

The capacity gets a gradient here, which the released code does not give it (it casts
``k`` to an integer): the k-th largest score is interpolated between the scores ranked
``floor(k)`` and ``ceil(k)``, a threshold differentiable in ``k``, and the hard selection
carries a straight-through gradient from the soft one,
``m = hard + s - stop_gradient(s)`` with ``s = sigmoid((w - threshold) / temperature)``.
So the loss reaches the capacity predictor (and the scores) through ``m``, while the
forward pass keeps the exact hard selection.

The attention of routed layers is masked, not gathered: the selected tokens attend to
selected keys only, which is the released semantics, but the compute is that of all T
tokens; ``flops_per_action`` counts what the selection would cost when gathered.

Every parameter carries logical axis names (``lhc.parallel.LOGICAL_AXIS_RULES``): the
width D is ``embed``, hidden widths ``mlp``, attention heads ``heads`` and ``kv``, the
timestep table ``vocab``; the small axes (S, A, the scalar outputs, the flattened window
of the capacity MLP) are not split.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc.dm.config import DMConfig
from lhc.nn.attention_ops import dot_product_attention
from lhc.nn.linear import Einsum, Embed, dense
from lhc.nn.mlp import GeluMLP
from lhc.nn.norms import LayerNorm

SELECTIONS = ("topk", "aux")


class Block(nn.Module):
    """A GPT-2 block: ``x + attn(ln(x))`` then ``+ mlp(ln(x))``, attending only to the
    keys with ``key_positions >= 0`` at or before the query."""

    config: DMConfig

    @nn.compact
    def __call__(self, x, key_positions, *, deterministic: bool):
        cfg = self.config
        batch, tokens, width = x.shape
        head_dim = width // cfg.num_heads
        h = LayerNorm(use_bias=True, **cfg.dtypes, name="ln_attention")(x)
        # C = 3 (query, key, value), N heads of H. Both projections initialise as
        # nn.DenseGeneral did (fan-in D, and N H) and, with N H contracted as one axis F,
        # compute its outputs to the last bit.
        qkv = Einsum(
            (width, 3, cfg.num_heads, head_dim),
            ("embed", None, "heads", "kv"),
            use_bias=True,
            **cfg.dtypes,
            kernel_init=nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2, 3)),
            name="qkv",
        )("BTD,DCNH->BTCNH", h)
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        query_positions = jnp.broadcast_to(jnp.arange(tokens), (batch, tokens))
        out = dot_product_attention(query, key, value, query_positions, key_positions)
        out = Einsum(
            (cfg.num_heads, head_dim, width),
            ("heads", "kv", "embed"),
            in_dims=2,
            use_bias=True,
            **cfg.dtypes,
            kernel_init=nn.initializers.lecun_normal(in_axis=(0, 1), out_axis=2),
            equation_shape=(width, width),
            name="attention_out",
        )("BTF,FD->BTD", out.reshape(batch, tokens, width))
        x = x + nn.Dropout(cfg.dropout)(out, deterministic=deterministic)
        h = LayerNorm(use_bias=True, **cfg.dtypes, name="ln_mlp")(x)
        out = GeluMLP(4 * width, **cfg.dtypes, name="mlp")(h)
        return x + nn.Dropout(cfg.dropout)(out, deterministic=deterministic)


def kth_largest(scores: jax.Array, k: jax.Array) -> jax.Array:
    """The k-th largest of ``scores[B, T]`` for a real ``k[B]`` in [1, T], interpolated
    between ranks ``floor(k)`` and ``ceil(k)`` (so it is differentiable in k)."""
    ranked = -jnp.sort(-scores, axis=-1)  # descending
    low = jnp.floor(k).astype(jnp.int32)
    high = jnp.minimum(low + 1, scores.shape[-1])
    frac = (k - low)[:, None]
    at = lambda rank: jnp.take_along_axis(ranked, (rank - 1)[:, None], axis=-1)  # noqa: E731
    return ((1 - frac) * at(low) + frac * at(high))[:, 0]


class Router(nn.Module):
    """The Decision Mixer router around one block (see the module docstring).

    Returns ``(x', aux)`` with ``aux`` a dict: ``selected`` bool[B, T], ``capacity``
    float[B], ``aux_logits`` float[B, T, 2], ``scores`` float[B, T].
    """

    config: DMConfig

    @nn.compact
    def __call__(self, x, valid, *, selection: str, deterministic: bool):
        cfg = self.config
        batch, tokens, _ = x.shape
        scores = dense(1, ("embed", None), "score", **cfg.dtypes)(x)[..., 0]  # [B, T]
        flat = x.reshape(batch, -1)  # [B, T D]
        hidden = nn.leaky_relu(
            dense(cfg.capacity_hidden, (None, "mlp"), "capacity_hidden", **cfg.dtypes)(flat)
        )
        fraction = jax.nn.sigmoid(dense(1, ("mlp", None), "capacity_out", **cfg.dtypes)(hidden))[
            :, 0
        ]
        if cfg.fixed_capacity is not None:
            fraction = jnp.full_like(fraction, cfg.fixed_capacity)
        capacity = jnp.clip(fraction * tokens, 1.0, float(tokens))
        # Padding tokens never compete for capacity.
        masked_scores = jnp.where(valid, scores, -1e30)
        threshold = kth_largest(masked_scores, capacity)
        hard_topk = (masked_scores > jax.lax.stop_gradient(threshold)[:, None]) & valid
        aux_input = jax.lax.stop_gradient(x)
        aux_hidden = nn.silu(
            dense(x.shape[-1] // 2, ("embed", "mlp"), "aux_hidden", **cfg.dtypes)(aux_input)
        )
        aux_logits = dense(2, ("mlp", None), "aux_out", **cfg.dtypes)(aux_hidden).astype(
            jnp.float32
        )
        if selection == "topk":
            hard = hard_topk
            soft = jax.nn.sigmoid((masked_scores - threshold[:, None]) / cfg.temperature)
            mix = hard + soft - jax.lax.stop_gradient(soft)
        elif selection == "aux":
            hard = (jnp.argmax(aux_logits, -1) == 1) & valid
            mix = hard.astype(x.dtype)
        else:
            raise ValueError(f"selection: expected one of {SELECTIONS}, got {selection!r}")
        key_positions = jnp.where(hard, jnp.arange(tokens)[None], -1)
        block_out = Block(cfg, name="block")(x, key_positions, deterministic=deterministic)
        routed = scores[..., None] * block_out
        mix = mix[..., None].astype(x.dtype)
        out = mix * routed + (1 - mix) * x
        return out, dict(
            selected=hard, topk=hard_topk, capacity=capacity, aux_logits=aux_logits, scores=scores
        )


class DecisionModel(nn.Module):
    """Decision Transformer (``config.router=False``) or Decision Mixer.

    ``__call__(states[B,K,S], actions[B,K,A], returns_to_go[B,K,1], timesteps[B,K],
    mask[B,K], selection="topk"|"aux", deterministic=True) -> (actions[B,K,A], aux)``
    where ``aux`` holds one dict per routed layer (``routers``) and ``selected`` bool
    ``[B, T]`` per layer.
    """

    config: DMConfig

    @nn.compact
    def __call__(
        self,
        states,
        actions,
        returns_to_go,
        timesteps,
        mask=None,
        *,
        selection: str = "topk",
        deterministic: bool = True,
    ):
        cfg = self.config
        batch, steps, _ = states.shape
        if mask is None:
            mask = jnp.ones((batch, steps), bool)
        # nn.Embed's initialisation.
        embed_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
        time = Embed(
            cfg.max_ep_len,
            cfg.embed_dim,
            embedding_init=embed_init,
            **cfg.dtypes,
            name="embed_timestep",
        ).encode(timesteps)
        embed = lambda name: dense(cfg.embed_dim, (None, "embed"), name, **cfg.dtypes)  # noqa: E731
        tokens = jnp.stack(
            [
                embed("embed_return")(returns_to_go) + time,
                embed("embed_state")(states) + time,
                embed("embed_action")(actions) + time,
            ],
            axis=2,
        ).reshape(batch, 3 * steps, cfg.embed_dim)  # (R_1, s_1, a_1, R_2, ...)
        valid = jnp.repeat(mask.astype(bool), 3, axis=1)  # [B, T]
        x = LayerNorm(use_bias=True, **cfg.dtypes, name="embed_ln")(tokens)
        x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
        all_positions = jnp.where(valid, jnp.arange(3 * steps)[None], -1)
        routers = []
        for layer in range(cfg.num_layers):
            if cfg.routed(layer):
                x, info = Router(cfg, name=f"router_{layer}")(
                    x, valid, selection=selection, deterministic=deterministic
                )
                routers.append(info)
            else:
                x = Block(cfg, name=f"block_{layer}")(x, all_positions, deterministic=deterministic)
        x = LayerNorm(use_bias=True, **cfg.dtypes, name="ln_final")(x)
        state_tokens = x.reshape(batch, steps, 3, cfg.embed_dim)[:, :, 1]
        predicted = jnp.tanh(
            dense(cfg.action_dim, ("embed", None), "predict_action", **cfg.dtypes)(state_tokens)
        )
        return predicted.astype(jnp.float32), {"routers": routers}


def aux_loss(routers: list[dict], valid: jax.Array) -> jax.Array:
    """Mean cross-entropy of the auxiliary predictors against the top-k selections."""
    if not routers:
        return jnp.zeros((), jnp.float32)
    weights = valid.astype(jnp.float32)
    losses = []
    for info in routers:
        log_probs = jax.nn.log_softmax(info["aux_logits"], -1)
        target = info["topk"].astype(jnp.int32)
        nll = -jnp.take_along_axis(log_probs, target[..., None], -1)[..., 0]
        losses.append((nll * weights).sum() / jnp.maximum(weights.sum(), 1))
    return jnp.mean(jnp.stack(losses))


def flops_per_action(config: DMConfig, selected: np.ndarray | None = None) -> float:
    """Forward FLOPs (2 per multiply-add) of the blocks for one action on a full window
    of T = 3K tokens: a full block costs ``T (24 D^2) + 4 T^2 D``; a routed block only
    on its ``n`` selected tokens (``n (24 D^2) + 4 n^2 D``, as if gathered) plus its
    router (scores, capacity MLP, auxiliary predictor).

    Args:
      config: the model's config.
      selected: the mean number of tokens selected in each routed layer (in layer
        order); None for the Decision Transformer or to count all tokens.
    """
    d, t = config.embed_dim, config.num_tokens
    block = lambda n: n * 24 * d * d + 4 * n * n * d  # noqa: E731
    routed = [layer for layer in range(config.num_layers) if config.routed(layer)]
    counts = dict(zip(routed, selected)) if selected is not None else {}
    total = 0.0
    for layer in range(config.num_layers):
        if layer in routed:
            router = 2 * t * d + 2 * t * d * config.capacity_hidden + 2 * t * (d * d // 2 + d)
            total += block(float(counts.get(layer, t))) + router
        else:
            total += block(t)
    return total
