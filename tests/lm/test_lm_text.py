"""Text generation from a checkpoint (``lhc.lm.generate_text``, ``lhc generate``): the
streamed text against the decoded tokens of ``lhc.lm.generate``, chat prompts against the
template rendered by hand, and the command's errors."""

import json

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from lhc import cli, lm

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A random two-layer Llama with a byte-level BPE tokenizer and a chat template."""
    path = tmp_path_factory.mktemp("checkpoint")
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["the capital of france is paris, ça va?"] * 40, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": TEMPLATE}
        )
    )
    config = lm.LMConfig(
        vocab_size=tokenizer.get_vocab_size(),
        num_layers=2,
        embed_dim=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        max_len=256,
    )
    lm.hf.save(config, lm.init_params(config, jax.random.key(0)), path)
    return path


def test_streamed_text_is_the_decoded_generation(checkpoint_dir):
    ckpt = lm.load_checkpoint(checkpoint_dir)
    assert ckpt.stop_tokens == (ckpt.tokenizer.eos_id,) and ckpt.config.dtype == "float32"
    prompts = ["the capital of", "ça"]
    pieces = {0: [], 1: []}
    streamed = lm.generate_text(
        ckpt, prompts[:1], max_new_tokens=24, on_text=lambda row, text: pieces[row].append(text)
    )
    batch = lm.generate_text(ckpt, prompts, max_new_tokens=24)
    out = lm.generate(
        ckpt.model,
        ckpt.params,
        [ckpt.tokenizer.encode(p) for p in prompts],
        max_new_tokens=24,
        stop_tokens=ckpt.stop_tokens,
    )
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    want = [
        ckpt.tokenizer.decode([t for t in row[:n] if t not in ckpt.stop_tokens])
        for row, n in zip(tokens.tolist(), lengths.tolist())
    ]
    assert batch == want and streamed == want[:1]
    assert "".join(pieces[0]) == want[0] and len(pieces[0]) > 1 and not pieces[1]


def test_chat_prompts_go_through_the_template(checkpoint_dir):
    ckpt = lm.load_checkpoint(checkpoint_dir)
    by_hand = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert lm.chat_prompt(ckpt.tokenizer, "Hi there") == ckpt.tokenizer.encode(by_hand)
    chat = lm.generate_text(ckpt, ["Hi there"], chat=True, max_new_tokens=12)
    plain = lm.generate_text(ckpt, [by_hand], max_new_tokens=12)
    assert chat == plain


def test_lhc_generate_streams_one_prompt_and_prints_a_batch(checkpoint_dir, tmp_path, capsys):
    args = ["generate", "--checkpoint", str(checkpoint_dir), "--max-new-tokens", "16"]
    assert cli.main([*args, "--prompt", "the capital of"]) == 0
    ckpt = lm.load_checkpoint(checkpoint_dir)
    want = lm.generate_text(ckpt, ["the capital of", "ça"], max_new_tokens=16)
    assert capsys.readouterr().out == want[0] + "\n"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ça\n\n")
    assert cli.main([*args, "--prompt", "the capital of", "--prompts-file", str(prompts)]) == 0
    assert capsys.readouterr().out == f"[0] {want[0]}\n[1] {want[1]}\n"
    sampled = [*args, "--prompt", "the", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]
    assert cli.main(sampled) == 0
    assert capsys.readouterr().out.endswith("\n")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--checkpoint", "/no/such/model"], "lhc generate: checkpoint '/no/such/model': no such"),
        (["--checkpoint", "{dir}"], "lhc generate: give --prompt TEXT"),
        (
            ["--checkpoint", "{dir}", "--prompt", "x", "--chat", "--temperature", "-1"],
            "lhc generate: temperature must be >= 0",
        ),
        (
            ["--checkpoint", "{dir}", "--prompt", "x", "--max-new-tokens", "0"],
            "lhc generate: --max-new-tokens must be >= 1, got 0",
        ),
    ],
)
def test_lhc_generate_errors_are_one_line(checkpoint_dir, extra, message):
    extra = [arg.replace("{dir}", str(checkpoint_dir)) for arg in extra]
    if "--prompt" not in extra and "/no/such" in extra[1]:
        extra += ["--prompt", "x"]
    with pytest.raises(SystemExit) as raised:
        cli.main(["generate", *extra])
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)
