"""configs/recurrent_passkey.py through the trainer: a few steps of the passkey task on
each recurrent LM (built by its model factory), then the passkey evaluation past the
training length, through the state cache; training from noise initial states."""

import json
import runpy
import shutil

import flax.linen as nn
import jax
import numpy as np
import pytest

from lhc import stats
from lhc.nn.config import build_model
from lhc.recurrent import Mamba2LM
from lhc.recurrent.task import fitted_states, noise_states
from lhc.train import build_experiment, train_and_evaluate
from lhc.train import config as config_lib


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mamba2", "gla"])
def test_passkey_config_trains_and_evaluates(tmp_path, model):
    config = config_lib.load_config(
        f"configs/recurrent_passkey.py:tiny,model={model},runlocal",
        [
            "num_steps=2",
            "batch_size=2",
            "data.length=128",
            "progress_bar=False",
            "eval_batches=1",
            "tensorboard=False",
            "model.num_layers=1",
            "passkey_eval.lengths=(160,)",
            "passkey_eval.depths=(0.5,)",
            "passkey_eval.samples=2",
            "passkey_eval.batch_size=2",
            "passkey_eval.prefill_chunk=64",
        ],
    )
    summary = train_and_evaluate(config, str(tmp_path / "run"))
    assert 0 <= summary["eval/accuracy"] <= 1
    assert 0 <= summary["passkey/accuracy/160/0.5"] <= 1


@pytest.mark.slow
def test_a_zero_state_run_resumes_with_each_intervention(tmp_path):
    """Post-training as the experiment does it: the zero-state run's workdir resumed with
    another kind, its carry (final states and moments) restored from the checkpoint."""
    common = [
        "batch_size=2",
        "data.length=112",
        "progress_bar=False",
        "eval_batches=1",
        "tensorboard=False",
        "model.num_layers=1",
        "log_every=1",
    ]
    for steps, init in enumerate(["zero", "fitted", "passing", "tbtt"], start=2):
        config = config_lib.load_config(
            f"configs/recurrent_passkey.py:tiny,init={init},chunks=2,runlocal",
            [*common, f"num_steps={steps}"],
        )
        summary = train_and_evaluate(config, str(tmp_path / "run"))
        assert summary["step"] == steps and np.isfinite(summary["train/loss"])
        assert summary["train/final_ssm_rms"] > 0


def test_an_unknown_model_field_is_a_clear_error():
    with pytest.raises(ValueError, match=r"config.model: unknown Mamba2Config keys: 'heads'"):
        build_model(Mamba2LM, {"vocab_size": 8, "heads": 2})


def _task(init, *overrides):
    config = config_lib.load_config(
        f"configs/recurrent_passkey.py:tiny,model=mamba2,init={init},runlocal",
        [
            "batch_size=2",
            "data.length=112",
            "model.num_layers=1",
            "model.chunk_size=16",
            *overrides,
        ],
    )
    return build_experiment(config).task


@pytest.fixture(scope="module")
def zero_task():
    task = _task("zero")
    return task, task.init_params(jax.random.key(1))


def _forward(task, params, tokens, states=None):
    """Logits and final states of the model over ``tokens`` [B, T] from ``states``."""
    cache = task.model.init_cache(tokens.shape[0], rollback=0)
    if states is not None:
        cache = cache.replace(states={k: v[:, :, None] for k, v in states.items()})
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    logits, cache = task.model.apply({"params": params}, tokens, positions, cache)
    return logits, {k: v[:, :, 0] for k, v in cache.states.items()}


def _close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5), a, b)


def test_noise_initial_state(zero_task):
    _, params = zero_task
    cache = noise_states(_task("noise").model.init_cache(64, rollback=0), jax.random.key(0), 0.5)
    ssm = np.asarray(cache.states["ssm"])
    assert abs(ssm.std() - 0.5) < 0.01 and abs(ssm.mean()) < 0.01
    assert not np.asarray(cache.states["conv"]).any()  # the convolution state stays zero
    losses = {}
    for std in (0.0, 0.5):
        task = _task("noise", f"initial_state.std={std}")
        batch = next(task.train_iterator(0, 1))
        carry = nn.unbox(task.init_carry(2))
        losses[std], (_, after) = task.carried_loss(params, batch, jax.random.key(2), carry)
    plain, _ = task.loss(params, batch, None)  # the zero state
    np.testing.assert_allclose(losses[0.0], plain, rtol=1e-5)
    assert abs(float(losses[0.5]) - float(plain)) > 1e-4
    _close(after["moments"], carry["moments"])  # noise steps record no moments


def test_state_passing_continues_from_the_previous_batch(zero_task):
    _, params = zero_task
    task = _task("passing")
    batches = task.train_iterator(0, 1)
    first, second = next(batches), next(batches)
    carry = nn.unbox(task.init_carry(2))
    _, (_, carry) = task.carried_loss(params, first, jax.random.key(0), carry)
    loss, (_, carry) = task.carried_loss(params, second, jax.random.key(1), carry)
    # Directly: one forward pass over both batches' rows end to end.
    joined = np.concatenate([first["tokens"], second["tokens"]], axis=1)
    logits, final = _forward(task, params, joined)
    want, _ = task.loss_from_logits(logits[:, first["tokens"].shape[1] :], second)
    np.testing.assert_allclose(loss, want, rtol=2e-5)
    _close(carry["states"], final)  # every state, the convolution's too


