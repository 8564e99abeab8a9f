"""The acceptance of draft variants. A draft is ``kv4`` or ``kv8`` (the cache read at 4
bits, QuantSpec's draft, or at 8 bits, the target's reading), optionally
``+<rtn|gptq>-<sym|asym>-<group>[-all]`` (INT4 weights rounded to nearest or with GPTQ,
symmetric or with a minimum per group, the MLP or every linear layer; without it the
draft has the target's weights)."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc import lm, stats
from lhc.quantspec import decoding
from lhc.quantspec.gptq import calibrate
from lhc.quantspec.weights import quantize_params
from lhc.stats import markdown_table


def parse_draft(spec: str) -> dict:
    """``kv4`` / ``kv8``, optionally ``+<rtn|gptq>-<sym|asym>-<group>[-all]`` (see the
    module's docstring), as a dict; ValueError naming the spec otherwise."""
    kv, _, weights = spec.partition("+")
    parts = weights.split("-") if weights else []
    ok = kv in ("kv4", "kv8") and (
        not parts
        or (
            len(parts) in (3, 4)
            and parts[0] in ("rtn", "gptq")
            and parts[1] in ("sym", "asym")
            and parts[2].isdigit()
            and parts[3:] in ([], ["all"])
        )
    )
    if not ok:
        raise ValueError(
            f"draft {spec!r}: expected kv4 or kv8, optionally +<rtn|gptq>-<sym|asym>-<group>"
            f"[-all], e.g. kv4+gptq-sym-64"
        )
    draft = dict(name=spec, kv_bits=int(kv[2:]), method=None)
    if parts:
        draft.update(
            method=parts[0],
            symmetric=parts[1] == "sym",
            group=int(parts[2]),
            layers="all" if parts[3:] else "mlp",
        )
    return draft


def draft_weights(model, params, draft: dict, calibration) -> Any:
    """The draft's parameters for a ``parse_draft`` dict (``params`` themselves when it
    quantizes no weights; GPTQ on ``calibration`` tokens ``[n, T]``)."""
    if draft["method"] is None:
        return params
    settings = dict(group_size=draft["group"], layers=draft["layers"], symmetric=draft["symmetric"])
    if draft["method"] == "rtn":
        return quantize_params(params, **settings)
    return calibrate(model, params, calibration, **settings)


def acceptance_rows(
    model,
    params,
    prompts: dict,
    drafts,
    *,
    gammas,
    temperatures,
    new_tokens: int,
    group_size: int,
    calibration=None,
    stop_tokens=(),
    log=print,
    sampled: int = 0,
    sampled_prefix: int = 512,
    sampled_batch: int = 250,
    sampled_top: int = 64,
):
    """One row per draft, prompt length, gamma and temperature: the acceptance rate and
    tokens per round over the prompts' rows, and (greedy) whether every row's output
    equals plain decoding on the 8-bit path; ``per_prompt``: each row's accepted and
    drafted tokens and (greedy) that equality; ``cache_bytes`` / ``full_cache_bytes``:
    ``cache_memory`` of the length's prefilled cache. ``prompts``:
    ``{length: int [B, length]}``, each length prefilled once (all but the last token)
    and every decoding started from a copy of that cache. ``sampled`` > 0: each sampled
    row also holds ``sampled_check`` of that many samples of the first two tokens after
    the first prompt's first ``sampled_prefix`` tokens (the ``sampled_top`` likeliest
    first tokens apart, the rest one cell), ``sampled_batch`` rows at a time."""
    # Every draft's weights first: a grid the model's layers cannot take fails before
    # any decoding.
    weights_of = {}
    for spec in drafts:
        try:
            weights_of[spec] = draft_weights(model, params, parse_draft(spec), calibration)
        except ValueError as error:
            raise ValueError(f"draft {spec!r}: {error}") from None
    # Each length's prompts are prefilled once, all but their last token, into the
    # hierarchical cache; every decoding starts from a copy of it with the last token.
    target = decoding.quantspec_model(model, group_size=group_size)
    caches, memory, plain = {}, {}, {}
    for length, prompt in prompts.items():
        capacity = length + new_tokens + 2 * max(gammas) + 2
        caches[length] = jax.block_until_ready(
            lm.decoding.prefilled_cache(
                target,
                params,
                prompt[:, :-1],
                extra=capacity - length + 1,
                prefill_chunk=group_size,
            )
        )
        memory[length] = cache_memory(model, caches[length])
        plain[length] = decoding.generate(
            model,
            params,
            prompt[:, -1:],
            max_new_tokens=new_tokens,
            group_size=group_size,
            stop_tokens=stop_tokens,
            cache=_copy(caches[length]),
        )
    # The sampled check: on the first prompt's first ``sampled_prefix`` tokens, the exact
    # distribution of the next two tokens at each temperature.
    checked = {}
    for length, prompt in prompts.items() if sampled else ():
        prefix = np.asarray(prompt)[0, : min(length, sampled_prefix)]
        cache = lm.decoding.prefilled_cache(
            target,
            params,
            prefix[None, :-1],
            extra=2 * max(gammas) + 5,
            prefill_chunk=group_size,
        )
        for temperature in temperatures:
            if temperature > 0:
                exact = exact_two_tokens(
                    target, params, cache, int(prefix[-1]), temperature, sampled_top
                )
                checked[length, temperature] = (cache, int(prefix[-1]), exact)
    rows = []
    for spec in drafts:
        draft, weights = parse_draft(spec), weights_of[spec]
        for (length, prompt), gamma, temperature in itertools.product(
            prompts.items(), gammas, temperatures
        ):
            speculation = dict(
                gamma=gamma,
                group_size=group_size,
                draft_params=weights,
                draft_kv_bits=draft["kv_bits"],
                sampling=lm.SamplingParams(temperature=temperature),
            )
            out = decoding.speculative_generate(
                model,
                params,
                prompt[:, -1:],
                max_new_tokens=new_tokens,
                rng=jax.random.key(0) if temperature > 0 else None,
                stop_tokens=stop_tokens,
                target_cache=_copy(caches[length]),
                **speculation,
            )
            lengths = np.asarray(out.lengths)
            check = None
            if (length, temperature) in checked:
                cache, last, exact = checked[length, temperature]
                check = sampled_check(
                    model,
                    params,
                    cache,
                    last,
                    exact,
                    samples=sampled,
                    batch=sampled_batch,
                    seed=gamma,
                    **speculation,
                )
                check["prefix"] = min(length, sampled_prefix)
            same, same_rows = None, None
            if temperature == 0:
                want = plain[length]
                same_rows = [
                    bool(n == m)
                    and np.array_equal(
                        np.asarray(out.tokens)[b, :n], np.asarray(want.tokens)[b, :n]
                    )
                    for b, (n, m) in enumerate(zip(lengths, np.asarray(want.lengths)))
                ]
                same = all(same_rows)
            rows.append(
                dict(
                    draft=spec,
                    prompt=length,
                    gamma=gamma,
                    temperature=temperature,
                    acceptance=float(out.acceptance_rate),
                    tokens_per_round=float(lengths.mean()) / max(int(out.num_iterations), 1),
                    new_tokens=int(lengths.sum()),
                    same_as_8bit=same,
                    **memory[length],
                    sampled=check,
                    # Each prompt (row) alone, for intervals over prompts.
                    per_prompt=dict(
                        accepted=np.asarray(out.accepted).tolist(),
                        drafted=np.asarray(out.drafted).tolist(),
                        same_as_8bit=same_rows,
                    ),
                )
            )
            log(
                f"{spec}: prompt {length}, gamma {gamma}, T {temperature}: acceptance {rows[-1]['acceptance']:.3f}"
            )
    return rows


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, tokens, positions, cache):
    return model.apply({"params": params}, tokens, positions, cache)[0].astype(jnp.float32)


