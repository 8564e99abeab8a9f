"""RoPE scalings against transformers' ``ROPE_INIT_FUNCTIONS``: inverse frequencies, the
attention factor on cos and sin, and the rotated queries and keys."""

import jax.numpy as jnp
import numpy as np
import pytest

from lhc.lm import hf
from lhc.lm.gguf import _rope_scaling
from lhc.nn.rope import (
    apply_rope,
    rope_attention_factor,
    rope_frequencies,
    validate_rope_scaling,
)

HEAD_DIM = 64
THETA = 10_000.0

# (lhc rope_scaling, the transformers one, max_position_embeddings)
CASES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, None, 4096),
    "yarn_defaults": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        None,
        4096,
    ),
    "yarn_betas_attention_factor": (
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.25,
        },
        None,
        4096,
    ),
    # DeepSeek's mscale pair sets the temperature; an untruncated blend band.
    "yarn_mscale_untruncated": (
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 256,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "truncate": False,
        },
        None,
        4096,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        None,
        4096,
    ),
    # transformers has no static NTK: its dynamic NTK at seq_len L scales the base by
    # (factor * L / max_position_embeddings - factor + 1) ** (H / (H - 2)), which is
    # factor ** (H / (H - 2)) at L = (2 - 1 / factor) * max_position_embeddings (3584 here).
    "ntk": ({"rope_type": "ntk", "factor": 4.0}, {"rope_type": "dynamic", "factor": 4.0}, 2048),
}
NTK_SEQ_LEN = 3584


def _reference(hf_scaling, max_len, seq_len=None):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_len,
        rope_parameters={**hf_scaling, "rope_theta": THETA},
    )
    kwargs = {} if seq_len is None else {"seq_len": seq_len}
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[hf_scaling["rope_type"]](
        config, None, **kwargs
    )
    return torch, transformers, config, inv_freq.numpy(), attention_factor


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_and_attention_factor_match_transformers(case):
    scaling, hf_scaling, max_len = CASES[case]
    seq_len = NTK_SEQ_LEN if case == "ntk" else None
    torch, transformers, config, inv_freq, attention_factor = _reference(
        hf_scaling or scaling, max_len, seq_len
    )
    got = rope_frequencies(HEAD_DIM, THETA, scaling)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, inv_freq, rtol=1e-6, atol=0)
    default = rope_frequencies(HEAD_DIM, THETA)
    assert not np.allclose(got, default, rtol=1e-3)  # the scaling changed something
    assert rope_attention_factor(scaling) == pytest.approx(attention_factor, rel=1e-12)
    if case.startswith("yarn"):
        assert rope_attention_factor(scaling) > 1.05

    if case == "ntk":
        # At the scaled context itself dynamic NTK has gone further: factor**2 - factor + 1.
        _, _, _, at_scaled_context, _ = _reference(hf_scaling, max_len, 4 * max_len)
        np.testing.assert_allclose(
            rope_frequencies(HEAD_DIM, THETA, dict(scaling, factor=13.0)),
            at_scaled_context,
            rtol=1e-6,
        )
        return
    # The rotated queries and keys of transformers' rotary module (cos and sin times
    # attention_scaling) and apply_rotary_pos_emb, from transformers' own frequencies:
    # float32 pow is not correctly rounded, and numpy's and torch's may differ in the last
    # bit (on some CPUs 2 of these 32 frequencies are an ulp apart), which at position
    # 4,006 moves an angle by about 3e-5, more than the rotation's tolerance. The
    # frequencies themselves are compared above.
    from transformers.models.llama import modeling_llama

    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 3, 7, HEAD_DIM)).astype(np.float32)  # [B, N, T, H]
    k = rng.normal(size=(2, 3, 7, HEAD_DIM)).astype(np.float32)
    positions = np.stack([np.arange(7) * 301, np.arange(7) + 4000])
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    with torch.no_grad():
        cos, sin = rotary(torch.tensor(q), torch.tensor(positions))
        q_ref, k_ref = modeling_llama.apply_rotary_pos_emb(
            torch.tensor(q), torch.tensor(k), cos, sin
        )
    reference_frequencies = rotary.inv_freq.numpy()
    np.testing.assert_allclose(reference_frequencies, got, rtol=1e-6, atol=0)
    scale = rope_attention_factor(scaling)
    for x, ref in ((q, q_ref), (k, k_ref)):
        rotated = apply_rope(
            jnp.asarray(x.transpose(0, 2, 1, 3)),
            jnp.asarray(positions),
            reference_frequencies,
            scale,
        )
        np.testing.assert_allclose(
            np.asarray(rotated).transpose(0, 2, 1, 3), ref.numpy(), atol=2e-5, rtol=1e-5
        )


