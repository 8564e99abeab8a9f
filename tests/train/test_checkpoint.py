import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lhc.train import Checkpointer


def _state(scale=1.0):
    return {
        "step": jnp.array(3, jnp.int32),
        "params": {"w": jnp.arange(6.0).reshape(2, 3) * scale, "b": jnp.ones((3,))},
        "rng": jax.random.key_data(jax.random.key(7)),
    }


def test_save_restore_roundtrip_with_data_state(tmp_path):
    ckpt = Checkpointer(str(tmp_path), save_interval_steps=2, max_to_keep=2)
    assert ckpt.latest_step() is None
    assert not ckpt.save(1, _state(), {"index": 1})  # not on the interval
    assert ckpt.save(2, _state(2.0), {"index": 2})
    assert ckpt.save(3, _state(3.0), {"index": 3}, force=True)
    assert ckpt.save(4, _state(4.0), {"index": 4})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]  # max_to_keep
    state, data = ckpt.restore(None, _state())
    assert data == {"index": 4}
    np.testing.assert_array_equal(state["params"]["w"], np.arange(6.0).reshape(2, 3) * 4)
    np.testing.assert_array_equal(state["rng"], _state()["rng"])
    ckpt.close()


# Orbax leaves an un-awaited read coroutine behind when the damaged step fails to load.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_missing_and_mismatched_and_corrupt(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "c"), save_interval_steps=1)
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        ckpt.restore(None, _state())
    ckpt.save(1, _state(), {"index": 1})
    ckpt.wait()
    with pytest.raises(
        FileNotFoundError, match="no checkpoint for step 5.*available steps: \\[1\\]"
    ):
        ckpt.restore(5, _state())
    wrong = _state()
    wrong["params"]["w"] = jnp.zeros((4, 3))
    with pytest.raises(ValueError, match="does not match|could not be restored"):
        ckpt.restore(1, wrong)
    # Damage every array file of the step; restoring must fail loudly, not return garbage.
    step_dir = tmp_path / "c" / "1" / "state"
    damaged = 0
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            if os.path.getsize(path) > 0 and not name.endswith(".json"):
                with open(path, "r+b") as f:
                    f.write(b"\x00garbage\xff" * 8)
                damaged += 1
    assert damaged > 0
    with pytest.raises(ValueError, match="could not be restored"):
        ckpt.restore(1, _state())
    ckpt.close()
    gc.collect()  # the coroutine's warning is raised (and ignored) here, not in a later test
