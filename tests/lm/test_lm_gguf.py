"""GGUF files: ``lhc.lm.gguf`` against transformers' GGUF loader, on small random files
written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them (``_gguf_files``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import TokenType

from lhc import lm
from lhc.lm import gguf as lm_gguf
from lhc.nn.rope import rope_frequencies
from lhc.parallel.mesh import make_mesh

from ._gguf_files import (
    DIMS,
    LLAMA_TYPES,
    QWEN2_TYPES,
    USER_TOKEN,
    _llama3_divisors,
    random_texts,
    write_gguf,
)
from ._gguf_files import byte_level_vocab as _byte_level_vocab
from ._gguf_files import sentencepiece_vocab as _sentencepiece_vocab

# Parity with transformers ------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_level_vocab():
    return _byte_level_vocab()


@pytest.fixture(scope="module")
def sentencepiece_vocab():
    return _sentencepiece_vocab()


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_transformers(tmp_path, byte_level_vocab, arch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    types, tie = (LLAMA_TYPES, True) if arch == "llama" else (QWEN2_TYPES, False)
    write_gguf(tmp_path / "model.gguf", arch, byte_level_vocab, types=types, tie=tie)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf"
    ).eval()
    expected_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert type(reference).__name__ == expected_class
    vocab_size = len(byte_level_vocab["tokens"])
    tokens = np.random.default_rng(1).integers(0, vocab_size, size=(3, 40))
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)).logits.numpy()
    positions = np.broadcast_to(np.arange(40), (3, 40))

    config, params = lm_gguf.load(tmp_path / "model.gguf")
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.tie_embeddings == tie and config.qkv_bias == (arch == "qwen2")
    assert config.vocab_size == vocab_size and config.max_len == DIMS["context"]
    logits, _ = jax.jit(lm.Transformer(config).apply)({"params": params}, tokens, positions)
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)

    # Scanned layers in the checkpoint's own [out, in] layout, placed on a mesh.
    mesh = make_mesh((1, 1, 1))
    scan_config, scan_params = lm_gguf.load(
        tmp_path / "model.gguf", scan_layers=True, kernel_layout="out_in", mesh=mesh
    )
    assert isinstance(scan_params["layers"]["mlp"]["down"]["kernel"].sharding, jax.NamedSharding)
    logits, _ = jax.jit(lm.Transformer(scan_config).apply)(
        {"params": scan_params}, tokens, positions
    )
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize(
    "vocab_name,pre",
    [
        ("byte_level", "gpt-2"),
        ("byte_level", "llama-bpe"),
        ("byte_level", "qwen2"),
        ("sentencepiece", None),
    ],
)
def test_tokenizer_matches_transformers(tmp_path, request, vocab_name, pre):
    transformers = pytest.importorskip("transformers")
    vocab = request.getfixturevalue(f"{vocab_name}_vocab")
    path = write_gguf(tmp_path / "model.gguf", "llama", vocab, pre=pre)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    tokenizer = lm_gguf.load_tokenizer(path)
    assert lm.load_tokenizer(path).vocab_size == tokenizer.vocab_size == len(vocab["tokens"])
    assert (tokenizer.bos_id, tokenizer.eos_id) == (reference.bos_token_id, reference.eos_token_id)
    for text in random_texts(300, seed=len(vocab["tokens"]) + len(pre or "")):
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        decoded = tokenizer.decode(ids, skip_special_tokens=False)
        assert decoded == reference.decode(ids, skip_special_tokens=False)
        # "▁" is prepended only to text that does not start with a space, and one
        # leading space is stripped in decoding: a leading space is lost.
        lost_space = vocab_name == "sentencepiece" and text.startswith(" ")
        assert decoded == (text[1:] if lost_space else text)
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    # Control tokens stay whole and are special; a user-defined one stays whole.
    im_end = vocab["tokens"].index("<|im_end|>")
    assert tokenizer.encode("<|im_end|>") == [im_end]
    assert tokenizer.encode(USER_TOKEN) == [vocab["tokens"].index(USER_TOKEN)]
    assert tokenizer.decode([im_end]) == ""

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "the quick fox?"},
    ]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parity
def test_smollm_splits_digits_one_by_one(tmp_path, byte_level_vocab):
    """SmolLM's tokenizer.json and llama.cpp split digits before the GPT-2 pattern;
    transformers' GGUF loader does not, so it is the reference only without digits."""
    transformers = pytest.importorskip("transformers")
    tokens = byte_level_vocab["tokens"]
    assert any(sum(c.isdigit() for c in t) > 1 for t in tokens)  # digits were merged
    path = write_gguf(tmp_path / "model.gguf", "llama", byte_level_vocab, pre="smollm")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    tokenizer = lm_gguf.load_tokenizer(path)
    for text in random_texts(100, seed=3):
        if any(c.isdigit() for c in text):
            continue
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
    text = "in 2024, 365 haystacks"
    digits = [tokens[i] for i in tokenizer.encode(text) if any(c.isdigit() for c in tokens[i])]
    assert digits == ["2", "0", "2", "4", "3", "6", "5"]
    merged = reference.encode(text, add_special_tokens=False)
    assert any(sum(c.isdigit() for c in tokens[i]) > 1 for i in merged)