def exact_two_tokens(target, params, cache, last: int, temperature: float, top: int):
    """The target path's distribution of the next two tokens at ``temperature``, after
    ``cache`` (one sequence) and then ``last``: the ``top`` most likely first tokens, the
    exact probability of each pair with them ``[top, V]`` (float64), and the first
    tokens' total mass (the rest of the first tokens is one remaining cell)."""
    position = jnp.asarray(cache.next_positions())[:, None]
    logits = _logits(target, params, jnp.full((1, 1), last, jnp.int32), position, cache)
    first = np.asarray(jax.nn.softmax(logits[0, -1] / temperature), np.float64)
    first /= first.sum()
    ids = np.argsort(-first)[:top]
    tokens = np.stack([np.full(top, last), ids], axis=1).astype(np.int32)
    positions = jnp.broadcast_to(position + jnp.arange(2), (top, 2))
    logits = _logits(target, params, jnp.asarray(tokens), positions, lm.repeat_rows(cache, top))
    second = np.asarray(jax.nn.softmax(logits[:, 1] / temperature), np.float64)
    second /= second.sum(axis=1, keepdims=True)
    return ids, first[ids, None] * second, float(first[ids].sum())


def sampled_check(model, params, cache, last, exact, *, samples, batch, seed, **speculation):
    """Pearson's chi-square test (``lhc.stats.chi_square_fit``) of ``samples`` first two
    tokens of speculative sampling after ``cache`` and ``last`` (``batch`` rows at a
    time, each from a copy of the cache) against ``exact`` (``exact_two_tokens``);
    ``speculation``: ``decoding.speculative_generate``'s settings."""
    ids, joint, mass = exact
    cell_of = {int(t): i for i, t in enumerate(ids)}
    vocab = joint.shape[1]
    counts = np.zeros(joint.size + 1)
    accepted = drafted = 0
    for start in range(0, samples, batch):
        rows = min(batch, samples - start)
        out = decoding.speculative_generate(
            model,
            params,
            np.full((rows, 1), last, np.int32),
            max_new_tokens=2,
            target_cache=lm.repeat_rows(cache, rows),
            rng=jax.random.key(seed * 100_003 + start),
            **speculation,
        )
        accepted += int(np.sum(out.accepted))
        drafted += int(np.sum(out.drafted))
        for first, second in np.asarray(out.tokens)[:, :2].tolist():
            cell = cell_of.get(first)
            counts[-1 if cell is None else cell * vocab + second] += 1
    expected = np.append(joint.reshape(-1), max(0.0, 1.0 - mass))
    test = stats.chi_square_fit(counts, expected)
    return dict(
        samples=samples,
        p_value=test["p_value"],
        cells=test["cells"],
        top_mass=round(mass, 6),
        acceptance=accepted / max(drafted, 1),
    )


def _copy(cache):
    return jax.tree.map(jnp.copy, cache)


def cache_memory(model, cache) -> dict[str, int]:
    """The slots and bytes of a prefilled hierarchical ``cache`` (every array: the 4-bit upper and
    lower halves, scales, minima, the full-precision ring and the bookkeeping) and of a
    full-precision cache of ``model`` with the same batch and capacity, in the model's
    dtype."""
    full = jax.eval_shape(lambda: model.init_cache(cache.lengths.shape[0], cache.capacity))
    size = lambda tree: sum(  # noqa: E731
        math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
    )
    return dict(
        cache_slots=int(cache.capacity),
        cache_bytes=int(size(cache)),
        full_cache_bytes=int(size(full)),
    )


def acceptance_table(rows) -> str:
    columns = [
        ("draft", "draft"), ("prompt", "prompt"), ("gamma", "gamma"),
        ("temperature", "temperature", "g"), ("acceptance", "acceptance", ".3f"),
        ("tokens / round", "tokens_per_round", ".2f"), ("new tokens", "new_tokens"),
        ("greedy output = 8-bit decoding", "same_as_8bit"),
    ]  # fmt: skip
    return markdown_table(columns, rows)
