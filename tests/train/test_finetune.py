"""``lhc train`` from a pretrained checkpoint on text files (``configs/lm_finetune.py``)."""

import json
import os

import numpy as np
import pytest
import safetensors.numpy

from lhc import train
from lhc.train import config as config_lib
from lhc.train import init_from
from lhc.train.checkpoint import Checkpointer
from lhc.train.export import export

WORDS = "the cat sat on a mat and saw the dog run to the old red barn by the river".split()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random O(1)-scale Llama saved by transformers, with a BPE tokenizer, and a
    folder of two text files."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("finetune")
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, 300)) for _ in range(2)]
    (root / "text").mkdir()
    for i, text in enumerate(texts):
        (root / "text" / f"{i}.txt").write_text(text)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            scale = 0.2 if name.endswith("norm.weight") else 0.35
            tensor.copy_(
                (1.0 if name.endswith("norm.weight") else 0.0) + scale * torch.randn_like(tensor)
            )
    model.save_pretrained(root / "model", safe_serialization=True)
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "<s>", "</s>"])
    )
    tokenizer.save(str(root / "model" / "tokenizer.json"))
    (root / "model" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return root, torch, model


def _config(root, *overrides):
    return config_lib.load_config(
        "lm_finetune.py",
        [
            f"init_from={root / 'model'}",
            f"data.paths={root / 'text'}",
            "data.length=16",
            "batch_size=2",
            "num_steps=1",
            "eval_batches=1",
            "progress_bar=False",
            "tensorboard=False",
            *overrides,
        ],
    )


def test_a_run_starts_from_the_checkpoint_with_its_tokenizer(source, tmp_path):
    root, torch, model = source
    workdir = tmp_path / "run"
    config = _config(root, "model.max_len=32", "optimizer.learning_rate=0.0")
    summary = train.train_and_evaluate(config, str(workdir))
    assert np.isfinite(summary["eval/perplexity"])
    record = json.loads((workdir / init_from.RECORD).read_text())
    assert record["overrides"] == ["model.max_len: 64 -> 32"]
    recorded = config_lib.load_run_config(str(workdir))
    assert (recorded.model.num_layers, recorded.model.max_len) == (2, 32)
    assert recorded.data.tokenizer == os.path.join(str(workdir), "tokenizer")

    # The run's model, read back as `lhc generate --workdir` does, is transformers'.
    ckpt = train.load_language_model(workdir=str(workdir))
    tokens = np.random.default_rng(1).integers(0, 128, size=(1, 24))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    logits, _ = ckpt.model.apply({"params": ckpt.params}, tokens, np.arange(24)[None])
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=0)
    import tokenizers

    original = tokenizers.Tokenizer.from_file(str(root / "model" / "tokenizer.json"))
    assert ckpt.tokenizer.encode("the cat saw") == original.encode("the cat saw").ids
    assert ckpt.tokenizer.eos_id == original.token_to_id("</s>")

    # Resuming reads nothing of the source: it may be gone.
    moved = root / "moved"
    os.rename(root / "model", moved)
    try:
        train.train_and_evaluate(_config(root, "num_steps=2", "model.max_len=32"), str(workdir))
    finally:
        os.rename(moved, root / "model")
    assert train.restore_params(None, str(workdir))[2] == 2


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_written(source, tmp_path):
    root, _, _ = source
    workdir = tmp_path / "refused"
    with pytest.raises(ValueError, match="layers.2") as refused:
        train.train_and_evaluate(_config(root, "model.num_layers=3"), str(workdir))
    assert "tensors do not match the config: missing ['model.layers.2." in str(refused.value)
    assert not workdir.exists()


def test_two_names_for_two_sources_are_refused(source):
    root, _, _ = source
    config = _config(root, f"init_params_from={root / 'text'}")
    with pytest.raises(ValueError, match="name different sources"):
        init_from.source_spec(config)


def test_an_adapter_run_trains_and_saves_the_adapters_alone(source, tmp_path):
    root, torch, model = source
    workdir = tmp_path / "lora"
    lora = [
        "lora.rank=2",
        "lora.targets=('attention/(query|value)',)",
        "optimizer.learning_rate=0.05",
    ]
    train.train_and_evaluate(_config(root, "num_steps=2", *lora), str(workdir))
    checkpointer = Checkpointer(str(workdir / "checkpoints"), read_only=True)
    try:
        saved = checkpointer.state_arrays(checkpointer.latest_step())
    finally:
        checkpointer.close()
    params = [path for path in saved if path.startswith("params/")]
    assert params and all(path.split("/")[-1] in ("lora_a", "lora_b") for path in params)
    moments = [path for path in saved if path.startswith("opt_state/")]
    assert moments and all("lora_" in path for path in moments if "count" not in path)

    # The plain model read back is the checkpoint's with A B added to q and v only.
    ckpt = train.load_language_model(workdir=str(workdir))
    tensors = safetensors.numpy.load_file(str(root / "model" / "model.safetensors"))
    changed = 0
    for layer in range(2):
        for name, hf_name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            kernel = np.asarray(ckpt.params["layers"]["attention"][name]["kernel"][layer])
            original = tensors[f"model.layers.{layer}.self_attn.{hf_name}.weight"].T.reshape(
                kernel.shape
            )
            same = np.allclose(kernel, original, atol=1e-6)
            assert same == (name == "key"), (layer, name)
            changed += not same
    assert changed == 4

    # Exported merged, and as a PEFT adapter over the checkpoint: transformers (and peft)
    # give the logits lhc gives.
    tokens = np.random.default_rng(2).integers(0, 128, size=(1, 20))
    logits, _ = ckpt.model.apply({"params": ckpt.params}, tokens, np.arange(20)[None])
    export(str(workdir), str(tmp_path / "merged"))
    transformers = pytest.importorskip("transformers")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        expected = merged(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=0)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert loaded("the cat saw", add_special_tokens=False)["input_ids"] == ckpt.tokenizer.encode(
        "the cat saw"
    )
    peft = pytest.importorskip("peft")
    export(str(workdir), str(tmp_path / "adapter"), adapter=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "model")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        expected = adapted(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=0)

    # Resumed without the source: the frozen weights come from the run's own copy.
    moved = root / "moved"
    os.rename(root / "model", moved)
    try:
        train.train_and_evaluate(_config(root, "num_steps=3", *lora), str(workdir))
    finally:
        os.rename(moved, root / "model")
    assert train.restore_params(None, str(workdir))[2] == 3


def test_the_long_configuration_trains_an_extended_model(source, tmp_path):
    # configs/lm_finetune.py:long at toy sizes: YaRN from 64 to 128 positions, LoRA on
    # q/k/v/o, remat and blocked attention, the loss in chunks.
    root, _, _ = source
    config = config_lib.load_config(
        "lm_finetune.py:long,runlocal,context=128,original=64",
        [f"init_from={root / 'model'}", f"data.paths={root / 'text'}", "num_steps=1",
         "eval_batches=1", "data.eval_fraction=0.3", "loss_chunk=32", "progress_bar=False",
         "tensorboard=False"],
    )  # fmt: skip
    summary = train.train_and_evaluate(config, str(tmp_path / "long"))
    assert np.isfinite(summary["train/loss"]) and np.isfinite(summary["eval/loss"])
    record = json.loads((tmp_path / "long" / init_from.RECORD).read_text())
    assert "model.max_len: 64 -> 128" in record["overrides"]
    assert any(line.startswith("model.rope_scaling: None -> {") for line in record["overrides"])