def test_llama3_vocabularies_take_whole_words(tmp_path, byte_level_vocab):
    """llama.cpp (and Llama 3's tokenizer.json) take a word that is a vocabulary entry
    whole, even where no merge makes it; other vocabularies apply the merges."""
    vocab = dict(byte_level_vocab, tokens=[*byte_level_vocab["tokens"], "quickfox"])
    vocab["types"] = [*byte_level_vocab["types"], TokenType.NORMAL]
    whole = len(vocab["tokens"]) - 1
    llama3 = lm_gguf.load_tokenizer(
        write_gguf(tmp_path / "a.gguf", "llama", vocab, pre="llama-bpe")
    )
    qwen2 = lm_gguf.load_tokenizer(write_gguf(tmp_path / "b.gguf", "llama", vocab, pre="qwen2"))
    assert llama3.encode("quickfox") == [whole]
    assert whole not in qwen2.encode("quickfox") and len(qwen2.encode("quickfox")) > 1


# Metadata ----------------------------------------------------------------------------


def test_stop_tokens(tmp_path, byte_level_vocab):
    tokens = byte_level_vocab["tokens"]
    eos, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    path = write_gguf(tmp_path / "a.gguf", "qwen2", byte_level_vocab, eot=im_end)
    assert lm_gguf.stop_tokens(path) == (eos, im_end)
    path = write_gguf(tmp_path / "b.gguf", "qwen2", byte_level_vocab, eot=eos)
    assert lm_gguf.stop_tokens(path) == (eos,)


@pytest.mark.parametrize("rope", [("llama3", 8.0, 1.0, 4.0, 8192), ("llama3", 4.0, 1.0, 8.0, 1024)])
def test_llama3_rope_from_rope_freqs(tmp_path, sentencepiece_vocab, rope):
    """llama.cpp stores Llama 3 scaling as divisors; the recovered llama3 parameters
    must give exactly llama.cpp's frequencies (transformers ignores rope_freqs)."""
    path = write_gguf(tmp_path / "m.gguf", "llama", sentencepiece_vocab, rope=rope)
    config, _ = lm_gguf.load(path)
    assert config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["factor"] == rope[1]
    head_dim = DIMS["head_dim"]
    unscaled = 1 / 10_000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(
        rope_frequencies(head_dim, 10_000.0, config.rope_scaling),
        unscaled / _llama3_divisors(*rope[1:]),
        rtol=1e-5,
    )


def test_linear_rope_scaling_and_overrides(tmp_path, sentencepiece_vocab):
    path = write_gguf(tmp_path / "m.gguf", "llama", sentencepiece_vocab, rope=("linear", 4.0))
    config, params = lm_gguf.load(path, jnp.bfloat16, max_len=128)
    assert dict(config.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    assert (config.max_len, config.dtype, config.param_dtype) == (128, "bfloat16", "bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


# Bad input ---------------------------------------------------------------------------


def test_errors_name_the_file_and_what_was_expected(
    tmp_path, sentencepiece_vocab, byte_level_vocab
):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        lm_gguf.load(tmp_path / "missing.gguf")
    (tmp_path / "text.gguf").write_text("not a gguf file")
    with pytest.raises(ValueError, match="text.gguf is not a GGUF file"):
        lm_gguf.load_tokenizer(tmp_path / "text.gguf")

    bert = write_gguf(tmp_path / "bert.gguf", "llama", {**sentencepiece_vocab, "model": "bert"})
    with pytest.raises(ValueError, match="bert.gguf: tokenizer.ggml.model 'bert' is not supp"):
        lm_gguf.load_tokenizer(bert)
    bogus = write_gguf(tmp_path / "bogus.gguf", "llama", byte_level_vocab, pre="bogus")
    with pytest.raises(ValueError, match="bogus.gguf: tokenizer.ggml.pre 'bogus' is not supp"):
        lm_gguf.load_tokenizer(bogus)
    data = write_gguf(tmp_path / "good.gguf", "llama", sentencepiece_vocab).read_bytes()
    for cut in (40, len(data) // 3, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="cut.gguf is truncated or corrupt"):
            lm_gguf.load(tmp_path / "cut.gguf")

    phi = write_gguf(tmp_path / "phi3.gguf", "phi3", sentencepiece_vocab)
    with pytest.raises(ValueError, match=r"phi3.gguf: unsupported architecture 'phi3'"):
        lm_gguf.load(phi)

    int8 = np.zeros((DIMS["embed"], DIMS["embed"]), np.int8)
    odd = write_gguf(
        tmp_path / "int8.gguf",
        "llama",
        sentencepiece_vocab,
        drop=("blk.0.attn_output.weight",),
        extra_tensors=[("blk.0.attn_output.weight", int8, Q.I8)],
    )
    with pytest.raises(ValueError, match="'blk.0.attn_output.weight' has ggml type I8"):
        lm_gguf.load(odd)

    partial = write_gguf(
        tmp_path / "partial.gguf",
        "qwen2",
        sentencepiece_vocab,
        drop=("blk.1.ffn_down.weight", "blk.0.attn_k.bias"),
    )
    with pytest.raises(ValueError, match=r"missing tensors \['blk.0.attn_k.bias', 'blk.1.ffn"):
        lm_gguf.load(partial)

    wrong = write_gguf(
        tmp_path / "wrong.gguf",
        "llama",
        sentencepiece_vocab,
        drop=("output_norm.weight",),
        extra_tensors=[("output_norm.weight", np.ones(8, np.float32), Q.F32)],
    )
    with pytest.raises(ValueError, match=r"wrong.gguf: .*'model.norm.weight' has shape \(8,\)"):
        lm_gguf.load(wrong)