def test_yarn_canonical_form_and_refusals():
    canonical = validate_rope_scaling(
        {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024, "beta_fast": None}
    )
    assert canonical == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": pytest.approx(0.1 * np.log(4.0) + 1),
        "truncate": True,
    }
    assert validate_rope_scaling(canonical) == canonical
    with pytest.raises(ValueError, match="missing"):
        validate_rope_scaling({"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="attention_factor.*positive"):
        validate_rope_scaling(
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 8,
                "attention_factor": -1.0,
            }
        )
    with pytest.raises(ValueError, match="unknown keys"):
        validate_rope_scaling({"rope_type": "ntk", "factor": 2.0, "beta_fast": 32})


def test_dynamic_ntk_is_refused_with_the_static_form():
    message = (
        r"rope_scaling rope_type 'dynamic' .*frequencies change with the sequence length.*"
        r"cache.*static form with the same factor, \{'rope_type': 'ntk', 'factor': 2.0\}"
    )
    with pytest.raises(ValueError, match=message):
        validate_rope_scaling({"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=message):
        rope_frequencies(HEAD_DIM, THETA, {"type": "dynamic", "factor": 2.0})


_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 12,
    "max_position_embeddings": 8192,
    "rope_theta": 1e6,
}


def test_config_json_yarn_defaults_and_static_ntk_written_as_its_base():
    # As transformers: original_max_position_embeddings defaults to max_position_embeddings
    # and a top-level one wins; a null factor is their ratio.
    parsed = hf.config_from_hf({**_LLAMA_CONFIG, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert parsed.rope_scaling["original_max_position_embeddings"] == 8192
    top_level = {**_LLAMA_CONFIG, "original_max_position_embeddings": 2048}
    top_level["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": None,
        "original_max_position_embeddings": 4096,
    }
    parsed = hf.config_from_hf(top_level)
    assert parsed.rope_scaling["original_max_position_embeddings"] == 2048
    assert parsed.rope_scaling["factor"] == 4.0 and parsed.rope_theta == 1e6
    written = hf.config_to_hf(parsed)
    assert written["rope_scaling"] == {
        k: v for k, v in parsed.rope_scaling.items() if k != "truncate"
    }
    assert hf.config_from_hf(written) == parsed

    ntk = parsed.replace(rope_scaling={"rope_type": "ntk", "factor": 4.0})
    written = hf.config_to_hf(ntk)
    assert written["rope_scaling"] is None
    assert written["rope_theta"] == pytest.approx(1e6 * 4.0 ** (12 / 10))
    np.testing.assert_array_equal(
        rope_frequencies(12, written["rope_theta"]), rope_frequencies(12, 1e6, ntk.rope_scaling)
    )
    with pytest.raises(ValueError, match="'dynamic'.*'ntk'"):
        hf.config_from_hf({**_LLAMA_CONFIG, "rope_scaling": {"type": "dynamic", "factor": 4.0}})


class _GGUFMetadata:
    """What ``_rope_scaling`` reads of a GGUF file: metadata, no tensors."""

    path = "model.gguf"
    tensors: dict = {}

    def __init__(self, **metadata):
        self.metadata = {f"llama.rope.scaling.{k}": v for k, v in metadata.items()}

    def get(self, key, default=None):
        return self.metadata.get(key, default)


def test_gguf_yarn_metadata():
    file = _GGUFMetadata(type="yarn", factor=4.0, original_context_length=1024, yarn_beta_fast=16.0)
    scaling = _rope_scaling(file, "llama", 1e4, 64)
    assert scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 16.0,
    }
    assert validate_rope_scaling(scaling)["beta_slow"] == 1.0
    file = _GGUFMetadata(type="yarn", factor=4.0, attn_factor=0.5)
    with pytest.raises(ValueError, match="attn_factor = 0.5 is not supported"):
        _rope_scaling(file, "llama", 1e4, 64)
