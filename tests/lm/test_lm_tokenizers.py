"""Tokenizers: bytes against Python's UTF-8 codec, tokenizer.json against transformers."""

import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from lhc.lm.checkpoints import load_tokenizer
from lhc.lm.tokenizers import ByteTokenizer, HFTokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer(special_tokens=("[CALL]", "[SEP]", "[RETURN]", "[CALL]x"))
    text = "héllo [CALL]f(1)[SEP]2[RETURN] [CALL]x 🙂"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 257 and ids[-1] == 258
    assert tok.token_id("[CALL]") == 259 and tok.vocab_size == 263
    # Bytes between the specials are exactly Python's UTF-8 encoding.
    assert ids[1:8] == list("héllo ".encode())  # 7 bytes: "é" takes two
    assert ids[8] == 259 and 262 in ids  # the longer "[CALL]x" wins over "[CALL]"
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text + "<eos>"
    assert tok.decode([104, 256, 105]) == "hi"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])
    with pytest.raises(ValueError, match="distinct"):
        ByteTokenizer(special_tokens=("a", "a"))


@pytest.fixture
def tokenizer_dir(tmp_path):
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog"] * 50 + ["needle in a haystack"] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": None})
    )
    return tmp_path


def test_hf_tokenizer_matches_transformers_fast_tokenizer(tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    tok = load_tokenizer(tokenizer_dir)
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json")
    )
    assert tok.bos_id == reference.convert_tokens_to_ids("<s>") == 1
    assert tok.eos_id == 2 and tok.pad_id is None
    assert tok.vocab_size == len(reference)
    for text in ["the lazy fox", "a needle, in the haystack!", "unseen wörds"]:
        ids = tok.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == reference.decode(ids) == text
    dog = tok.encode("dog")
    assert tok.encode("dog", add_bos=True, add_eos=True) == [1, *dog, 2]


def test_hf_tokenizer_errors(tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer.from_file(tmp_path / "missing")
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        HFTokenizer.from_file(tokenizer_dir, bos_token="<nope>")
    tok = HFTokenizer.from_file(tokenizer_dir / "tokenizer.json")
    assert tok.bos_id == 1
    bare = HFTokenizer(tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")))
    with pytest.raises(ValueError, match="no bos token"):
        bare.encode("x", add_bos=True)


# A ChatML template with a default system message, loop variables, a filter and an error.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ bos_token }}<|im_start|>system\nBe brief."
    "<|im_end|>\n{% endif %}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Hi  "}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_chat_template_renders_as_transformers_does(tokenizer_dir, where):
    transformers = pytest.importorskip("transformers")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    if where == "chat_template.jinja":
        (tokenizer_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    else:
        config["chat_template"] = CHAT_TEMPLATE
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tokenizer_dir)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>"}
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            want = reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert got == want
    with pytest.raises(ValueError, match="the chat template failed: unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "{}"}])


def test_a_tokenizer_without_a_chat_template_says_so(tokenizer_dir):
    assert load_tokenizer(tokenizer_dir).chat_template is None
    with pytest.raises(ValueError, match="this tokenizer has no chat template"):
        load_tokenizer(tokenizer_dir).apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="a ByteTokenizer has no chat template"):
        ByteTokenizer().apply_chat_template(CONVERSATIONS[0])
