"""The configs of lhc.dm: the Decision Transformer / Decision Mixer model
(``DMConfig``) and the SAC agent that makes the behaviour data (``SACConfig``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lhc.nn.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DMConfig(ModelConfig):
    """Sizes and switches (official defaults: 6 layers, 4 heads, D 256, K 20 for DT and
    the paper's DM runs up to K 120, dropout 0.1).

    Attributes:
      state_dim, action_dim: S and A.
      context: K, the steps in a window (3K tokens).
      embed_dim, num_layers, num_heads: D, layers, heads.
      max_ep_len: timesteps embedded (larger ones are clipped by the data).
      dropout: on embeddings, attention output and MLP output.
      router: wrap odd layers in the Decision Mixer router (False: a Decision
        Transformer).
      fixed_capacity: None (predicted) or a fraction of T (the "fixed capacity 0.5"
        ablation).
      capacity_hidden: the capacity MLP's hidden width (512).
      temperature: of the soft selection that carries the straight-through gradient.
      dtype, param_dtype: compute and parameter dtypes (names, e.g. "bfloat16").
    """

    state_dim: int
    action_dim: int
    context: int = 20
    embed_dim: int = 128
    num_layers: int = 3
    num_heads: int = 1
    max_ep_len: int = 1000
    dropout: float = 0.1
    router: bool = False
    fixed_capacity: float | None = None
    capacity_hidden: int = 512
    temperature: float = 1.0
    dtype: str = "float32"
    param_dtype: str = "float32"

    DTYPES = ("dtype", "param_dtype")
    POSITIVE = (
        "state_dim",
        "action_dim",
        "context",
        "embed_dim",
        "num_layers",
        "num_heads",
        "max_ep_len",
        "capacity_hidden",
    )

    def __post_init__(self):
        super().__post_init__()
        if self.fixed_capacity is not None and not 0 < self.fixed_capacity <= 1:
            raise ValueError(
                "DMConfig.fixed_capacity must be None or a fraction in (0, 1], got "
                f"{self.fixed_capacity!r}"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"DMConfig.embed_dim ({self.embed_dim}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if isinstance(self.dropout, bool) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"DMConfig.dropout must lie in [0, 1), got {self.dropout!r}")
        if not self.temperature > 0:
            raise ValueError(f"DMConfig.temperature must be positive, got {self.temperature!r}")

    @property
    def num_tokens(self) -> int:
        return 3 * self.context

    def routed(self, layer: int) -> bool:
        return self.router and layer % 2 == 1

    @property
    def dtypes(self) -> dict:
        """The ``dtype`` and ``param_dtype`` keyword arguments of every layer."""
        return dict(dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype))


@dataclasses.dataclass(frozen=True)
class SACConfig:
    """SAC hyperparameters (defaults: Haarnoja et al. 2018 v2, table 1).

    Attributes:
      hidden_sizes: widths of the hidden layers of the actor and of each critic.
      actor_learning_rate, critic_learning_rate, alpha_learning_rate: Adam step sizes.
      gamma: discount.
      tau: Polyak weight of the online critic in the target update.
      initial_alpha: the temperature at the start.
      target_entropy: of the policy; None means ``-A``.
    """

    hidden_sizes: tuple[int, ...] = (256, 256)
    actor_learning_rate: float = 3e-4
    critic_learning_rate: float = 3e-4
    alpha_learning_rate: float = 3e-4
    gamma: float = 0.99
    tau: float = 0.005
    initial_alpha: float = 1.0
    target_entropy: float | None = None

    def __post_init__(self):
        if not self.hidden_sizes or any(size < 1 for size in self.hidden_sizes):
            raise ValueError(
                f"hidden_sizes: expected a non-empty tuple of positive widths, "
                f"got {self.hidden_sizes!r}"
            )
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma: expected a value in [0, 1], got {self.gamma}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau: expected a value in (0, 1], got {self.tau}")
        if not self.initial_alpha > 0:
            raise ValueError(f"initial_alpha: expected > 0, got {self.initial_alpha}")

    def entropy_target(self, action_dim: int) -> float:
        """The target entropy: ``target_entropy``, or ``-action_dim`` when None."""
        return -float(action_dim) if self.target_entropy is None else self.target_entropy
