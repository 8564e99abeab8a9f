"""The decoding API: chunked prefill, decode_step, the loop's step hook, continuation from
a cache, one compiled program across sampling settings and nearby prompt widths, and the
compiled loop updating the cache in place."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc import lm
from lhc.lm import decoding

from ..support import random_params

CONFIG = lm.LMConfig.tiny(vocab_size=64, max_len=128)
PROMPTS = [[5, 9, 1, 33, 2, 7], [12], [40, 41, 42]]
# Random weights this large make the next-token distributions peaked and the argmax
# unambiguous.
SCALE = 0.5


@jax.jit
def _last_logits(params, tokens, lengths):
    positions = jnp.arange(tokens.shape[1])[None, :]
    positions = jnp.where(positions < lengths[:, None], positions, -1)
    logits, _ = lm.Transformer(CONFIG).apply({"params": params}, tokens, positions)
    return logits[jnp.arange(tokens.shape[0]), lengths - 1]


def _greedy_by_recomputation(params, sequences, steps):
    """Greedy continuation of each sequence by full forward passes without a cache."""
    sequences = [list(s) for s in sequences]
    out = []
    for _ in range(steps):
        padded = np.zeros((len(sequences), 64), np.int32)
        for b, seq in enumerate(sequences):
            padded[b, : len(seq)] = seq
        lengths = np.array([len(s) for s in sequences], np.int32)
        chosen = np.asarray(_last_logits(params, padded, lengths)).argmax(-1)
        out.append(chosen)
        for b in range(len(sequences)):
            sequences[b].append(int(chosen[b]))
    return np.stack(out, axis=1)


def test_chunked_prefill_and_decode_step_equal_generate(held_block):
    params = random_params(CONFIG, scale=SCALE)
    model = lm.Transformer(CONFIG)
    steps = 8
    want = _greedy_by_recomputation(params, PROMPTS, steps)
    # Chunks of 3: a first chunk of width % 3 columns, then a scan over the rest.
    out = lm.generate(model, params, PROMPTS, max_new_tokens=steps, prefill_chunk=3)
    np.testing.assert_array_equal(out.tokens, want)
    # By hand: prefill, then decode_step at explicit positions.
    tokens, lengths = lm.left_pad(PROMPTS)
    positions = lm.left_padded_positions(jnp.asarray(lengths), tokens.shape[1])
    logits, cache = lm.prefill(
        model, params, jnp.asarray(tokens), positions, model.init_cache(3, 32), chunk_size=4
    )
    got, position = [], jnp.asarray(lengths)
    for _ in range(steps):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        got.append(np.asarray(token))
        logits, cache = lm.decode_step(model, params, token, position, cache)
        position = position + 1
    np.testing.assert_array_equal(np.stack(got, 1), want)


def test_generate_continues_from_a_cache():
    params = random_params(CONFIG, scale=SCALE)
    model = lm.Transformer(CONFIG)
    first = lm.generate(model, params, PROMPTS, max_new_tokens=5)
    tokens = np.asarray(first.tokens)
    # Next turn: the last generated token (never fed) and two new ones.
    turn = [[int(tokens[b, -1]), 3, 4] for b in range(3)]
    second = lm.generate(model, params, turn, max_new_tokens=6, cache=first.cache)
    whole = [PROMPTS[b] + list(tokens[b]) + [3, 4] for b in range(3)]
    np.testing.assert_array_equal(second.tokens, _greedy_by_recomputation(params, whole, 6))


def test_a_prefilled_cache_of_prompts_serves_several_continuations():
    params = random_params(CONFIG, scale=SCALE)
    model = lm.Transformer(CONFIG)
    cache = decoding.prefilled_cache(model, params, PROMPTS, extra=12, prefill_chunk=4)
    assert cache.lengths.tolist() == [6, 6, 6]  # left-padded to the longest prompt
    for turn in ([[3, 4]] * 3, [[8], [9], [10]]):
        got = lm.generate(
            model, params, turn, max_new_tokens=5, cache=jax.tree.map(jnp.copy, cache)
        )
        whole = [p + t for p, t in zip(PROMPTS, turn)]
        np.testing.assert_array_equal(got.tokens, _greedy_by_recomputation(params, whole, 5))


def test_step_hook_rewinds_the_cache_at_a_position():
    """A hook that, after the 4th token, forgets the 2nd and 3rd generated tokens (as a
    PENCIL reduction does) and feeds the pending 4th right after the 1st."""
    params = random_params(CONFIG, scale=SCALE)
    model = lm.Transformer(CONFIG)
    prompt_lengths = jnp.asarray([len(p) for p in PROMPTS])

    def rewind(state: lm.DecodeState) -> lm.DecodeState:
        at_four = state.step == 4
        cut = prompt_lengths + 1  # keep the prompt and the first generated token
        cache = jax.lax.cond(
            at_four, lambda c: c.truncate_at_position(cut), lambda c: c, state.cache
        )
        return state.replace(
            cache=cache,
            position=jnp.where(at_four, cut, state.position),
            hook_state=state.hook_state + at_four.astype(jnp.int32),
        )

    out = lm.generate(
        model, params, PROMPTS, max_new_tokens=9, step_hook=rewind, hook_state=jnp.int32(0)
    )
    assert int(out.hook_state) == 1
    tokens = np.asarray(out.tokens)
    reduced = [PROMPTS[b] + [int(tokens[b, 0]), int(tokens[b, 3])] for b in range(3)]
    np.testing.assert_array_equal(tokens[:, 4:], _greedy_by_recomputation(params, reduced, 5))
    np.testing.assert_array_equal(tokens[:, :4], _greedy_by_recomputation(params, PROMPTS, 4))
    np.testing.assert_array_equal(out.next_positions, prompt_lengths + 2 + 4)


def test_sliding_window_model_decodes_past_its_ring():
    """Window 4: generate runs through a ring of window + 128 slots, far past it, and gives
    the tokens of a full cache under the window mask."""
    config = CONFIG.replace(sliding_window=4, max_len=512)
    params = random_params(config, scale=SCALE)
    model = lm.Transformer(config)
    steps = 150
    ring = lm.generate(model, params, PROMPTS, max_new_tokens=steps)
    assert isinstance(ring.cache, lm.SlidingWindowKVCache)
    full_cache = lm.init_cache(config, 3, 200)
    full = lm.generate(model, params, PROMPTS, max_new_tokens=steps, cache=full_cache)
    np.testing.assert_array_equal(ring.tokens, full.tokens)
    assert len(np.unique(np.asarray(full.tokens))) > 5


def test_one_compile_serves_new_sampling_values_stop_tokens_and_nearby_widths():
    params = random_params(CONFIG, scale=SCALE)
    model = lm.Transformer(CONFIG)
    programs = decoding._generate_jit._cache_size  # compiled variants of the decode program
    rng = jax.random.key(0)
    first = dict(sampling=lm.SamplingParams(temperature=0.7, top_k=5, top_p=0.9), stop_tokens=[3])
    lm.generate(model, params, [list(range(1, 21)), [4, 5]], max_new_tokens=10, rng=rng, **first)
    before = programs()
    for sampling, stop, width, steps in [
        (lm.SamplingParams(temperature=1.3, top_k=0, top_p=1.0), [3, 9, 11], 23, 12),
        (lm.SamplingParams(temperature=0.0), [], 17, 9),
        (lm.SamplingParams(temperature=0.5, top_k=2, top_p=0.5), [60], 30, 16),
    ]:
        prompts = [list(range(1, width + 1)), [4, 5]]
        out = lm.generate(
            model,
            params,
            prompts,
            max_new_tokens=steps,
            rng=rng,
            sampling=sampling,
            stop_tokens=stop,
        )
        assert out.tokens.shape == (2, steps)
    assert programs() == before
    # A prompt beyond the bucket does compile anew: the count sees compilations.
    lm.generate(model, params, [list(range(1, 40)), [4]], max_new_tokens=10)
    assert programs() == before + 1


def test_bucket_lengths():
    lengths = (1, 16, 17, 63, 65, 512, 513, 1000, 4097)
    assert [lm.bucket_length(n) for n in lengths] == [16, 16, 32, 64, 128, 512, 576, 1024, 4608]
    for n in range(1, 5000, 37):
        b = lm.bucket_length(n)
        assert n <= b <= max(16, int(n * 1.25) + 64)


# The compiled decode loop --------------------------------------------------------------


def _computations(hlo_text):
    computations, name = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            name = header.group(1)
            computations[name] = []
        elif name is not None:
            computations[name].append(line)
    return computations


def _inside_loops(computations):
    """Names of the computations a while loop's body or condition reaches."""
    pending = [
        callee
        for lines in computations.values()
        for line in lines
        if " while(" in line
        for callee in re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)
    ]
    seen = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for line in computations[name]:
            pending += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                pending += [g.strip().lstrip("%") for g in group.split(",")]
    return seen


