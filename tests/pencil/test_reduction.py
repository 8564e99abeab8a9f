"""PENCIL's reduction rule against an independent streaming implementation, the
training sub-sequences, and the tokenizer."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from lhc.pencil import reduction
from lhc.pencil.reduction import CALL, RETURN, SEP
from lhc.pencil.tokenizer import EOS, PencilTokenizer

ALPHABET = ["a", "b", "c", CALL, SEP, RETURN]


def streaming_reduce(tokens):
    """Generation order: tokens arrive one by one; each [RETURN] looks backwards for the
    last [SEP] and the last [CALL] before it and erases the call if both exist."""
    out = []
    for token in tokens:
        if token == RETURN:
            sep = next((i for i in range(len(out) - 1, -1, -1) if out[i] == SEP), None)
            call = (
                None
                if sep is None
                else next((i for i in range(sep - 1, -1, -1) if out[i] == CALL), None)
            )
            if call is not None:
                out = out[:call] + out[sep + 1 :]
                continue
        out.append(token)
    return out


def nested_trace(rng, depth=0):
    """A random well-formed call tree: thoughts, nested calls, answers, tail calls."""
    out = [CALL, "a"]
    for _ in range(rng.integers(0, 3)):
        out += ["b"] if rng.random() < 0.5 or depth > 3 else nested_trace(rng, depth + 1)
    out.append(SEP)
    if rng.random() < 0.3 and depth < 3:  # a tail call: the answer opens a new call
        out += [CALL, "c", RETURN] + nested_trace(rng, depth + 1)[1:]
        return out
    return out + ["c"] * int(rng.integers(0, 3)) + [RETURN]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=40))
def test_reduce_equals_streaming_reduction(tokens):
    assert reduction.reduce(tokens) == streaming_reduce(tokens)
    once = reduction.reduce_once(tokens)
    assert len(once) <= len(tokens)
    assert reduction.reduce(once) == reduction.reduce(tokens)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_nested_traces_reduce_to_their_last_answer(seed):
    trace = nested_trace(np.random.default_rng(seed))
    reduced = reduction.reduce(trace)
    assert reduced == streaming_reduce(trace)
    # A well-formed call tree reduces to the answer of its top call (tail calls too).
    assert set(reduced) <= {"c"}
    ids = {token: i for i, token in enumerate(ALPHABET)}
    as_ids = [ids[t] for t in trace]
    special = dict(call_id=ids[CALL], sep_id=ids[SEP], return_id=ids[RETURN])
    assert reduction.reduce_ids(as_ids, **special) == [ids[t] for t in reduced]
    assert reduction.reduce_once_ids(as_ids, **special) == [
        ids[t] for t in reduction.reduce_once(trace)
    ]


def test_examples():
    # Nested calls: the innermost returns first.
    tokens = "x [CALL] q1 [CALL] q2 [SEP] A2 [RETURN] [SEP] A1 [RETURN] y".split()
    assert reduction.reduce_once(tokens) == "x [CALL] q1 A2 [SEP] A1 [RETURN] y".split()
    assert reduction.reduce(tokens) == "x A1 y".split()
    # The tail-recursive form: the answer opens a new call.
    tokens = "p [CALL] long thought [SEP] [CALL] summary [RETURN]".split()
    assert reduction.reduce(tokens) == "p [CALL] summary".split()
    # An empty answer.
    assert reduction.reduce("p [CALL] t [SEP] [RETURN] q".split()) == ["p", "q"]
    # Malformed: a [RETURN] without [CALL], without [SEP], or with [SEP] before [CALL].
    for text in ("a [RETURN] b", "[CALL] a [RETURN]", "[SEP] [CALL] a [RETURN]"):
        assert reduction.reduce(text.split()) == text.split()
    # An unmatched [RETURN] stays; a later matching one still reduces.
    tokens = "a [RETURN] [CALL] t [SEP] A [RETURN]".split()
    assert reduction.reduce(tokens) == "a [RETURN] A".split()
    assert reduction.find_reduction(tokens) == (2, 4, 6)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_subsequences_replay_the_trace(seed):
    rng = np.random.default_rng(seed)
    prompt = ["<s>", "p", "<eop>"]
    trace = nested_trace(rng) + [EOS]
    subs = reduction.subsequences(prompt, trace)
    # Every trace token is trained exactly once, in order.
    assert [t for s in subs for t in s.trained] == trace
    context = list(prompt)
    for i, sub in enumerate(subs):
        # The untrained part is the reduced context generation would hold there...
        assert list(sub.tokens[: sub.loss_start]) == context
        assert sub.loss_mask().sum() == len(sub.trained)
        if i + 1 < len(subs):
            # ...and each sub-sequence ends at the [RETURN] that reduces it.
            assert sub.tokens[-1] == RETURN
            assert reduction.find_reduction(sub.tokens)[2] == len(sub.tokens) - 1
            context = reduction.reduce_once(sub.tokens)
    assert list(subs[-1].tokens) == streaming_reduce(prompt + trace)
    with pytest.raises(ValueError, match="non-empty"):
        reduction.subsequences([], trace)


def test_tokenizer():
    tokenizer = PencilTokenizer(["a", "b", "¬"])
    assert tokenizer.tokens[0] == "<UNK>" and tokenizer.pad_id == 0
    assert tokenizer.eos_id == tokenizer.vocab_size - 1
    ids = tokenizer.encode("<|startoftext|> a ¬ b [CALL] [SEP] [RETURN] <|endofprompt|>")
    assert ids == [
        tokenizer.bos_id,
        1,
        3,
        2,
        tokenizer.call_id,
        tokenizer.sep_id,
        tokenizer.return_id,
        tokenizer.end_of_prompt_id,
    ]
    assert tokenizer.decode([0, *ids, 0]) == (
        "<|startoftext|> a ¬ b [CALL] [SEP] [RETURN] <|endofprompt|>"
    )
    with pytest.raises(ValueError, match="'z' is not in"):
        tokenizer.encode("a z")
    with pytest.raises(ValueError, match="outside"):
        tokenizer.decode([tokenizer.vocab_size])
    for bad in (["a", "a"], ["a b"], ["[CALL]"], [""]):
        with pytest.raises(ValueError, match="symbols must be distinct"):
            PencilTokenizer(bad)
