"""Gemma 3 in lhc.lm against transformers' ``modeling_gemma3.py``: random Hugging Face
checkpoints and GGUF files (sequences of several windows), the export back, the layers
scanned in groups of one period, and the per-layer-type cache against recomputation."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from gguf import GGMLQuantizationType as Q

from lhc import lm

from ._gguf_files import GEMMA3_LAYERS, GEMMA3_WINDOW, random_texts, write_gguf
from ._gguf_files import sentencepiece_vocab as _sentencepiece_vocab

LENGTH = 5 * GEMMA3_WINDOW  # five windows


def _reference(torch, transformers, **changes):
    """A random ``Gemma3ForCausalLM`` of 7 layers (one local-global period and one more),
    its weights at O(1) scale and its norms away from one."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=GEMMA3_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=GEMMA3_WINDOW,
        query_pre_attn_scalar=24,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        **changes,
    )
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            weight.normal_(0, 0.3 if "norm" in name else 0.15)
    return model


def _logits(config, params, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = jax.jit(lm.Transformer(config).apply)({"params": params}, tokens, positions)
    return np.asarray(logits)


@pytest.mark.parity
def test_hugging_face_checkpoints_match_transformers_and_export_back(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    reference = _reference(torch, transformers, rope_scaling={"rope_type": "linear", "factor": 4.0})
    reference.save_pretrained(tmp_path / "hf")
    tokens = np.random.default_rng(1).integers(0, 96, size=(2, LENGTH))
    with torch.no_grad():
        want = reference(torch.tensor(tokens)).logits.numpy()
    assert np.abs(want).max() > 1  # not a near-constant output

    config, params = lm.hf.load(tmp_path / "hf")
    assert config.full_attention_layers == (5,) and config.sliding_window == GEMMA3_WINDOW
    assert (config.local_rope_theta, config.rope_theta) == (1e4, 1e6)
    assert config.query_scale == pytest.approx(24**-0.5)
    np.testing.assert_allclose(_logits(config, params, tokens), want, atol=1e-4, rtol=0)
    # Scanned in groups of six (five local, one global), the seventh layer looped.
    scan_config, scan_params = lm.hf.load(tmp_path / "hf", scan_layers=True)
    assert scan_config.layer_period == 6 and set(scan_params["layers"]) == {
        f"block_{j}" for j in range(6)
    }
    assert "layers_6" in scan_params
    np.testing.assert_allclose(_logits(scan_config, scan_params, tokens), want, atol=1e-4, rtol=0)

    lm.hf.save(scan_config, scan_params, tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        np.testing.assert_array_equal(exported(torch.tensor(tokens)).logits.numpy(), want)


def test_the_language_model_of_a_conditional_generation_checkpoint(tmp_path):
    """A ``Gemma3ForConditionalGeneration`` directory as released (``language_model.*``
    and a vision tower): the text part loads, the vision weights are not read."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    reference = _reference(torch, transformers)
    reference.save_pretrained(tmp_path / "text")
    text_config = json.loads((tmp_path / "text" / "config.json").read_text())
    tensors = safetensors.numpy.load_file(tmp_path / "text" / "model.safetensors")
    renamed = {"language_model." + name: value for name, value in tensors.items()}
    renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((2, 3))
    (tmp_path / "mm").mkdir()
    safetensors.numpy.save_file(renamed, tmp_path / "mm" / "model.safetensors")
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text_config,
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    (tmp_path / "mm" / "config.json").write_text(json.dumps(config))
    tokens = np.random.default_rng(2).integers(0, 96, size=(1, LENGTH))
    want = _logits(*lm.hf.load(tmp_path / "text"), tokens)
    np.testing.assert_array_equal(_logits(*lm.hf.load(tmp_path / "mm"), tokens), want)


@pytest.mark.parity
def test_gguf_files_match_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    vocab = _sentencepiece_vocab()
    types = {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "attn_v": Q.F16, "ffn_down": Q.Q4_K}
    write_gguf(tmp_path / "model.gguf", "gemma3", vocab, types=types)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf"
    ).eval()
    assert type(reference).__name__ == "Gemma3ForCausalLM"
    tokens = np.random.default_rng(1).integers(0, len(vocab["tokens"]), size=(2, LENGTH))
    with torch.no_grad():
        want = reference(torch.tensor(tokens)).logits.numpy()
    ckpt = lm.load_checkpoint(tmp_path / "model.gguf", dtype="float32")
    assert ckpt.config.full_attention_layers == (5,) and ckpt.config.layer_period == 6
    np.testing.assert_allclose(_logits(ckpt.config, ckpt.params, tokens), want, atol=1e-4, rtol=0)
    # The tokenizer (SentencePiece, no space prefix, BOS added) as transformers builds it.
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(
        tmp_path, gguf_file="model.gguf"
    )
    for text in random_texts(60, seed=3):
        assert ckpt.tokenizer.encode(text) == reference_tokenizer.encode(
            text, add_special_tokens=False
        ), text
    assert ckpt.tokenizer.add_bos_token and ckpt.tokenizer.chat_template is not None


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(model, params, tokens, positions):
    return model.apply({"params": params}, tokens, positions, last_only=True)[0]


def _greedy_by_recomputation(model, params, prompt, steps, width=80):
    """Greedy tokens, each from a forward pass over the whole sequence (left-padded to
    ``width`` columns: one compiled program)."""
    sequence = list(prompt)
    for _ in range(steps):
        tokens = np.zeros((1, width), np.int32)
        positions = np.full((1, width), -1, np.int32)
        tokens[0, width - len(sequence) :] = sequence
        positions[0, width - len(sequence) :] = np.arange(len(sequence))
        logits = _last_logits(model, params, tokens, positions)
        sequence.append(int(np.argmax(logits[0, -1])))
    return sequence[len(prompt) :]


@pytest.fixture(scope="module")
def tiny_gemma():
    config = lm.LMConfig(
        vocab_size=64,
        num_layers=GEMMA3_LAYERS,
        embed_dim=32,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        mlp_dim=64,
        max_len=256,
        rope_theta=1e6,
        local_rope_theta=1e4,
        sliding_window=GEMMA3_WINDOW,
        full_attention_layers=(5,),
        qk_norm=True,
        post_norms=True,
        norm_scale_offset=1.0,
        embed_scale=True,
        mlp_type="geglu",
        tie_embeddings=True,
        scan_layers=True,
    )
    params = lm.random_params(config.replace(scan_layers=False), 0)
    params = lm.stack_layer_params(params, config.num_layers, config.layer_period)
    return lm.Transformer(config), params


def test_the_hybrid_cache_decodes_as_recomputation_across_ring_wraps(tiny_gemma, held_block):
    model, params = tiny_gemma
    ring = GEMMA3_WINDOW + 4  # wraps every 12 tokens
    cache = lm.init_hybrid_cache(model.config, 2, 200, ring)
    assert cache.full.keys.shape[:4] == (1, 2, 1, 200) and cache.ring.keys.shape[:4] == (
        6,
        2,
        1,
        ring,
    )
    prompts = [list(range(1, 12)), list(range(3, 40))]
    out = lm.generate(model, params, prompts, max_new_tokens=30, cache=cache, prefill_chunk=5)
    for row, prompt in enumerate(prompts):
        want = _greedy_by_recomputation(model, params, prompt, 30)
        assert np.asarray(out.tokens[row]).tolist() == want
    assert isinstance(model.init_cache(2, 200), lm.HybridKVCache)


def test_switched_layers_give_the_logits_of_the_loop(tiny_gemma):
    """An array per layer, one compiled period choosing them by lax.switch and the
    seventh layer looped, against the plain loop over the layers, past the window."""
    config = tiny_gemma[0].config.replace(scan_layers=False)
    params = lm.unstack_layer_params(tiny_gemma[1])
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 40))
    positions = np.broadcast_to(np.arange(40), (2, 40))
    want = lm.Transformer(config).apply({"params": params}, tokens, positions)[0]
    switched = lm.Transformer(config.replace(switch_layers=True))
    got = switched.apply({"params": params}, tokens, positions)[0]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_the_hybrid_cache_rolls_back_and_shares_a_prefix(tiny_gemma):
    """Truncation within the ring's headroom (speculative rollback) and repeated rows
    (a shared prefix) continue as recomputation does."""
    model, params = tiny_gemma
    prompt = list(range(2, 30))
    cache = lm.init_hybrid_cache(model.config, 1, 128, GEMMA3_WINDOW + 4)
    first = lm.generate(model, params, [prompt], max_new_tokens=6, cache=cache)
    drafted = [*prompt, *np.asarray(first.tokens[0, :5]).tolist()]
    back = first.cache.truncate(first.cache.lengths - 3)  # forget 3 tokens
    assert bool(back.can_append(1)[0])
    kept = drafted[: int(back.next_positions()[0])]  # the slots count left padding too
    shared = lm.repeat_rows(back, 2)
    again = lm.generate(model, params, [[7], [9]], max_new_tokens=5, cache=shared)
    for row, token in enumerate((7, 9)):
        want = _greedy_by_recomputation(model, params, [*kept, token], 5)
        assert np.asarray(again.tokens[row]).tolist() == want
    too_far = first.cache.truncate(first.cache.lengths - 20)  # past the ring's spare slots
    assert not bool(too_far.can_append(1)[0])
    with pytest.raises(ValueError, match="truncated back by more than slots - window"):
        model.apply(
            {"params": params}, jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32), too_far
        )


def test_configs_gemma3_refuses(tmp_path):
    base = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6}
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 is not supported"):
        lm.hf.config_from_hf({**base, "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="hidden_activation must be 'gelu_pytorch_tanh'"):
        lm.hf.config_from_hf({**base, "hidden_activation": "silu"})
    with pytest.raises(ValueError, match="layer_types must list 6"):
        lm.hf.config_from_hf({**base, "layer_types": ["full_attention"] * 5})
    config = lm.hf.config_from_hf(base)
    assert config.full_attention_layers == (5,) and config.sliding_window == 4096
    with pytest.raises(ValueError, match="has no Hugging Face architecture"):
        lm.hf.config_to_hf(config.replace(post_norms=False))
