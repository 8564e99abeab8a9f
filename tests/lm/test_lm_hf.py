"""Hugging Face checkpoints: config parsing, safetensors round trips, parity with transformers."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from lhc import lm
from lhc.lm import hf

from ..support import random_params

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# Without transformers ----------------------------------------------------------------


@pytest.mark.parametrize("qkv_bias,tie", [(False, False), (True, True)])
def test_save_load_round_trip(tmp_path, qkv_bias, tie):
    config = lm.LMConfig.tiny(qkv_bias=qkv_bias, tie_embeddings=tie, rope_scaling=LLAMA3_ROPE)
    params = random_params(config, scale=0.5)
    hf.save(config, params, tmp_path / "single")
    loaded_config, loaded = hf.load(tmp_path / "single")
    assert loaded_config == config
    _assert_trees_equal(loaded, params)

    # Sharded files, loaded straight into the scan layout, in bfloat16.
    hf.save(config, params, tmp_path / "sharded", max_shard_bytes=8_000)
    files = os.listdir(tmp_path / "sharded")
    assert (
        "model.safetensors.index.json" in files
        and sum(f.endswith(".safetensors") for f in files) > 2
    )
    scan_config, scan_params = hf.load(tmp_path / "sharded", jnp.bfloat16, scan_layers=True)
    assert scan_config == config.replace(scan_layers=True, dtype="bfloat16", param_dtype="bfloat16")
    expected = lm.stack_layer_params(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), 2)
    _assert_trees_equal(scan_params, expected)


def test_scan_layout_is_stacked_on_the_host(tmp_path, monkeypatch):
    config = lm.LMConfig.tiny()
    params = random_params(config, scale=0.5)
    hf.save(config, params, tmp_path)

    def device_stack(*args, **kwargs):
        raise AssertionError("hf.load stacked layers with jnp.stack (on a device)")

    monkeypatch.setattr(jnp, "stack", device_stack)
    _, loaded = hf.load(tmp_path, scan_layers=True)
    monkeypatch.undo()
    _assert_trees_equal(loaded, lm.stack_layer_params(params, config.num_layers))
    host = lm.stack_layer_params(jax.tree.map(np.asarray, params), config.num_layers)
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(host["layers"]))


def test_load_reads_bfloat16_tensors(tmp_path):
    config = lm.LMConfig.tiny()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), random_params(config, scale=0.5))
    hf.save(config.replace(param_dtype="bfloat16"), params, tmp_path)
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert f.get_tensor("model.norm.weight").dtype == ml_dtypes.bfloat16
    _, loaded = hf.load(tmp_path, jnp.float32)
    _assert_trees_equal(loaded, jax.tree.map(lambda x: x.astype(jnp.float32), params))


LLAMA_31_8B_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_config_from_hf_both_rope_layouts_and_presets():
    old = hf.config_from_hf(LLAMA_31_8B_CONFIG_JSON, dtype="bfloat16", param_dtype="bfloat16")
    assert old == lm.get_preset("llama3.1-8b")
    new_layout = dict(LLAMA_31_8B_CONFIG_JSON)
    rope = dict(new_layout.pop("rope_scaling"), rope_theta=new_layout.pop("rope_theta"))
    new_layout["rope_parameters"] = rope
    assert hf.config_from_hf(new_layout, dtype="bfloat16", param_dtype="bfloat16") == old
    default_rope = dict(new_layout, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    parsed = hf.config_from_hf(default_rope)
    assert parsed.rope_scaling is None and parsed.rope_theta == 1e6


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "'dynamic'.*'ntk'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
    ],
)
def test_config_from_hf_rejects_unsupported(change, message):
    with pytest.raises(ValueError, match=message):
        hf.config_from_hf({**LLAMA_31_8B_CONFIG_JSON, **change})


def test_load_errors_name_what_was_expected(tmp_path):
    config = lm.LMConfig.tiny()
    hf.save(config, random_params(config, scale=0.5), tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())

    (tmp_path / "config.json").write_text(json.dumps({**config_json, "num_key_value_heads": 4}))
    with pytest.raises(
        ValueError, match=r"k_proj.weight' has shape \(16, 32\), expected \(32, 32\)"
    ):
        hf.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config_json, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing \['model.layers.2"):
        hf.load(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({**config_json, "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        hf.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    tensors = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.self_attn.q_proj.bias'\]"):
        hf.load(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load(tmp_path / "nowhere")


def test_stop_tokens_from_generation_config(tmp_path):
    assert hf.stop_tokens(tmp_path) == ()
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B_CONFIG_JSON))
    assert hf.stop_tokens(tmp_path) == (128001, 128008, 128009)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert hf.stop_tokens(tmp_path) == (7,)


# Parity with transformers ------------------------------------------------------------

PARITY_CASES = {
    "llama_gqa_llama3_rope": dict(
        arch="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling=LLAMA3_ROPE,
    ),
    "llama_mqa_tied_linear_rope": dict(
        arch="llama",
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "qwen2_ratio3_bias": dict(
        arch="qwen2",
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen2_mha_tied_bias": dict(
        arch="qwen2",
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    ),
}
# Sliding windows (a query sees the last 6 positions), far shorter than the sequences.
WINDOW_CASES = {
    "mistral_window": dict(
        arch="mistral",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        sliding_window=6,
    ),
    "qwen2_window_in_layer_1": dict(
        arch="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
}

# Context extension. transformers has no static NTK type, so that model is transformers'
# dynamic NTK (factor 2, max_position_embeddings 64), compared on 96 tokens only: there
# its base is 10_000 * (2 * 96 / 64 - (2 - 1)) ** (12 / 10), exactly static NTK's with
# factor 2 (at other lengths the two differ; lhc refuses the dynamic config itself).
ROPE_SCALING_CASES = {
    "llama_yarn": dict(
        arch="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "llama_dynamic_ntk_at_96": dict(
        arch="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    ),
}


def _hf_model(case, seed=0):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = dict({**PARITY_CASES, **WINDOW_CASES, **ROPE_SCALING_CASES}[case])
    arch = spec.pop("arch")
    rope_scaling = spec.pop("rope_scaling", None)
    common = dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        head_dim=12,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **spec,
    )
    rope = {"rope_type": "default", "rope_theta": 10_000.0}
    if rope_scaling is not None:
        rope = {**rope_scaling, "rope_theta": 10_000.0}
    common["rope_parameters"] = rope
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model_class = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common)
        model_class = transformers.MistralForCausalLM
    else:
        config = transformers.Qwen2Config(**common)
        model_class = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # Default init (std 0.02, unit norms, zero biases) would leave logits nearly flat
    # and the biases untested; draw everything at O(1) scale instead.
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            else:
                tensor.copy_(0.35 * torch.randn_like(tensor))
    return torch, model


@pytest.mark.parity
@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, case):
    torch, model = _hf_model(case)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, params = hf.load(tmp_path)
    assert config.qkv_bias == (PARITY_CASES[case]["arch"] == "qwen2")
    if config.qkv_bias:
        assert float(np.abs(params["layers_0"]["attention"]["key"]["bias"]).min()) > 0
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 96, size=(2, 48))  # positions run past original_max (16)
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    positions = np.broadcast_to(np.arange(48), (2, 48))
    logits, _ = jax.jit(lm.Transformer(config).apply)({"params": params}, tokens, positions)
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
    # The checkpoint's own [out, in] layout, loaded without transposes.
    out_in_config, out_in_params = hf.load(tmp_path, kernel_layout="out_in")
    logits, _ = jax.jit(lm.Transformer(out_in_config).apply)(
        {"params": out_in_params}, tokens, positions
    )
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
    hf.save(out_in_config, out_in_params, tmp_path / "out_in")
    _, round_trip = hf.load(tmp_path / "out_in")
    _assert_trees_equal(round_trip, params)

    prompts = rng.integers(0, 96, size=(2, 8))
    with torch.no_grad():
        hf_tokens = model.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(2, 8, dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        ).numpy()[:, 8:]
    out = lm.generate(lm.Transformer(config), params, prompts, max_new_tokens=32)
    np.testing.assert_array_equal(out.tokens, hf_tokens)


@pytest.mark.parity
@pytest.mark.parametrize("case", list(ROPE_SCALING_CASES))
def test_context_extension_scalings_match_transformers(tmp_path, case):
    torch, model = _hf_model(case, seed=6)
    transformers = pytest.importorskip("transformers")
    model.save_pretrained(tmp_path, safe_serialization=True)
    if case == "llama_yarn":
        length = 48  # positions run past original_max_position_embeddings (16)
        config, params = hf.load(tmp_path)
        assert config.rope_scaling["attention_factor"] == pytest.approx(0.1 * np.log(4) + 1)
    else:
        length = 96
        with pytest.raises(ValueError, match="'dynamic'.*sequence length.*'ntk', 'factor': 2.0"):
            hf.load(tmp_path)
        ntk = {"rope_type": "ntk", "factor": 2.0}
        config, params = hf.load(tmp_path, rope_scaling=ntk, max_len=length)
    tokens = np.random.default_rng(7).integers(0, 96, size=(2, length))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    positions = np.broadcast_to(np.arange(length), (2, length))
    logits, _ = jax.jit(lm.Transformer(config).apply)({"params": params}, tokens, positions)
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
    # config_to_hf: transformers reads the same model back (static NTK as default RoPE
    # with its scaled base).
    hf.save(config, params, tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        np.testing.assert_allclose(
            again(torch.tensor(tokens)).logits.numpy(), expected, atol=1e-4, rtol=0
        )


@pytest.mark.parity
def test_sharded_checkpoint_and_ragged_prompts_match_transformers(tmp_path):
    torch, model = _hf_model("qwen2_ratio3_bias", seed=3)
    model.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    config, params = hf.load(tmp_path, scan_layers=True)
    prompts = [[5, 17, 3, 9, 60, 2, 11], [42, 7], [1, 2, 3, 4]]
    out = lm.generate(lm.Transformer(config), params, prompts, max_new_tokens=16)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            ).numpy()[0, len(prompt) :]
        np.testing.assert_array_equal(out.tokens[row], expected)


@pytest.mark.parity
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_saved_checkpoint_loads_in_transformers(tmp_path, qkv_bias):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = lm.LMConfig.tiny(
        qkv_bias=qkv_bias,
        tie_embeddings=qkv_bias,
        rope_scaling=None if qkv_bias else LLAMA3_ROPE,
        max_len=64,
    )
    params = random_params(config, seed=5, scale=0.5)
    hf.save(config, params, tmp_path, max_shard_bytes=None if qkv_bias else 10_000)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected_class = "Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"
    assert type(model).__name__ == expected_class
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, size=(2, 40))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    logits, _ = jax.jit(lm.Transformer(config).apply)(
        {"params": params}, tokens, np.broadcast_to(np.arange(40), (2, 40))
    )
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_sliding_window_models_match_transformers_past_the_window(tmp_path, case):
    torch, model = _hf_model(case, seed=4)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, params = hf.load(tmp_path)
    assert config.sliding_window == 6
    assert config.full_attention_layers == ((0,) if case.startswith("qwen2") else ())
    tokens = np.random.default_rng(5).integers(0, 96, size=(2, 40))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    positions = np.broadcast_to(np.arange(40), (2, 40))
    model_lhc = lm.Transformer(config)
    apply = jax.jit(model_lhc.apply)
    logits, _ = apply({"params": params}, tokens, positions)
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
    # Incrementally: Mistral through a ring of 9 slots (window 6), Qwen2's mixed layers
    # through a full cache; chunks of 13, then 3, then single tokens.
    if config.full_attention_layers:
        cache = lm.init_cache(config, 2, 40)
    else:
        cache = lm.cache.init_sliding_window_cache(config, 2, 6, 9)
    pieces = []
    for start, stop in zip([0, 13, 16, *range(17, 40)], [13, 16, *range(17, 41)]):
        piece, cache = apply(
            {"params": params}, tokens[:, start:stop], positions[:, start:stop], cache
        )
        pieces.append(np.asarray(piece))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), expected, atol=1e-4, rtol=0)
    # The config survives a save: transformers reads back the same windows.
    hf.save(config, params, tmp_path / "again")
    again = type(model).from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        np.testing.assert_allclose(
            again(torch.tensor(tokens)).logits.numpy(), expected, atol=1e-5, rtol=0
        )