@pytest.mark.parametrize("scan_layers,batch", [(False, 1), (True, 1), (False, 2)])
def test_decode_loop_updates_the_cache_in_place(scan_layers, batch):
    """No copy of the cache in the compiled decode loop, in either layer layout. At batch 1
    XLA writes a token with a dynamic update slice; if attention read the updated array
    it would fuse a second copy of that update into the read and copy the layer."""
    config = lm.LMConfig.tiny(max_len=256, scan_layers=scan_layers)
    abstract = nn.meta.unbox(lm.abstract_params(config))
    params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)
    model = lm.Transformer(config)
    width, cache_len = 16, 64
    lowered = decoding._generate_jit.lower(
        model,
        params,
        jnp.zeros((batch, width), jnp.int32),
        jnp.full((batch,), width, jnp.int32),
        jnp.zeros((batch,), jnp.int32),
        None,
        jax.random.key(0),
        lm.SamplingParams().as_arrays(),
        jnp.full((4,), -1, jnp.int32),
        jnp.int32(0),
        jnp.int32(8),
        None,
        None,
        buffer_len=16,
        cache_len=cache_len,
        prefill_chunk=512,
        step_hook=None,
        rules=None,
    )
    computations = _computations(lowered.compile().as_text())
    loops = _inside_loops(computations)
    assert loops, "no while loop in the compiled program"
    # The cache: one stacked array (scan), or one array per layer (loop).
    dims = (batch, config.num_kv_heads, cache_len, config.head_dim)
    if scan_layers:
        dims = (config.num_layers, *dims)
    cache_shape = f"f32[{','.join(map(str, dims))}]"
    copies = [
        line.strip()[:160]
        for name in loops
        for line in computations[name]
        if re.search(re.escape(cache_shape) + r"\S* (copy|copy-start|transpose)\(", line)
    ]
    assert not copies, copies
    # The loop does write the cache (in place, by scatter), so the shape is there.
    assert any(cache_shape in line for name in loops for line in computations[name])


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([[], [1, 2]], "prompts: every prompt needs at least one token; prompts [0] are empty"),
        ([1, 2, 3], "prompts: expected B token lists or an int [B, P] array, got a flat list"),
        ("hello", "prompts: expected B token lists or an int [B, P] array, got a string"),
        ([], "prompts: expected B token lists or an int [B, P] array, got no prompts"),
    ],
)
def test_malformed_prompts_name_the_argument(prompts, message):
    config = lm.LMConfig.tiny(max_len=32)
    model, params = lm.Transformer(config), random_params(config)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        lm.generate(model, params, prompts, max_new_tokens=2)


def test_stop_tokens_outside_the_vocabulary_are_refused():
    config = lm.LMConfig.tiny(max_len=32)
    model, params = lm.Transformer(config), random_params(config)
    for stop in ([config.vocab_size], [-1]):
        with pytest.raises(ValueError, match=r"^stop_tokens: ids must lie in \[0, vocab_size="):
            lm.generate(model, params, [[1, 2]], max_new_tokens=2, stop_tokens=stop)
    # The last id of the vocabulary is a valid stop token.
    lm.generate(model, params, [[1, 2]], max_new_tokens=2, stop_tokens=[config.vocab_size - 1])
