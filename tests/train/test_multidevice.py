"""Sharded training equals single-device training: 8 host devices, and 2 processes."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(__file__), "multidevice_worker.py")

pytestmark = pytest.mark.multidevice


def _env(**extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # a device count of the parent's dropped; its other flags (tests/conftest.py) kept
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    env.update(extra)
    return env


def _results(stdout: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULTS "):
            return json.loads(line[len("RESULTS ") :])
    raise AssertionError(f"worker printed no results:\n{stdout[-3000:]}")


def _run(args, env, timeout=600):
    proc = subprocess.run(
        [sys.executable, WORKER, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return _results(proc.stdout)


def test_eight_devices_match_one(tmp_path):
    results = _run(["meshes", str(tmp_path)], _env())
    single = results["single"]
    assert len(single["losses"]) == 3
    for name in ("data2_fsdp4", "data2_tensor4"):
        np.testing.assert_allclose(results[name]["losses"], single["losses"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(results[name]["params"], single["params"], rtol=1e-4, atol=1e-6)
    # the runs really trained: parameters moved and differ from a fresh init's losses
    assert single["losses"][0] != single["losses"][-1]
    # The sequence axis (ring attention over zig-zag-ordered tokens) trains as one device.
    copy, split = results["copy_single"], results["copy_fsdp2_sequence4"]
    assert split["layouts"]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "sequence": 4}
    np.testing.assert_allclose(split["losses"], copy["losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(split["params"], copy["params"], rtol=1e-4, atol=1e-6)
    assert copy["losses"][0] != copy["losses"][-1]
    # A checkpoint saved on one device (step 3 of 5) continues on the sequence mesh as
    # the one-device run went on.
    resumed = results["copy_resumed_fsdp2_sequence4"]
    assert resumed["resumed"] == [3] and copy["resumed"] == []
    assert len(copy["losses"]) == 5 and resumed["losses"][:3] == copy["losses"][:3]
    np.testing.assert_allclose(resumed["losses"], copy["losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(resumed["params"], copy["params"], rtol=1e-4, atol=1e-6)
    assert resumed["layouts"]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "sequence": 4}
    for name in ("data2_fsdp4", "data2_tensor4"):
        _check_sharded_as_the_rules_say(results[name]["layouts"])


def _check_sharded_as_the_rules_say(layouts):
    """Every parameter and optimizer-state leaf's shard on a device is its global shape
    divided along each logical axis by the sizes of the mesh axes its rule names."""
    mesh, rules = layouts["mesh"], dict((name, target) for name, target in layouts["rules"])
    split = {"params": 0, "opt_state": 0}
    for key, leaf in layouts["leaves"].items():
        expected = list(leaf["shape"])
        for dim, name in enumerate(leaf["names"] or ()):
            target = rules.get(name)
            axes = [target] if isinstance(target, str) else list(target or ())
            expected[dim] //= int(np.prod([mesh[a] for a in axes]))
        assert leaf["shard"] == expected, (key, leaf)
        if leaf["shard"] != leaf["shape"]:
            split[key.split("'")[1]] += 1
    # Not a replicated run: the mesh axis of size 4 splits parameters and Adam's moments.
    assert split["params"] >= 3 and split["opt_state"] >= 6, split


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    one = _run(["single", str(tmp_path / "one")], _env())
    single = one["single"]
    port = _free_port()
    procs, logs = [], []
    for process_id in range(2):
        env = _env(
            LHC_DISTRIBUTED="1",
            LHC_COORDINATOR=f"127.0.0.1:{port}",
            LHC_NUM_PROCESSES="2",
            LHC_PROCESS_ID=str(process_id),
        )
        # Files, not pipes: a full pipe would stall one process at the shutdown barrier.
        stdout = open(tmp_path / f"process{process_id}.out", "w+")
        stderr = open(tmp_path / f"process{process_id}.err", "w+")
        logs.append((stdout, stderr))
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, "process", str(tmp_path / "two")],
                env=env,
                stdout=stdout,
                stderr=stderr,
            )
        )
    outputs = []
    for proc, (stdout, stderr) in zip(procs, logs):
        try:
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        stdout.seek(0)
        stderr.seek(0)
        assert proc.returncode == 0, stderr.read()[-5000:]
        outputs.append(_results(stdout.read()))
    for out in outputs:
        assert out["process_count"] == 2 and out["device_count"] == 2
        np.testing.assert_allclose(out["process"]["losses"], single["losses"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["process"]["params"], single["params"], rtol=1e-4, atol=1e-6)
        copy, want = out["copy_sequence2"], one["copy_single"]
        np.testing.assert_allclose(copy["losses"], want["losses"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(copy["params"], want["params"], rtol=1e-4, atol=1e-6)