def test_tbtt_carries_the_state_through_a_document_and_resets_at_the_next(zero_task):
    _, params = zero_task
    task = _task("tbtt", "initial_state.chunks=3")
    batches = task.train_iterator(0, 1)
    chunks = [next(batches) for _ in range(4)]  # one document of 3 chunks, then the next
    assert [bool(c["reset"].all()) for c in chunks] == [True, False, False, True]
    document = {
        k: np.concatenate([c[k] for c in chunks[:3]], axis=1) for k in chunks[0] if k != "reset"
    }
    assert document["weights"][:, -5:].all() and not document["weights"][:, :-5].any()
    logits, final = _forward(task, params, document["tokens"])
    carry = nn.unbox(task.init_carry(2))
    carry["states"] = jax.tree.map(lambda s: s + 1.0, carry["states"])  # chunk 0 resets it
    for i, chunk in enumerate(chunks[:3]):
        loss, (_, carry) = task.carried_loss(params, chunk, jax.random.key(i), carry)
        part = slice(112 * i, 112 * (i + 1))
        want, _ = task.loss_from_logits(
            logits[:, part], {k: v[:, part] for k, v in document.items()}
        )
        np.testing.assert_allclose(loss, want, rtol=2e-5)
    _close(carry["states"], final)
    loss, _ = task.carried_loss(params, chunks[3], jax.random.key(3), carry)
    fresh, _ = task.loss_from_logits(_forward(task, params, chunks[3]["tokens"])[0], chunks[3])
    np.testing.assert_allclose(loss, fresh, rtol=2e-5)


def test_zero_steps_record_moments_that_fitted_noise_draws_from(zero_task):
    task, params = zero_task
    batch = next(task.train_iterator(0, 1))
    carry = nn.unbox(task.init_carry(2))
    _, (_, carry) = task.carried_loss(params, batch, jax.random.key(0), carry)
    _, final = _forward(task, params, batch["tokens"])
    ssm = np.asarray(final["ssm"], np.float64)  # [L, B, H, P, N]
    moments = carry["moments"]
    np.testing.assert_allclose(moments["weight"], 0.01, rtol=1e-6)  # 1 - fit_decay
    np.testing.assert_allclose(
        moments["ssm"]["mean"] / 0.01, ssm.mean(axis=(1, 3, 4)), rtol=1e-4, atol=1e-7
    )
    np.testing.assert_allclose(
        moments["ssm"]["square"] / 0.01, (ssm**2).mean(axis=(1, 3, 4)), rtol=1e-4, atol=1e-9
    )
    # Fitted states from given moments: mean and std per layer and head.
    mean, std = np.array([[0.5, -1.0]]), np.array([[2.0, 0.1]])
    given = {"weight": 0.5, "ssm": {"mean": 0.5 * mean, "square": 0.5 * (std**2 + mean**2)}}
    draws = {"ssm": jax.random.normal(jax.random.key(0), (1, 400, 2, 16, 16))}
    drawn = np.asarray(fitted_states(given, draws)["ssm"])
    np.testing.assert_allclose(drawn.mean(axis=(1, 3, 4)), mean, atol=0.02)
    np.testing.assert_allclose(drawn.std(axis=(1, 3, 4)), std, rtol=0.02)
    fitted = _task("fitted")
    with pytest.raises(Exception, match="kind='fitted' draws from the final-state moments"):
        jax.jit(fitted.carried_loss)(
            params, batch, jax.random.key(0), nn.unbox(fitted.init_carry(2))
        )[0].block_until_ready()


def test_bad_initial_state_settings():
    with pytest.raises(ValueError, match="config.initial_state.kind must be one of"):
        _task("warm")
    with pytest.raises(ValueError, match="config.initial_state.chunks must be a positive int"):
        _task("tbtt", "initial_state.chunks=0")


@pytest.mark.slow
def test_curves_resume_from_the_results_file(tmp_path, capsys):
    """experiments/recurrent/curves.py appends each run's record as it is measured and
    reads back, instead of measuring again, a run whose record has the same step and
    settings; other settings are measured anew."""
    config = config_lib.load_config(
        "configs/recurrent_passkey.py:tiny,runlocal",
        ["num_steps=1", "batch_size=2", "data.length=112", "progress_bar=False",
         "eval_batches=1", "tensorboard=False", "model.num_layers=1"],
    )  # fmt: skip
    train_and_evaluate(config, str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    main = runpy.run_path("experiments/recurrent/curves.py")["main"]
    results = tmp_path / "rows.jsonl"

    def curves(*workdirs, samples=2):
        out = tmp_path / f"out{len(stats.read_records(results))}"
        main([
            "--workdirs", *[str(tmp_path / w) for w in workdirs], "--length", "160",
            "--sequences", "1", "--effrem-length", "16", "--passkey-lengths", "128",
            "--samples", str(samples), "--results", str(results), "--out", str(out),
        ])  # fmt: skip
        with open(out / "results.json") as handle:
            return json.load(handle), capsys.readouterr().out

    first, _ = curves("a")
    assert [r["run"] for r in stats.read_records(results)] == ["a"]
    again, printed = curves("a", "b")
    assert "a: step 1, read from" in printed and "b: step 1, read from" not in printed
    assert [r["run"] for r in stats.read_records(results)] == ["a", "b"]
    for key in ("perplexity", "effrem", "passkey"):
        np.testing.assert_allclose(again[key]["a"], first[key]["a"])
        # b holds the same weights, measured rather than read back.
        np.testing.assert_allclose(again[key]["b"], first[key]["a"], rtol=1e-5)
    _, printed = curves("a", samples=3)
    assert "read from" not in printed
    assert [len(c) for c in stats.read_records(results)[-1]["passkey_hits"][0]] == [3] * 5
