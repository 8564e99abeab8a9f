"""The model sections of the accelerator run: greedy decoding against the memory
roofline, QuantSpec self-speculation at long context, and TabICL against its reference.

Decoding starts from caches filled with random keys and values (the state a prefill
leaves), so that a 128K-token context costs no prefill and no extra compilation; the
weights are random too. Speeds do not depend on the values; the acceptance rate of a
random model is not the paper's, so the QuantSpec rows also give the speedup that this
run's round and step times give at the paper's acceptance.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from harness import Section, timed

from lhc import lm, quantspec
from lhc.quantspec.traffic import predicted_speedup, size_of_config

# The paper's acceptance rates (Llama-2-7B-32K at 32K, LWM-128K at 128K tokens).
PAPER_ACCEPTANCE = {32768: 0.9116, 131072: 0.9431}
SMOKE_CONFIG = dict(vocab_size=512, num_layers=2, embed_dim=128, num_heads=4, num_kv_heads=2,
                    head_dim=32, mlp_dim=256)  # fmt: skip


def lm_config(name: str, smoke: bool, max_len: int, **overrides) -> lm.LMConfig:
    """The preset ``name`` in bf16 (a two-layer model in --smoke)."""
    settings = dict(dtype="bfloat16", param_dtype="bfloat16", max_len=max_len, **overrides)
    if smoke:
        return lm.LMConfig(**SMOKE_CONFIG, **settings)
    return lm.get_preset(name, **settings)


def random_context(config, batch: int, length: int, layer):
    """Random keys and values ``[B, K, length, H]`` of one layer."""
    rng = jax.random.fold_in(jax.random.key(12345), layer)
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    return tuple(jax.random.normal(key, shape, config.dtype) for key in jax.random.split(rng, 2))


def filled_kv_cache(config, batch: int, length: int, capacity: int) -> lm.KVCache:
    """An ``lhc.lm.KVCache`` of ``capacity`` slots holding ``length`` tokens of random
    keys and values at positions ``0 .. length - 1``, as a prefill leaves it."""
    cache = lm.init_cache(config, batch, capacity)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def fill(keys, values, layer):
        k, v = random_context(config, batch, length, layer)
        return keys.at[:, :, :length].set(k), values.at[:, :, :length].set(v)

    layers = [fill(k, v, i) for i, (k, v) in enumerate(zip(cache.keys, cache.values))]
    slots = jnp.arange(capacity, dtype=jnp.int32)
    return cache.replace(
        keys=tuple(k for k, _ in layers), values=tuple(v for _, v in layers),
        positions=jnp.broadcast_to(jnp.where(slots < length, slots, -1), (batch, capacity)),
        lengths=jnp.full((batch,), length, jnp.int32),
    )  # fmt: skip


def filled_quantspec_cache(model, config, batch: int, length: int, capacity: int):
    """A ``QuantSpecCache`` of ``model`` (a ``QuantSpecLM``) in the state a prefill of
    ``length`` tokens (a multiple of G, at least 2G) leaves: every group but the last
    two quantized, the ring holding the last ``2G + max_call - 1`` tokens at full
    precision; the keys and values of ``filled_kv_cache``."""
    g = model.group_size
    if length % g or length < 2 * g:
        raise ValueError(f"length must be a multiple of G = {g} and at least 2G, got {length}")
    cache = model.init_cache(batch, capacity)
    ring = cache.ring_size
    held = jnp.arange(max(0, length - ring), length)  # the slots the ring holds

    @functools.partial(jax.jit, donate_argnums=(0,))
    def fill(store, layer):
        k, v = random_context(config, batch, length, layer)
        qk = quantspec.quantize(k, group_axis=2, group_size=g)
        qv = quantspec.quantize(v, group_axis=3, group_size=g)
        parts = dict(
            k_upper=qk.upper,
            k_lower=qk.lower,
            k_scale=qk.scale,
            k_min=qk.minimum,
            v_upper=qv.upper,
            v_lower=qv.lower,
            v_scale=qv.scale,
            v_min=qv.minimum,
        )  # each [B, K, slots or groups, ...] from slot 0
        store = dict(store)
        for name, part in parts.items():
            store[name] = (
                store[name].at[layer].set(store[name][layer].at[:, :, : part.shape[2]].set(part))
            )
        for name, part in (("ring_k", k), ("ring_v", v)):
            written = store[name][layer].at[:, :, held % ring].set(part[:, :, held])
            store[name] = store[name].at[layer].set(written)
        return store

    # init_cache shares one zero array among the code planes: donate distinct ones.
    store = {name: jnp.zeros_like(x) for name, x in cache.store.items()}
    for layer in range(config.num_layers):
        store = fill(store, layer)
    slots = jnp.arange(cache.capacity, dtype=jnp.int32)
    return cache.replace(
        store=store,
        positions=jnp.broadcast_to(jnp.where(slots < length, slots, -1), (batch, cache.capacity)),
        lengths=jnp.full((batch,), length, jnp.int32),
        quantized=jnp.full((batch,), length - 2 * g, jnp.int32),
    )


def weight_bytes_per_step(config, params, batch: int) -> int:
    """Bytes of parameters one decode step reads: all of them, except that an untied
    input embedding contributes only the ``batch`` rows looked up."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if not config.tie_embeddings:
        table = params["embed"]["embedding"]
        total -= table.nbytes - batch * (table.nbytes // table.shape[0])
    return total


def _generate_on(model, params, cache, context: int, new_tokens: int, generate=lm.generate):
    """A timeable call: ``new_tokens`` greedy tokens after a one-token prompt on
    ``cache``, which ``generate`` donates; the returned cache, cut back to the context,
    serves the next call."""
    batch = cache.lengths.shape[0]
    holder = {"cache": cache}
    prompt = np.ones((batch, 1), np.int32)

    def run():
        out = generate(model, params, prompt, max_new_tokens=new_tokens, cache=holder["cache"])
        holder["cache"] = out.cache.truncate(np.full((batch,), context, np.int32))
        return out

    return run


# --------------------------------------------------------------------------------------
# Decoding against the memory roofline.
# --------------------------------------------------------------------------------------


def _decode(s: Section, config, params, batch: int, context: int, new_tokens: int) -> dict:
    capacity = config.max_len
    cache = filled_kv_cache(config, batch, context, capacity)
    run = _generate_on(lm.Transformer(config), params, cache, context, new_tokens)
    timing, _ = timed(run, smoke=s.smoke, target_s=0.0, repeats=3)
    # The call's one-token prompt is one more model call: N + 1 calls, N tokens.
    step_s = timing["ms"] / 1e3 / (new_tokens + 1)
    # Attention reads every slot of the cache (empty ones masked).
    kv_bytes = 2 * config.num_layers * batch * config.num_kv_heads * capacity * config.head_dim * 2
    step_bytes = weight_bytes_per_step(config, params, batch) + kv_bytes
    gbps = step_bytes / step_s / 1e9
    return dict(
        params=lm.count_params(config), step_ms=1e3 * step_s, tokens_per_s=batch / step_s,
        gb_per_step=step_bytes / 1e9, gbps=gbps, copy_fraction=s.fraction(gbps, "copy_gbps"),
        first_call_s=timing["first_call_s"],
    )  # fmt: skip


def section_decode(s: Section) -> None:
    names = ("tiny",) if s.smoke else ("llama3.2-1b", "llama3.1-8b")
    batches = (1, 2) if s.smoke else (1, 8)
    context, new_tokens = (32, 8) if s.smoke else (512, 128)
    for name in names:
        if s.time_left() <= 0:
            s.emit("decode", config=name, skipped="time budget spent")
            continue
        config = lm_config(name, s.smoke, max_len=context + new_tokens + 16)
        params = lm.init_params(config, jax.random.key(0))
        for batch in batches:
            label = dict(config=name, batch=batch, context=context, new_tokens=new_tokens)
            s.run("decode", label,
                  functools.partial(_decode, s, config, params, batch, context, new_tokens))  # fmt: skip
        del params


# --------------------------------------------------------------------------------------
# QuantSpec at long context.
# --------------------------------------------------------------------------------------


class _QuantSpecRun:
    """The paths compared at one context length: plain decoding with a bf16 cache,
    plain decoding with the 8-bit QuantSpec cache, and self-speculation."""

    def __init__(self, s: Section, config, params, context: int, gamma: int, new_tokens: int):
        self.s, self.config, self.params = s, config, params
        self.context, self.gamma, self.new_tokens = context, gamma, new_tokens
        self.capacity = context + new_tokens + gamma + 2  # a round may run gamma + 1 past N
        self.group = config.head_dim  # the Pallas store kernel reads whole-head groups
        # The QuantSpec paths run the Pallas kernels over the store and the buffer (the
        # XLA path where they would be interpreted: tests/quantspec checks the two agree).
        impl = "xla" if s.interpret else "pallas"
        self.quant_model = lm.Transformer(config.replace(attention_impl=impl))
        self.times, self.outputs = {}, {}
        self._cache = None

    def quantspec_cache(self):
        if self._cache is None:
            target = quantspec.quantspec_model(self.quant_model, group_size=self.group)
            self._cache = filled_quantspec_cache(
                target, self.config, 1, self.context, self.capacity
            )
        return self._cache

    def _per_token(self, key, timing, out) -> float:
        # N + 1 model calls for N tokens (the one-token prompt), as in the decode section.
        self.times[key], self.outputs[key] = timing["ms"] / self.new_tokens, out
        return self.times[key]

    def plain(self) -> dict:
        cache = filled_kv_cache(self.config, 1, self.context, self.capacity)
        run = _generate_on(lm.Transformer(self.config), self.params, cache, self.context,
                           self.new_tokens)  # fmt: skip
        timing, out = timed(run, smoke=self.s.smoke, target_s=0.0, repeats=3)
        return dict(ms_per_token=self._per_token("fp", timing, out),
                    first_call_s=timing["first_call_s"])  # fmt: skip

    def int8(self) -> dict:
        cache = self.quantspec_cache()

        def run():  # generate donates its cache: a fresh copy each call
            return quantspec.generate(
                self.quant_model, self.params, np.ones((1, 1), np.int32),
                max_new_tokens=self.new_tokens, group_size=self.group,
                cache=jax.tree.map(jnp.copy, cache),
            )  # fmt: skip

        timing, out = timed(run, smoke=self.s.smoke, target_s=0.0, repeats=3)
        row = dict(ms_per_token=self._per_token("int8", timing, out),
                   first_call_s=timing["first_call_s"])  # fmt: skip
        plain_tokens = np.asarray(out.tokens)[:, : self.new_tokens]
        for key in ("spec_bf16", "spec_int4"):
            if key in self.outputs:
                spec = np.asarray(self.outputs[key].tokens)[:, : self.new_tokens]
                row[f"{key}_equal"] = bool(np.array_equal(spec, plain_tokens))
        return row

    def speculative(self, weights: str, draft) -> dict:
        """``weights``: what the draft's weights are, ``"int4"`` (the MLP in 4 bits, as
        QuantSpec's code) or ``"bf16"`` (the target's: the 4-bit KV cache alone)."""
        cache = self.quantspec_cache()

        def run():
            return quantspec.speculative_generate(
                self.quant_model, self.params, np.ones((1, 1), np.int32), gamma=self.gamma,
                max_new_tokens=self.new_tokens, group_size=self.group, draft_params=draft,
                target_cache=cache,
            )  # fmt: skip

        timing, out = timed(run, smoke=self.s.smoke, target_s=0.0, repeats=3)
        key = f"spec_{weights}"
        rounds = max(int(out.num_iterations), 1)
        row = dict(
            ms_per_token=self._per_token(key, timing, out), first_call_s=timing["first_call_s"],
            acceptance=float(out.acceptance_rate), rounds=rounds, round_ms=timing["ms"] / rounds,
            tokens_per_round=float(np.asarray(out.lengths).mean()) / rounds,
        )  # fmt: skip
        if "fp" in self.times:
            row["speedup_vs_fp"] = self.times["fp"] / self.times[key]
            acceptance = PAPER_ACCEPTANCE.get(self.context)
            if acceptance is not None:
                # The paper's tokens per round, gamma a + 1, at its acceptance, over this
                # run's round time against its plain decoding step.
                tokens = self.gamma * acceptance + 1
                row["speedup_at_paper_acceptance"] = tokens * self.times["fp"] / row["round_ms"]
                row["traffic_model_at_paper_acceptance"] = predicted_speedup(
                    size_of_config(self.config), self.context, gamma=self.gamma,
                    acceptance=acceptance, group_size=self.group, weights="mlp",
                )  # fmt: skip
        return row


def section_quantspec(s: Section) -> None:
    name = "tiny" if s.smoke else "llama3.1-8b"
    contexts = (128,) if s.smoke else (131072, 32768)
    gamma, new_tokens = (3, 6) if s.smoke else (6, 90)  # the paper: gamma 6, 90 tokens
    config = lm_config(name, s.smoke, max_len=max(contexts) + new_tokens + gamma + 256)
    params = lm.init_params(config, jax.random.key(0))
    drafts = {
        "bf16": params,
        "int4": quantspec.quantize_params(params, group_size=min(128, config.embed_dim)),
    }
    runs = {context: _QuantSpecRun(s, config, params, context, gamma, new_tokens)
            for context in contexts}  # fmt: skip
    paths = {
        "plain": ("plain, bf16 cache", lambda run: run.plain),
        "int4": ("speculative, 4-bit KV, 4-bit MLP",
                 lambda run: functools.partial(run.speculative, "int4", drafts["int4"])),
        "bf16": ("speculative, 4-bit KV, bf16 weights",
                 lambda run: functools.partial(run.speculative, "bf16", drafts["bf16"])),
        "int8": ("plain, 8-bit QuantSpec cache", lambda run: run.int8),
    }  # fmt: skip
    # The comparison as shipped at every length first, then the variants.
    order = [(c, p) for p in ("plain", "int4") for c in contexts]
    order += [(c, p) for c in contexts for p in ("bf16", "int8")]
    for context, path in order:
        title, measure = paths[path]
        label = dict(config=name, context=context, gamma=gamma, new_tokens=new_tokens, path=title)
        s.run("quantspec", label, measure(runs[context]))


# --------------------------------------------------------------------------------------
# TabICL against tabicl 0.1.4.
# --------------------------------------------------------------------------------------


def tabicl_worker(impl: str, model: str, rows: int, members: int, test_rows: int, device: str,
                  proba_path: str) -> dict:  # fmt: skip
    """One fit and two ``predict_proba`` calls (the second timed) in this fresh process."""
    from lhc.tabicl.bench import make_data

    x_train, y_train, x_test, y_test = make_data(rows, test_rows, 20, 5, 0)
    on_gpu = device == "gpu"
    if impl == "reference":
        import torch
        from tabicl import TabICLClassifier

        clf = TabICLClassifier(n_estimators=members, model_path=model, allow_auto_download=False,
                               device="cuda" if on_gpu else "cpu", use_amp=on_gpu)  # fmt: skip
    else:
        from lhc.tabicl import TabICLClassifier

        clf = TabICLClassifier(n_estimators=members, model_path=model, use_amp=on_gpu)
    clf.fit(x_train, y_train)
    start = time.perf_counter()
    clf.predict_proba(x_test)
    first = time.perf_counter() - start
    start = time.perf_counter()
    proba = clf.predict_proba(x_test)
    seconds = time.perf_counter() - start
    np.save(proba_path, proba)
    peak = None  # allocator peaks: torch's, and XLA's over the whole process
    if on_gpu and impl == "reference":
        peak = torch.cuda.max_memory_allocated()
    elif on_gpu:
        peak = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    return dict(
        predict_s=seconds, first_predict_s=first, device_peak_bytes=peak, host_peak_bytes=rss,
        accuracy=float(np.mean(np.argmax(proba, 1) == y_test)),
    )  # fmt: skip


def _tabicl_measure(s: Section, impl: str, model: Path, rows: int, members: int,
                    test_rows: int, proba: Path) -> dict:  # fmt: skip
    command = [
        sys.executable, str(Path(__file__).with_name("accelerator.py")), "--tabicl-worker",
        json.dumps(dict(impl=impl, model=str(model), rows=rows, members=members,
                        test_rows=test_rows, device=s.platform, proba_path=str(proba))),
    ]  # fmt: skip
    # The measured process takes the device's memory as it needs it, so the peak
    # counts; this process (which converted the checkpoint) holds almost none.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=max(s.time_left(), 1) + 10)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def section_tabicl(s: Section) -> None:
    from lhc.tabicl.bench import save_random_models

    # One member at both sizes first, then eight.
    pairs = [(200, 2)] if s.smoke else [(10_000, 1), (50_000, 1), (10_000, 8), (50_000, 8)]
    test_rows = 50 if s.smoke else 1000
    with tempfile.TemporaryDirectory(prefix="lhc-accelerator-tabicl-") as tmp:
        tmp = Path(tmp)
        saved = s.run("tabicl_models", {}, lambda: dict(
            zip(("reference", "lhc"), map(str, save_random_models(tmp, tiny=s.smoke, seed=0)))
        ))  # fmt: skip
        if saved is None:
            return
        for rows, members in pairs:
            for impl in ("reference", "lhc"):
                proba = tmp / f"{impl}_{rows}_{members}.npy"
                measure = functools.partial(_tabicl_measure, s, impl, Path(saved[impl]), rows,
                                            members, test_rows, proba)  # fmt: skip
                s.run("tabicl", dict(rows=rows, members=members, impl=impl), measure)
            _tabicl_ratio(s, tmp, rows, members)


def _tabicl_ratio(s: Section, tmp: Path, rows: int, members: int) -> None:
    """reference / lhc, from the rows just emitted and the saved probabilities."""
    from harness import read_rows

    measured = {
        row["impl"]: row for row in read_rows(s.out)
        if row.get("table") == "tabicl" and row.get("rows") == rows
        and row.get("members") == members and "predict_s" in row
    }  # fmt: skip
    if set(measured) != {"reference", "lhc"}:
        return
    ref, ours = measured["reference"], measured["lhc"]
    p_ref, p_ours = (np.load(tmp / f"{impl}_{rows}_{members}.npy") for impl in ("reference", "lhc"))
    ratio = dict(time_ratio=ref["predict_s"] / ours["predict_s"],
                 max_abs_proba_diff=float(np.abs(p_ref - p_ours).max()))  # fmt: skip
    if ref["device_peak_bytes"] and ours["device_peak_bytes"]:
        ratio["memory_ratio"] = ref["device_peak_bytes"] / ours["device_peak_bytes"]
    s.emit("tabicl_ratio", rows=rows, members=members, **ratio)
