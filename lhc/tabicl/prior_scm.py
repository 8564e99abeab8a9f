"""Structural causal models of the TabICL prior: root causes, activations, MLP-SCM, tree-SCM.

Each function here draws one regression table ``(X, y)`` from a random structural
causal model, in numpy, following the sampling distributions of the ``prior/``
package of ``tabicl==0.1.4``. The networks compute in float32 like the reference, so
the same activations overflow (``exp``) and the same tables are rejected as non-finite.

Shapes: ``T`` rows (``seq_len``), ``F`` features, ``C`` causes, ``D`` hidden width.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from lhc.extras import require

# ---------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _softplus(x: np.ndarray) -> np.ndarray:
    # torch.nn.Softplus(beta=1, threshold=20): linear above the threshold.
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _elu(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))


SIMPLE_ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "tanh": np.tanh,
    "leaky_relu": lambda x: np.where(x >= 0, x, x * np.float32(0.01)),
    "elu": _elu,
    "identity": lambda x: x,
    "selu": lambda x: _SELU_SCALE * np.where(x > 0, x, _SELU_ALPHA * np.expm1(np.minimum(x, 0.0))),
    "silu": lambda x: x * _sigmoid(x),
    "relu": lambda x: np.maximum(x, 0.0),
    "softplus": _softplus,
    "relu6": lambda x: np.clip(x, 0.0, 6.0),
    "hardtanh": lambda x: np.clip(x, -1.0, 1.0),
    "sign": lambda x: np.where(x >= 0.0, 1.0, -1.0).astype(x.dtype),
    "rbf": lambda x: np.exp(-(x**2)),
    "exp": np.exp,
    "sqrt_abs": lambda x: np.sqrt(np.abs(x)),
    "unit_interval_indicator": lambda x: (np.abs(x) <= 1.0).astype(x.dtype),
    "sin": np.sin,
    "square": np.square,
    "abs": np.abs,
}
"""The 18 simple activations of the reference, in its order (torch defaults: LeakyReLU
slope 0.01, ELU alpha 1, Softplus beta 1 threshold 20, Hardtanh [-1, 1])."""

RANDOM_FUNCTION = "random_function"
RANDOM_CHOICE = "random_choice"

BASE_ACTIVATIONS: tuple[str, ...] = tuple(SIMPLE_ACTIVATIONS) + (RANDOM_FUNCTION,) * 10
"""The 28 standardized-and-randomly-scaled activations: the 18 simple ones, then the
random Fourier function repeated 10 times so that it is drawn more often."""

ACTIVATION_CHOICES: tuple[str, ...] = BASE_ACTIVATIONS + (RANDOM_CHOICE,) * len(BASE_ACTIVATIONS)
"""The 56 values of the meta-choice over activations. ``random_choice`` picks one of
``BASE_ACTIVATIONS`` uniformly (the reference's ``RandomChoiceFactory`` draws from the
whole 56-list and recurses on itself, which is the same distribution)."""

NUM_FOURIER_FREQUENCIES = 256
_FOURIER_GRID_STEP = 1e-3
_FOURIER_CHUNK_ELEMENTS = 1 << 22  # sine-table entries per chunk (16-32 MB)


def standardize_columns(x: np.ndarray) -> np.ndarray:
    """Per-column ``(x - mean) / (std + 1e-6)`` over rows, std with ddof=1 (torch's default).

    Args:
      x: float[T, D].

    Returns:
      float[T, D], the same dtype.
    """
    mean = x.mean(axis=0, keepdims=True)
    std = x.std(axis=0, ddof=1, keepdims=True) if x.shape[0] > 1 else np.full_like(mean, np.nan)
    return (x - mean) / (std + np.asarray(1e-6, x.dtype))


@dataclasses.dataclass(frozen=True)
class RandomFourierFunction:
    """A random 1-D function ``g(z) = sum_k w_k sin(f_k z + b_k)`` of the standardized input.

    ``f_k ~ U(0, 256)``, ``b_k ~ U(0, 2 pi)``, and ``w_k = a_k eps_k`` with
    ``eps_k ~ N(0, 1)`` and ``a_k`` proportional to ``f_k ** -p`` (unit L2 norm),
    ``log p ~ U(log 0.7, log 3)``: a random smooth-to-rough periodic function.
    """

    freqs: np.ndarray  # float32[K]
    phases: np.ndarray  # float32[K]
    weights: np.ndarray  # float32[K]

    @classmethod
    def sample(cls, rng: np.random.Generator, num_frequencies: int = NUM_FOURIER_FREQUENCIES):
        freqs = (num_frequencies * rng.random(num_frequencies)).astype(np.float32)
        phases = (2 * np.pi * rng.random(num_frequencies)).astype(np.float32)
        decay_exponent = -np.exp(rng.uniform(np.log(0.7), np.log(3.0)))
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            factors = freqs ** np.float32(decay_exponent)
            factors = factors / np.sqrt((factors**2).sum())
        weights = (factors * rng.standard_normal(num_frequencies)).astype(np.float32)
        return cls(freqs=freqs, phases=phases, weights=weights)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Applies the function elementwise to standardized columns of ``x`` (float[T, D]).

        Large inputs are evaluated by cubic Hermite interpolation between exact values
        and derivatives on a grid of spacing ``_FOURIER_GRID_STEP`` (error about 1e-5,
        below the float32 phase error of a direct evaluation at frequencies up to 256).
        """
        z = standardize_columns(x)
        flat = z.reshape(-1)
        low, high = (float(flat.min()), float(flat.max())) if flat.size else (0.0, 0.0)
        num_grid = (
            int(math.ceil((high - low) / _FOURIER_GRID_STEP)) + 2
            if math.isfinite(high - low)
            else 0
        )
        if num_grid == 0 or flat.size < num_grid:
            return self.evaluate(flat).reshape(z.shape)
        values, slopes = self._grid_values_and_slopes(low, num_grid)
        position = (flat.astype(np.float64) - low) / _FOURIER_GRID_STEP
        index = np.clip(np.floor(position).astype(np.int64), 0, num_grid - 2)
        t = position - index
        t2, t3 = t * t, t * t * t
        out = (
            (2 * t3 - 3 * t2 + 1) * values[index]
            + (t3 - 2 * t2 + t) * _FOURIER_GRID_STEP * slopes[index]
            + (3 * t2 - 2 * t3) * values[index + 1]
            + (t3 - t2) * _FOURIER_GRID_STEP * slopes[index + 1]
        )
        return out.astype(z.dtype).reshape(z.shape)

    def evaluate(self, z: np.ndarray) -> np.ndarray:
        """``sum_k w_k sin(f_k z + b_k)`` evaluated directly (in z's dtype), z: float[N]."""
        out = np.empty_like(z)
        chunk = max(1, _FOURIER_CHUNK_ELEMENTS // len(self.freqs))
        for start in range(0, z.size, chunk):
            block = np.multiply(z[start : start + chunk, None], self.freqs)
            block += self.phases
            np.sin(block, out=block)
            out[start : start + chunk] = block @ self.weights
        return out

    def _grid_values_and_slopes(self, low: float, num_grid: int) -> tuple[np.ndarray, np.ndarray]:
        """g and g' at ``low + step * n``, n < num_grid, in float64.

        On a grid, ``sum_k w_k exp(i (f_k x_n + b_k))`` with ``n = M j + m`` factors into a
        [J, K] x [K, M] complex matrix product, so the cost is one BLAS call instead of
        ``num_grid * K`` sines.
        """
        freqs, phases, weights = (
            a.astype(np.float64) for a in (self.freqs, self.phases, self.weights)
        )
        block = 256
        num_blocks = -(-num_grid // block)
        block_start = low + _FOURIER_GRID_STEP * block * np.arange(num_blocks)
        outer = weights * np.exp(1j * (block_start[:, None] * freqs + phases))  # [J, K]
        inner = np.exp(1j * freqs[:, None] * (_FOURIER_GRID_STEP * np.arange(block)))  # [K, M]
        values = (outer @ inner).imag.reshape(-1)[:num_grid]
        slopes = ((outer * freqs) @ inner).real.reshape(-1)[:num_grid]
        return values, slopes


@dataclasses.dataclass(frozen=True)
class ScaledActivation:
    """``act(scale * (standardize(x) + shift))`` with ``log scale ~ N(0, 2^2)``, ``shift ~ N(0, 1)``.

    This is the reference's ``StdRandomScaleFactory``: standardize over rows, one random
    scale and shift shared by all columns, then the activation.
    """

    name: str
    scale: float
    shift: float
    random_function: RandomFourierFunction | None = None

    @classmethod
    def sample(cls, rng: np.random.Generator, name: str) -> ScaledActivation:
        if name not in BASE_ACTIVATIONS:
            raise ValueError(f"name: expected one of {sorted(set(BASE_ACTIVATIONS))}, got {name!r}")
        random_function = RandomFourierFunction.sample(rng) if name == RANDOM_FUNCTION else None
        scale = float(np.exp(2.0 * rng.standard_normal()))
        shift = float(rng.standard_normal())
        return cls(name=name, scale=scale, shift=shift, random_function=random_function)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = standardize_columns(x)
        x = np.float32(self.scale) * (x + np.float32(self.shift))
        if self.random_function is not None:
            return self.random_function(x)
        return SIMPLE_ACTIVATIONS[self.name](x)


def sample_activation(rng: np.random.Generator, choice_probs: np.ndarray) -> ScaledActivation:
    """Draws one layer's activation from the meta-sampled weights over ``ACTIVATION_CHOICES``.

    Args:
      rng: the generator.
      choice_probs: float[56], probabilities over ``ACTIVATION_CHOICES``.
    """
    name = ACTIVATION_CHOICES[rng.choice(len(ACTIVATION_CHOICES), p=choice_probs)]
    if name == RANDOM_CHOICE:
        name = BASE_ACTIVATIONS[rng.integers(len(BASE_ACTIVATIONS))]
    return ScaledActivation.sample(rng, name)


# ---------------------------------------------------------------------------------------
# Root causes
# ---------------------------------------------------------------------------------------

CAUSE_SAMPLINGS = ("normal", "mixed", "uniform")


def sample_causes(
    rng: np.random.Generator,
    seq_len: int,
    num_causes: int,
    sampling: str,
    pre_sample_stats: bool = False,
) -> np.ndarray:
    """Root causes of an SCM.

    * ``normal``: N(0, 1), or with ``pre_sample_stats`` N(m_j, |s_j m_j|), m, s ~ N(0, 1).
    * ``uniform``: U(0, 1).
    * ``mixed``: per column, with thresholds ``p_normal, p_multi, p_zipf ~ U(0, 0.66)``
      and a fresh U(0, 1) for each test: normal if ``u > p_normal``, else a standardized
      multinomial (2-20 categories, random probabilities) if ``u > p_multi``, else a
      centred Zipf (exponent U(2, 4), clipped at 10) if ``u > p_zipf``, else U(0, 1).

    Returns:
      float32[T, C].
    """
    if sampling not in CAUSE_SAMPLINGS:
        raise ValueError(f"sampling: expected one of {CAUSE_SAMPLINGS}, got {sampling!r}")
    if pre_sample_stats:
        means = rng.standard_normal(num_causes)
        stds = np.abs(rng.standard_normal(num_causes) * means)
    else:
        means, stds = np.zeros(num_causes), np.ones(num_causes)

    if sampling == "normal":
        return (means + stds * rng.standard_normal((seq_len, num_causes))).astype(np.float32)
    if sampling == "uniform":
        return rng.random((seq_len, num_causes), dtype=np.float32)

    zipf_p, multi_p, normal_p = rng.random(3) * 0.66
    columns = []
    for j in range(num_causes):
        if rng.random() > normal_p:
            col = means[j] + stds[j] * rng.standard_normal(seq_len)
        elif rng.random() > multi_p:
            num_categories = int(rng.integers(2, 21))
            probs = rng.random(num_categories)
            col = rng.choice(num_categories, size=seq_len, p=probs / probs.sum()).astype(np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                col = (col - col.mean()) / col.std(ddof=1)
        elif rng.random() > zipf_p:
            col = np.minimum(rng.zipf(2.0 + 2.0 * rng.random(), seq_len), 10).astype(np.float64)
            col = col - col.mean()
        else:
            col = rng.random(seq_len)
        columns.append(col)
    return np.stack(columns, axis=-1).astype(np.float32)


# ---------------------------------------------------------------------------------------
# SCM hyperparameters
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SCMHparams:
    """The hyperparameters of one SCM (the values a subgroup of tables shares).

    Defaults are those of the reference's ``MLPSCM`` constructor; the prior samples them
    (see ``lhc.tabicl.prior.SAMPLED_HPARAMS``).
    """

    is_causal: bool = True
    num_causes: int = 10
    y_is_effect: bool = True
    in_clique: bool = False
    sort_features: bool = True
    num_layers: int = 10
    hidden_dim: int = 20
    init_std: float = 1.0
    block_wise_dropout: bool = True
    mlp_dropout_prob: float = 0.1
    noise_std: float = 0.01
    pre_sample_noise_std: bool = False
    sampling: str = "normal"
    pre_sample_cause_stats: bool = False
    # Probabilities over ACTIVATION_CHOICES; None means tanh everywhere.
    activation_probs: tuple[float, ...] | None = None


def _noise_std(rng: np.random.Generator, hp: SCMHparams, out_dim: int) -> np.ndarray | float:
    if hp.pre_sample_noise_std:
        return np.abs(rng.normal(0.0, hp.noise_std, size=(1, out_dim))).astype(np.float32)
    return hp.noise_std


def _add_noise(rng: np.random.Generator, x: np.ndarray, std) -> np.ndarray:
    return x + (rng.standard_normal(x.shape, dtype=np.float32) * np.asarray(std, np.float32))


def _select_outputs(
    rng: np.random.Generator,
    hp: SCMHparams,
    causes: np.ndarray,
    outputs: Sequence[np.ndarray],
    num_features: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Picks X and y among the SCM's nodes (causal) or takes X = causes (non-causal)."""
    if not hp.is_causal:
        return causes, outputs[-1][:, 0]
    nodes = np.concatenate(outputs, axis=-1)
    width = nodes.shape[-1]
    if hp.in_clique:
        # A contiguous block of nodes: X and y share dense dependencies.
        start = int(rng.integers(0, width - 1 - num_features + 1))
        order = start + rng.permutation(1 + num_features)
    else:
        order = rng.permutation(width - 1)
    x_index = order[1 : 1 + num_features]
    y_index = width - 1 if hp.y_is_effect else order[0]
    if hp.sort_features:
        x_index = np.sort(x_index)
    return nodes[:, x_index], nodes[:, y_index]


# ---------------------------------------------------------------------------------------
# MLP-SCM
# ---------------------------------------------------------------------------------------


def _block_dropout_weight(rng, shape, init_std) -> np.ndarray:
    """Zeros except ``n`` diagonal blocks of N(0, init_std^2 / keep_prob), n ~ U{1..ceil(sqrt(min))}."""
    weight = np.zeros(shape, np.float32)
    num_blocks = int(rng.integers(1, math.ceil(math.sqrt(min(shape))) + 1))
    rows, cols = shape[0] // num_blocks, shape[1] // num_blocks
    keep_prob = num_blocks * rows * cols / (shape[0] * shape[1])
    for b in range(num_blocks):
        weight[b * rows : (b + 1) * rows, b * cols : (b + 1) * cols] = rng.normal(
            0.0, init_std / keep_prob**0.5, size=(rows, cols)
        )
    return weight


def _dropout_weight(rng, shape, init_std, dropout_prob) -> np.ndarray:
    """N(0, init_std^2 / (1 - p)) entries, each kept with probability 1 - p."""
    dropout_prob = min(dropout_prob, 0.99)
    weight = rng.normal(0.0, init_std / (1.0 - dropout_prob) ** 0.5, size=shape)
    return (weight * (rng.random(shape) < 1.0 - dropout_prob)).astype(np.float32)


def _linear(rng, hp: SCMHparams, in_dim: int, out_dim: int, first: bool):
    """A linear layer's (weight[out, in], bias[out]) with the prior's initialisation.

    The bias keeps torch's default ``nn.Linear`` initialisation, U(+-1/sqrt(in)).
    """
    if hp.block_wise_dropout:
        weight = _block_dropout_weight(rng, (out_dim, in_dim), hp.init_std)
    else:
        # The reference skips dropout on the first layer's weight only.
        weight = _dropout_weight(
            rng, (out_dim, in_dim), hp.init_std, 0.0 if first else hp.mlp_dropout_prob
        )
    bound = 1.0 / math.sqrt(in_dim)
    bias = rng.uniform(-bound, bound, size=out_dim).astype(np.float32)
    return weight, bias


def _layer_activation(rng, hp: SCMHparams):
    if hp.activation_probs is None:
        return np.tanh
    return sample_activation(rng, np.asarray(hp.activation_probs))


def mlp_scm(
    rng: np.random.Generator, seq_len: int, num_features: int, hp: SCMHparams
) -> tuple[np.ndarray, np.ndarray]:
    """Draws one regression table from a random MLP structural causal model.

    The network is ``Linear(C, D)`` then ``num_layers - 1`` blocks of
    ``[activation, Linear(D, D), + Gaussian noise]`` (and, in non-causal mode, a last
    block to one output). Causal mode: X and y are random nodes of the blocks' outputs
    (``D >= 1 + 2F`` so there are enough), y the last node when ``y_is_effect``.
    Non-causal mode: X is the ``C = F`` causes and y the output.

    Args:
      rng: the generator.
      seq_len: T.
      num_features: F.
      hp: the SCM hyperparameters.

    Returns:
      ``(X float32[T, F], y float32[T])``; may hold inf/NaN (the caller rejects those).
    """
    if hp.num_layers < 2:
        raise ValueError(f"hp.num_layers: expected >= 2, got {hp.num_layers}")
    if hp.is_causal:
        num_causes = hp.num_causes
        hidden_dim = max(hp.hidden_dim, 1 + 2 * num_features)
    else:
        num_causes, hidden_dim = num_features, hp.hidden_dim

    causes = sample_causes(rng, seq_len, num_causes, hp.sampling, hp.pre_sample_cause_stats)
    with np.errstate(all="ignore"):
        weight, bias = _linear(rng, hp, num_causes, hidden_dim, first=True)
        h = causes @ weight.T + bias
        out_dims = [hidden_dim] * (hp.num_layers - 1) + ([] if hp.is_causal else [1])
        outputs = []
        for out_dim in out_dims:
            activation = _layer_activation(rng, hp)
            weight, bias = _linear(rng, hp, hidden_dim, out_dim, first=False)
            noise_std = _noise_std(rng, hp, out_dim)
            h = _add_noise(rng, activation(h) @ weight.T + bias, noise_std)
            outputs.append(h)
    return _select_outputs(rng, hp, causes, outputs, num_features)


# ---------------------------------------------------------------------------------------
# Tree-SCM
# ---------------------------------------------------------------------------------------

TREE_MAX_DEPTH = 4
TREE_MAX_ESTIMATORS = 4
_TREE_DEPTH_LAMBDA = 0.5
_TREE_ESTIMATORS_LAMBDA = 0.5


def sample_tree_size(rng: np.random.Generator) -> tuple[int, int]:
    """``(max_depth, n_estimators)``: ``min(2 + floor(Exp(mean 2)), 4)``, ``min(1 + floor(Exp(mean 2)), 4)``."""
    max_depth = 2 + int(rng.exponential(1.0 / _TREE_DEPTH_LAMBDA))
    n_estimators = 1 + int(rng.exponential(1.0 / _TREE_ESTIMATORS_LAMBDA))
    return min(max_depth, TREE_MAX_DEPTH), min(n_estimators, TREE_MAX_ESTIMATORS)


def tree_layer(
    rng: np.random.Generator, x: np.ndarray, out_dim: int, max_depth: int, n_estimators: int
) -> np.ndarray:
    """A random piecewise-constant map: XGBoost fit to Gaussian-noise targets, then predict.

    Args:
      rng: draws the noise targets.
      x: float[T, F].
      out_dim: the number of outputs (one multi-output tree ensemble).
      max_depth: tree depth (each tree has at most ``2**max_depth`` leaves).
      n_estimators: number of boosting rounds.

    Returns:
      float32[T, out_dim], taking at most ``(2**max_depth)**n_estimators`` distinct rows.
    """
    xgboost = require("xgboost", "prior")  # only the tree-SCM needs it

    x = np.nan_to_num(np.asarray(x, np.float32), nan=0.0)
    targets = rng.standard_normal((x.shape[0], out_dim))
    # The reference's XGBRegressor(tree_method="hist", multi_strategy="multi_output_tree"),
    # through the core API (the same trees, without the sklearn wrapper's overhead).
    params = {
        "tree_method": "hist",
        "multi_strategy": "multi_output_tree",
        "max_depth": max_depth,
        "nthread": 1,
        "seed": 0,
        "verbosity": 0,
    }
    data = xgboost.DMatrix(x, label=targets, nthread=1)
    booster = xgboost.train(params, data, num_boost_round=n_estimators)
    return np.asarray(booster.predict(data), np.float32).reshape(x.shape[0], out_dim)


def tree_scm(
    rng: np.random.Generator, seq_len: int, num_features: int, hp: SCMHparams
) -> tuple[np.ndarray, np.ndarray]:
    """Draws one regression table from a random tree structural causal model.

    Always non-causal (X = the F causes, as in the reference, because trees are slow):
    one tree layer to a hidden width ``D ~ U{3..9}``, then ``U{0, 1}`` more
    ``[tree layer, + noise]`` blocks, then ``[tree layer to 1 output, + noise]`` = y.
    Each tree layer has its own depth and number of trees (``sample_tree_size``).

    Returns:
      ``(X float32[T, F], y float32[T])``.
    """
    num_layers = int(rng.integers(1, 3))
    hidden_dim = int(rng.integers(3, 10))
    causes = sample_causes(rng, seq_len, num_features, hp.sampling, hp.pre_sample_cause_stats)
    h = tree_layer(rng, causes, hidden_dim, *sample_tree_size(rng))
    for out_dim in [hidden_dim] * (num_layers - 1) + [1]:
        max_depth, n_estimators = sample_tree_size(rng)
        noise_std = _noise_std(rng, hp, out_dim)
        h = _add_noise(rng, tree_layer(rng, h, out_dim, max_depth, n_estimators), noise_std)
    return causes, h[:, 0]
