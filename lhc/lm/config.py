"""Configuration of the decoder-only LM family (Llama, Qwen2, Mistral, Gemma 3 shapes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from flax.core import FrozenDict

from lhc.nn.config import ModelConfig
from lhc.nn.linear import KERNEL_LAYOUTS
from lhc.nn.remat import REMAT_POLICIES
from lhc.nn.rope import validate_rope_scaling

NORM_TYPES = ("rmsnorm", "layernorm")
MLP_TYPES = ("swiglu", "gelu", "geglu")


@dataclasses.dataclass(frozen=True)
class LMConfig(ModelConfig):
    """Shape and numerics of a ``Transformer``.

    Attributes:
        vocab_size: V.
        num_layers: L.
        embed_dim: D, the residual width.
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads; divides N (grouped-query attention).
        head_dim: H (even, for RoPE).
        mlp_dim: F, the SwiGLU hidden width.
        max_len: longest sequence (and largest cache) the model accepts.
        rope_theta: RoPE base.
        rope_scaling: ``None`` or a mapping (see ``lhc.nn.rope.validate_rope_scaling``)
            whose ``rope_type`` is ``"linear"``, ``"ntk"`` (static NTK-aware: the base
            scaled once), ``"yarn"`` (with its attention temperature) or ``"llama3"``
            (``"dynamic"`` NTK is refused: its frequencies follow the sequence length);
            stored canonical (YaRN's defaults resolved) as a hashable ``FrozenDict``.
        norm_eps: RMSNorm epsilon.
        qkv_bias: biases on the q/k/v projections (Qwen2).
        tie_embeddings: the output projection reuses the embedding table.
        dtype: compute dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        param_dtype: storage dtype name.
        scan_layers: stack layer parameters on a leading ``layers`` axis and run the
            blocks with ``nn.scan`` (one compiled block; faster compiles for deep models).
        switch_layers: with ``scan_layers=False`` (an array per layer), run inference as
            one scanned block whose every product picks its layer's array with
            ``lax.switch`` (``lhc.nn.apply_switched``): one compiled block like
            ``scan_layers``, each weight read in place like a loop (XLA's CPU backend
            copies a stacked layer's weights out of the scan first). Initialisation,
            dropout, ``start_layer``, probes, collected intermediates and caches that
            keep their layers apart run the loop.
        remat_policy: one of ``lhc.nn.REMAT_POLICIES`` (``"none"`` disables remat).
        attention_impl: name given to ``lhc.nn.dot_product_attention``.
        sliding_window: ``None``, or ``W``: a query at position ``p`` attends only to
            keys at positions in ``(p - W, p]`` (Mistral, Qwen2 with sliding windows).
        full_attention_layers: layers that attend fully although ``sliding_window`` is
            set (Qwen2's ``max_window_layers``, Gemma 3's global layers); empty means
            every layer slides. With ``scan_layers`` the layers are scanned in groups
            of the pattern's period (``layer_period``): Gemma 3's six, five local and
            one global.
        kernel_layout: ``"in_out"`` (weights ``[D, F]``, flax's convention; use it to
            train) or ``"out_in"`` (``[F, D]``, the layout of Hugging Face checkpoints,
            which loads them without a transpose and decodes small batches on CPU
            faster; see ``lhc.nn.Einsum``). ``convert_kernel_layout`` moves parameters
            between the two.
        norm_type: ``"rmsnorm"`` (Llama, Qwen2) or ``"layernorm"`` (GPT-2 / nanoGPT,
            without bias), for every norm of the model.
        mlp_type: ``"swiglu"`` (gated, ``mlp_dim`` wide: Llama, Qwen2), ``"geglu"``
            (gated with the tanh-approximate GELU: Gemma) or ``"gelu"``
            (``down(gelu(up(x)))``: GPT-2 / nanoGPT, usually ``mlp_dim = 4 D``).
        dropout_rate: residual dropout (on the embeddings and on each attention and MLP
            output, as nanoGPT's ``resid_dropout``), active only when the call is given
            an rng stream ``"train"`` (``lhc.train``'s causal-LM tasks do in training).
        local_rope_theta: the RoPE base of the sliding-window layers, which then take
            no ``rope_scaling`` (Gemma 3: 10,000 locally, ``rope_theta`` and any scaling
            on the global layers); ``None``: every layer has ``rope_theta`` and
            ``rope_scaling``.
        qk_norm: RMS-normalise each head's queries and keys before RoPE (Gemma 3).
        post_norms: also normalise the attention and MLP outputs before the residual
            adds (Gemma's four norms per block: ``attention_norm``,
            ``post_attention_norm``, ``mlp_norm``, ``post_mlp_norm``).
        norm_scale_offset: every RMSNorm multiplies by ``norm_scale_offset + scale``
            (Gemma: 1, its weights store the scale minus one).
        embed_scale: multiply token embeddings (not the tied output head) by
            ``sqrt(embed_dim)`` in the compute dtype (Gemma).
        query_scale: the attention scores' scale, ``head_dim ** -0.5`` when ``None``
            (Gemma 3: ``query_pre_attn_scalar ** -0.5``).
    """

    vocab_size: int
    num_layers: int
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    max_len: int
    rope_theta: float = 10_000.0
    rope_scaling: Mapping[str, Any] | None = None
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    switch_layers: bool = False
    remat_policy: str = "none"
    attention_impl: str = "xla"
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()
    kernel_layout: str = "in_out"
    norm_type: str = "rmsnorm"
    mlp_type: str = "swiglu"
    dropout_rate: float = 0.0
    local_rope_theta: float | None = None
    qk_norm: bool = False
    post_norms: bool = False
    norm_scale_offset: float = 0.0
    embed_scale: bool = False
    query_scale: float | None = None

    POSITIVE = (
        "vocab_size",
        "num_layers",
        "embed_dim",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
        "max_len",
    )
    CHOICES = {
        "remat_policy": REMAT_POLICIES,
        "kernel_layout": KERNEL_LAYOUTS,
        "norm_type": NORM_TYPES,
        "mlp_type": MLP_TYPES,
    }
    DTYPES = ("dtype", "param_dtype")
    TUPLES = ("full_attention_layers",)
    MULTIPLES = (("num_heads", "num_kv_heads"),)
    EVEN = ("head_dim",)  # RoPE rotates pairs

    def __post_init__(self):
        super().__post_init__()
        if not self.rope_theta > 0:
            raise ValueError(f"LMConfig.rope_theta must be positive, got {self.rope_theta}")
        if not self.norm_eps > 0:
            raise ValueError(f"LMConfig.norm_eps must be positive, got {self.norm_eps}")
        if self.scan_layers and self.switch_layers:
            raise ValueError(
                "LMConfig.switch_layers switches among an array per layer; it needs "
                "scan_layers=False, got both set"
            )
        if not isinstance(self.attention_impl, str):
            raise ValueError(f"LMConfig.attention_impl must be a str, got {self.attention_impl!r}")
        if isinstance(self.dropout_rate, bool) or not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"LMConfig.dropout_rate must lie in [0, 1), got {self.dropout_rate!r}")
        window = self.sliding_window
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(f"LMConfig.sliding_window must be None or an int >= 1, got {window!r}")
        full_layers = tuple(sorted({int(layer) for layer in self.full_attention_layers}))
        if any(not 0 <= layer < self.num_layers for layer in full_layers):
            raise ValueError(
                f"LMConfig.full_attention_layers must lie in [0, num_layers={self.num_layers}), "
                f"got {self.full_attention_layers!r}"
            )
        if full_layers and window is None:
            raise ValueError("LMConfig.full_attention_layers needs a sliding_window")
        for name in ("local_rope_theta", "query_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"LMConfig.{name} must be None or positive, got {value!r}")
        if self.norm_type != "rmsnorm" and (self.qk_norm or self.norm_scale_offset):
            raise ValueError(
                "LMConfig.qk_norm and norm_scale_offset are RMSNorm's; norm_type is "
                f"{self.norm_type!r}"
            )
        if window is not None and len(full_layers) == self.num_layers:
            window, full_layers = None, ()  # no layer slides
        object.__setattr__(self, "sliding_window", window)
        object.__setattr__(self, "full_attention_layers", full_layers)
        scaling = validate_rope_scaling(self.rope_scaling)
        object.__setattr__(self, "rope_scaling", None if scaling is None else FrozenDict(scaling))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "norm_eps", float(self.norm_eps))
        object.__setattr__(self, "dropout_rate", float(self.dropout_rate))
        object.__setattr__(self, "norm_scale_offset", float(self.norm_scale_offset))

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (``None``: full causal attention)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def layer_rope(self, layer: int) -> tuple[float, Any]:
        """``(rope_theta, rope_scaling)`` of ``layer``."""
        if self.local_rope_theta is not None and self.layer_window(layer) is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def layer_period(self) -> int:
        """P, the shortest period of the layers' windows: layer ``i`` has the window of
        layer ``i % P`` (1 when every layer has the same; the number of layers when the
        windows do not repeat)."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return next(
            p
            for p in range(1, self.num_layers + 1)
            if all(windows[i] == windows[i % p] for i in range(self.num_layers))
        )

    @property
    def num_query_groups(self) -> int:
        """Query heads per key/value head (N / K)."""
        return self.num_heads // self.num_kv_heads

    # Presets ------------------------------------------------------------------------

    @classmethod
    def tiny(cls, **overrides: Any) -> LMConfig:
        """A model small enough for unit tests on a CPU (about 30K parameters)."""
        return cls(**{**_shape(128, 2, 32, 4, 2, 8, 64, 256), **overrides})

    @classmethod
    def lm_100m(cls, **overrides: Any) -> LMConfig:
        """A ~110M-parameter model (GPT-2-small widths, Llama layout, 32K vocabulary)."""
        shape = _shape(32_000, 12, 768, 12, 12, 64, 2048, 4096, norm_eps=1e-5, tie_embeddings=True)
        return cls(**{**shape, **overrides})


def _shape(vocab, layers, width, heads, kv_heads, head_dim, mlp, max_len, **rest) -> dict:
    """``LMConfig`` fields from the numbers that define a decoder, in the order of the
    Attributes above."""
    return dict(
        vocab_size=vocab,
        num_layers=layers,
        embed_dim=width,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        mlp_dim=mlp,
        max_len=max_len,
        **rest,
    )


def _released(*numbers, rope_theta: float, **rest) -> dict:
    """A released checkpoint's shape: bfloat16, RMSNorm epsilon 1e-5 unless ``rest``
    says otherwise."""
    return _shape(
        *numbers,
        rope_theta=rope_theta,
        **{"norm_eps": 1e-5, "dtype": "bfloat16", "param_dtype": "bfloat16", **rest},
    )


# Llama 3.1 / 3.2's RoPE scaling, but for the factor.
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

# Shapes of released checkpoints (from their config.json files): vocabulary, layers,
# width, heads, kv heads, head dim, MLP width, context.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": LMConfig.tiny().to_dict(),
    "lm_100m": LMConfig.lm_100m().to_dict(),
    "llama3.1-8b": _released(
        128_256,
        32,
        4096,
        32,
        8,
        128,
        14_336,
        131_072,
        rope_theta=500_000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
    ),
    "llama3.2-1b": _released(
        128_256,
        16,
        2048,
        32,
        8,
        64,
        8192,
        131_072,
        rope_theta=500_000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        tie_embeddings=True,
    ),
    "qwen2.5-7b": _released(
        152_064,
        28,
        3584,
        28,
        4,
        128,
        18_944,
        32_768,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qkv_bias=True,
    ),
    "qwen2.5-0.5b": _released(
        151_936,
        24,
        896,
        14,
        2,
        64,
        4864,
        32_768,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=True,
    ),
}


def get_preset(name: str, **overrides: Any) -> LMConfig:
    """The config called ``name`` (a key of ``PRESETS``) with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown LM preset {name!r}; known: {sorted(PRESETS)}")
    return LMConfig.from_dict({**PRESETS[name], **overrides})
