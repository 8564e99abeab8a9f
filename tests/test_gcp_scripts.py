"""Tests for the Cloud TPU VM scripts in gcp/.

No Google Cloud here: a fake `gcloud` first on PATH records every call and plays a TPU VM
whose state lives in a JSON file. For run.sh the fake also performs the scp into a fake
worker home and runs the ssh --command there with bash, so the quoting is checked by the
shell that will read it, and setup_worker.sh runs for real against a fake venv.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GCP = REPO / "gcp"
ENTRY_SCRIPTS = ["babysit.sh", "create_tpu_vm.sh", "run.sh", "setup_worker.sh"]
VM_SCRIPTS = ["babysit.sh", "create_tpu_vm.sh", "run.sh"]

# Arguments that break naive quoting: spaces, both quotes, $, ;, glob and backslash.
TRICKY_LHC_ARGS = [
    "train",
    "--config",
    "configs/demo.py:tiny",
    "--workdir",
    "gs://bucket/runs/run 1",
    '--config.note=it\'s a "test"; echo $HOME `id` * \\n',
    "--config.empty=",
    "two\nlines",
]

_FAKE_GCLOUD = r"""
import json, os, shutil, subprocess, sys

args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_CALLS"], "a") as f:
    f.write(json.dumps(args) + "\n")
state_path = os.environ["FAKE_GCLOUD_STATE"]
with open(state_path) as f:
    st = json.load(f)

def save():
    with open(state_path, "w") as f:
        json.dump(st, f)

assert args[:2] == ["compute", "tpus"], args
group, verb = args[2], args[3]
rc = 0
if verb == "describe":
    key = "vm" if group == "tpu-vm" else "queued"
    if st[key] == "NOT_FOUND":
        sys.stderr.write(f"ERROR: (gcloud.compute.tpus.{group}.describe) NOT_FOUND: "
                         f"Resource 'projects/p/locations/z/nodes/{args[4]}' was not found\n")
        rc = 1
    else:
        print(st[key])
elif verb == "create":
    st["vm"] = "READY"
    if group == "queued-resources":
        st["queued"] = "ACTIVE"
elif verb == "delete":
    st["vm"] = "NOT_FOUND"
    if group == "queued-resources":
        st["queued"] = "NOT_FOUND"
elif verb == "start":
    st["vm"] = "READY"
elif verb == "scp":
    if st.get("worker_home"):
        for arg in args[4:]:
            if os.path.isfile(arg):
                shutil.copy(arg, st["worker_home"])
elif verb == "ssh":
    command = args[args.index("--command") + 1]
    if st.get("worker_home"):
        env = dict(os.environ, HOME=st["worker_home"])
        rc = subprocess.run(["bash", "-c", command], env=env, cwd=st["worker_home"]).returncode
    else:
        rcs = st.get("ssh_rcs") or [0]
        rc = rcs.pop(0)
        st["ssh_rcs"] = rcs
        if rc != 0 and st.get("after_failed_ssh"):
            st["vm"] = st["after_failed_ssh"]
save()
sys.exit(rc)
"""

# Stands in for lhc-venv/bin/{python,lhc} on the fake worker: records argv, cwd and the
# LHC_* / LIBTPU_* environment as one JSON line.
_FAKE_VENV_TOOL = r"""
import json, os, sys
with open(os.environ["FAKE_TOOL_CALLS"], "a") as f:
    env = {k: v for k, v in os.environ.items() if k.startswith(("LHC_", "LIBTPU_", "EXTRA_"))}
    f.write(json.dumps({"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                        "cwd": os.getcwd(), "env": env}) + "\n")
print("fake", os.path.basename(sys.argv[0]), "ran")
"""


def _write_exe(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # -S: no site-packages, which makes each of the many fake calls several times faster.
    path.write_text(f"#!{sys.executable} -S\n{body}")
    path.chmod(0o755)
    return path


def _read_jsonl(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


class FakeCloud:
    """A fake gcloud on PATH with a VM state, plus paths for a fake worker."""

    def __init__(self, tmp_path: Path, **state):
        self.tmp = tmp_path
        self.bin = tmp_path / "bin"
        self.calls_path = tmp_path / "gcloud_calls.jsonl"
        self.state_path = tmp_path / "gcloud_state.json"
        self.tool_calls_path = tmp_path / "tool_calls.jsonl"
        _write_exe(self.bin / "gcloud", _FAKE_GCLOUD)
        self.set_state(**{"vm": "NOT_FOUND", "queued": "NOT_FOUND", **state})
        self.src = tmp_path / "src"
        (self.src / "lhc").mkdir(parents=True)
        (self.src / "pyproject.toml").write_text('[project]\nname = "lhc"\n')
        (self.src / "lhc" / "__init__.py").write_text("")

    def set_state(self, **state):
        self.state_path.write_text(json.dumps(state))

    @property
    def state(self) -> dict:
        return json.loads(self.state_path.read_text())

    @property
    def calls(self) -> list:
        return _read_jsonl(self.calls_path)

    @property
    def tool_calls(self) -> list:
        return _read_jsonl(self.tool_calls_path)

    def verbs(self) -> list:
        return [" ".join(call[2:4]) for call in self.calls]

    def make_worker(self) -> Path:
        """A worker home with a ready venv whose python and lhc are recorders."""
        home = self.tmp / "worker_home"
        for tool in ("python", "lhc"):
            _write_exe(home / "lhc-venv" / "bin" / tool, _FAKE_VENV_TOOL)
        self.set_state(**{**self.state, "worker_home": str(home)})
        return home

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LHC_", "CLOUDSDK_"))}
        env.update(
            PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
            FAKE_GCLOUD_CALLS=str(self.calls_path),
            FAKE_GCLOUD_STATE=str(self.state_path),
            FAKE_TOOL_CALLS=str(self.tool_calls_path),
            LHC_TPU_POLL_SECONDS="0",
            LHC_TPU_WAIT_TIMEOUT="30",
            LHC_LOG_DIR=str(self.tmp / "local_logs"),
            LHC_SRC=str(self.src),
            USER="tester",
        )
        env.update(extra)
        return env

    def run(self, script: str, *args: str, **env) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(GCP / script), *args],
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=60,
        )


@pytest.fixture
def cloud(tmp_path):
    return FakeCloud(tmp_path)


def _flag_value(call: list, flag: str) -> str:
    return call[call.index(flag) + 1]


# --- static checks ----------------------------------------------------------------------


def test_script_inventory():
    scripts = sorted(p.name for p in GCP.glob("*.sh") if not p.name.startswith("_"))
    assert scripts == ENTRY_SCRIPTS
    for name in ENTRY_SCRIPTS:
        assert os.access(GCP / name, os.X_OK), f"{name} is not executable"


def _shellcheck_path() -> str:
    """shellcheck's path; a missing one fails the test under CI and skips it elsewhere."""
    for candidate in (shutil.which("shellcheck"), "/usr/bin/shellcheck"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    if os.environ.get("CI"):
        pytest.fail("shellcheck is required when CI is set (apt-get install shellcheck)")
    pytest.skip("shellcheck is not installed (apt-get install shellcheck); with CI set this fails")


def test_missing_shellcheck_fails_under_ci_and_skips_otherwise(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="required when CI is set"):
        _shellcheck_path()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        _shellcheck_path()


def test_shellcheck():
    shellcheck = _shellcheck_path()
    scripts = sorted(str(p) for p in GCP.glob("*.sh"))
    result = subprocess.run(
        [shellcheck, "--external-sources", "--severity=style", *scripts],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in GCP.glob("*.sh")))
def test_bash_syntax(script):
    result = subprocess.run(["bash", "-n", str(GCP / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- usage ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "script,flag", [(script, "--help") for script in ENTRY_SCRIPTS] + [("run.sh", "-h")]
)
def test_help_prints_usage_and_calls_nothing(cloud, script, flag):
    result = cloud.run(script, flag)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: {script}")
    assert not cloud.calls_path.exists()


BAD_INVOCATIONS = [
    (script, args)
    for script in ENTRY_SCRIPTS
    for args in [("--no-such-option",), ("unexpected-positional",)]
] + [
    ("create_tpu_vm.sh", ("--zone",)),
    ("create_tpu_vm.sh", ("--spot=1",)),
    ("create_tpu_vm.sh", ("--accelerator", "v5e")),
    ("create_tpu_vm.sh", ("--name", "Bad_Name")),
    ("create_tpu_vm.sh", ("--poll-seconds", "soon")),
    ("create_tpu_vm.sh", ("--queued", "--preemptible")),
    ("setup_worker.sh", ("--src-dir",)),
    ("run.sh", ()),
    ("run.sh", ("--name", "lhc-x")),
    ("run.sh", ("--name", "lhc-x", "--")),
    ("run.sh", ("--env", "NOT AN ASSIGNMENT", "--", "demo")),
    ("run.sh", ("--remote-dir", "../..", "--", "demo")),
    ("run.sh", ("--remote-dir", "/", "--", "demo")),
    ("run.sh", ("--run-id", "a b", "--", "demo")),
    ("babysit.sh", ()),
    ("babysit.sh", ("--spot",)),
    ("babysit.sh", ("--max-attempts", "0", "--", "demo")),
    ("babysit.sh", ("--max-failures", "x", "--", "demo")),
]


@pytest.mark.parametrize("script,args", BAD_INVOCATIONS)
def test_bad_invocation_prints_usage_and_calls_nothing(cloud, script, args):
    result = cloud.run(script, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"Usage: {script}" in result.stderr
    assert not cloud.calls_path.exists()


@pytest.mark.parametrize(
    "env",
    [
        {"LHC_TPU_SPOT": "1", "LHC_TPU_PREEMPTIBLE": "1"},
        {"LHC_TPU_SPOT": "yes"},
        {"LHC_TPU_WAIT_TIMEOUT": "-1"},
    ],
)
def test_bad_environment_prints_usage_and_calls_nothing(cloud, env):
    result = cloud.run("create_tpu_vm.sh", **env)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Usage: create_tpu_vm.sh" in result.stderr
    assert not cloud.calls_path.exists()


def test_run_rejects_a_source_without_pyproject(cloud, tmp_path):
    result = cloud.run("run.sh", "--src", str(tmp_path), "--", "demo")
    assert result.returncode == 2
    assert "pyproject.toml" in result.stderr
    assert not cloud.calls_path.exists()


# --- create_tpu_vm.sh -------------------------------------------------------------------


def test_create_does_nothing_when_ready(cloud):
    cloud.set_state(vm="READY", queued="NOT_FOUND")
    result = cloud.run("create_tpu_vm.sh", "--name", "lhc-a", "--zone", "zone-a")
    assert result.returncode == 0, result.stderr
    assert cloud.verbs() == ["tpu-vm describe"]
    describe = cloud.calls[0]
    assert describe[4] == "lhc-a" and _flag_value(describe, "--zone") == "zone-a"
    assert "nothing to do" in result.stderr


def test_create_creates_when_not_found(cloud):
    result = cloud.run("create_tpu_vm.sh", "--name=lhc-a", "--spot", "--project", "proj")
    assert result.returncode == 0, result.stderr
    assert cloud.verbs() == ["tpu-vm describe", "tpu-vm create", "tpu-vm describe"]
    create = cloud.calls[1]
    assert create[4] == "lhc-a"
    assert _flag_value(create, "--zone") == "us-west4-a"
    assert _flag_value(create, "--project") == "proj"
    assert _flag_value(create, "--accelerator-type") == "v5litepod-8"
    assert _flag_value(create, "--version") == "v2-alpha-tpuv5-lite"
    assert "--spot" in create and "--preemptible" not in create
    assert cloud.state["vm"] == "READY"


def test_create_settings_come_from_the_environment(cloud):
    result = cloud.run(
        "create_tpu_vm.sh",
        "--create-flag=--reserved",
        LHC_TPU_ACCELERATOR="v5p-16",
        LHC_TPU_PREEMPTIBLE="1",
        LHC_TPU_CREATE_FLAGS="--network=my-net",
    )
    assert result.returncode == 0, result.stderr
    create = cloud.calls[1]
    assert create[4] == "lhc-tester-v5p-16"
    assert _flag_value(create, "--zone") == "us-east5-a"
    assert _flag_value(create, "--version") == "v2-alpha-tpuv5"
    assert "--preemptible" in create and "--spot" not in create
    assert create[-2:] == ["--network=my-net", "--reserved"]


def test_create_replaces_a_preempted_vm(cloud):
    cloud.set_state(vm="PREEMPTED", queued="NOT_FOUND")
    result = cloud.run("create_tpu_vm.sh", "--name", "lhc-a", "--spot")
    assert result.returncode == 0, result.stderr
    assert cloud.verbs() == [
        "tpu-vm describe",
        "tpu-vm describe",
        "tpu-vm delete",
        "tpu-vm create",
        "tpu-vm describe",
    ]
    assert "--quiet" in cloud.calls[2]


def test_create_through_a_queued_resource(cloud):
    result = cloud.run("create_tpu_vm.sh", "--name", "lhc-q", "--queued", "--spot")
    assert result.returncode == 0, result.stderr
    assert cloud.verbs() == [
        "tpu-vm describe",
        "queued-resources describe",
        "queued-resources create",
        "tpu-vm describe",
    ]
    create = cloud.calls[2]
    assert create[4] == "lhc-q"
    assert _flag_value(create, "--node-id") == "lhc-q"
    assert _flag_value(create, "--runtime-version") == "v2-alpha-tpuv5-lite"
    assert "--spot" in create


def test_create_fails_clearly_when_gcloud_fails(cloud):
    cloud.state_path.write_text("not json")  # the fake gcloud crashes on every call
    result = cloud.run("create_tpu_vm.sh", "--name", "lhc-a")
    assert result.returncode == 1
    assert "cannot read the state of lhc-a" in result.stderr
    assert cloud.verbs() == ["tpu-vm describe"]


# --- setup_worker.sh --------------------------------------------------------------------


def _setup(cloud, home: Path, *args: str, **env) -> subprocess.CompletedProcess:
    return cloud.run("setup_worker.sh", *args, HOME=str(home), **env)


def test_setup_installs_only_when_pyproject_changes(cloud):
    home = cloud.make_worker()
    shutil.copytree(cloud.src, home / "lhc")

    def pip_installs():
        return [c for c in cloud.tool_calls if c["argv"][:2] == ["-m", "pip"]]

    result = _setup(cloud, home)
    assert result.returncode == 0, result.stderr
    (install,) = pip_installs()
    assert install["argv"] == ["-m", "pip", "install", "--quiet", "-e", ".[tpu]"]
    assert install["cwd"] == str(home / "lhc")
    device_checks = [c for c in cloud.tool_calls if c["argv"][0] == "-c"]
    assert len(device_checks) == 1 and "jax" in device_checks[0]["argv"][1]

    result = _setup(cloud, home, "--no-device-check")
    assert result.returncode == 0, result.stderr
    assert len(pip_installs()) == 1
    assert "unchanged" in result.stderr

    with open(home / "lhc" / "pyproject.toml", "a") as f:
        f.write("# new dependency\n")
    assert _setup(cloud, home, "--no-device-check").returncode == 0
    assert len(pip_installs()) == 2

    assert _setup(cloud, home, "--no-device-check", "--extras", "").returncode == 0
    assert pip_installs()[-1]["argv"][-1] == "."


def test_setup_needs_code_or_a_repo(cloud):
    home = cloud.make_worker()
    result = _setup(cloud, home)
    assert result.returncode == 1
    assert "pyproject.toml is missing" in result.stderr


def test_setup_never_replaces_an_existing_directory_as_venv(cloud, tmp_path):
    home = cloud.make_worker()
    shutil.copytree(cloud.src, home / "lhc")
    keep = home / "precious"
    keep.mkdir()
    (keep / "data.txt").write_text("keep me")
    result = _setup(cloud, home, "--venv", "precious")
    assert result.returncode == 1
    assert "has no bin/python" in result.stderr
    assert (keep / "data.txt").read_text() == "keep me"


def _git(*args, cwd):
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@example.com",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@example.com",
    )
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


def test_setup_clones_then_updates_the_repo(cloud, tmp_path):
    home = cloud.make_worker()
    origin = cloud.src
    _git("init", "-q", "-b", "main", cwd=origin)
    _git("add", ".", cwd=origin)
    _git("commit", "-q", "-m", "first", cwd=origin)

    args = ("--repo", str(origin), "--ref", "main", "--no-device-check")
    result = _setup(cloud, home, *args)
    assert result.returncode == 0, result.stderr
    assert (home / "lhc" / "lhc" / "__init__.py").exists()

    (origin / "NEW_FILE").write_text("x")
    _git("add", ".", cwd=origin)
    _git("commit", "-q", "-m", "second", cwd=origin)
    result = _setup(cloud, home, *args)
    assert result.returncode == 0, result.stderr
    assert (home / "lhc" / "NEW_FILE").exists()
    assert "second" in result.stderr
    # pyproject.toml did not change, so pip ran once for both setups.
    assert sum(c["argv"][:2] == ["-m", "pip"] for c in cloud.tool_calls) == 1


# --- run.sh -----------------------------------------------------------------------------


def test_run_quotes_the_command_for_all_workers(cloud):
    cloud.set_state(vm="READY", queued="NOT_FOUND")
    home = cloud.make_worker()
    (cloud.src / "big.bin").write_text("payload")
    libtpu_args = "--xla_flag_a=true --xla_flag_b=2"
    result = cloud.run(
        "run.sh",
        "--name",
        "lhc-r",
        "--zone",
        "zone-r",
        "--run-id",
        "r1",
        "--env",
        f"LIBTPU_INIT_ARGS={libtpu_args}",
        "--",
        "lhc",
        *TRICKY_LHC_ARGS,
        LHC_RUN_ENV="EXTRA_A=a b",
    )
    assert result.returncode == 0, result.stderr

    assert cloud.verbs() == ["tpu-vm scp", "tpu-vm ssh"]
    scp, ssh = cloud.calls
    assert "--worker=all" in scp and scp[scp.index("--zone") - 1] == "lhc-r:"
    assert ssh[4] == "lhc-r" and _flag_value(ssh, "--zone") == "zone-r"
    assert "--worker=all" in ssh
    command = _flag_value(ssh, "--command")
    assert "LHC_DISTRIBUTED=1 " in command
    assert "lhc-venv/bin/lhc train --config configs/demo.py:tiny --workdir " in command

    # The fake ran the command with bash on the fake worker: lhc got exactly our args.
    (lhc_call,) = [c for c in cloud.tool_calls if c["tool"] == "lhc"]
    assert lhc_call["argv"] == TRICKY_LHC_ARGS
    assert lhc_call["env"]["LHC_DISTRIBUTED"] == "1"
    assert lhc_call["env"]["LIBTPU_INIT_ARGS"] == libtpu_args
    assert lhc_call["env"]["EXTRA_A"] == "a b"
    assert lhc_call["cwd"] == str(home / "lhc")
    # setup_worker.sh ran first, on the copied code.
    assert (home / "lhc" / "big.bin").read_text() == "payload"
    assert not (home / "lhc-src.tar.gz").exists()
    assert (home / "lhc-venv" / ".lhc-install-stamp").exists()

    worker_log = home / "lhc-logs" / f"r1.{socket.gethostname()}.log"
    assert "fake lhc ran" in worker_log.read_text()
    assert "worker ready" in worker_log.read_text()
    local_log = cloud.tmp / "local_logs" / "lhc-r-r1.log"
    assert "fake lhc ran" in local_log.read_text()


def test_run_copies_what_git_tracks_and_mirrors_deletions(cloud):
    cloud.set_state(vm="READY", queued="NOT_FOUND")
    home = cloud.make_worker()
    (cloud.src / ".gitignore").write_text("ignored.txt\n")
    (cloud.src / "ignored.txt").write_text("secret")
    (cloud.src / "untracked.txt").write_text("new")
    _git("init", "-q", "-b", "main", cwd=cloud.src)
    (home / "lhc").mkdir()
    (home / "lhc" / "stale.py").write_text("old")

    result = cloud.run("run.sh", "--name", "lhc-r", "--", "demo")
    assert result.returncode == 0, result.stderr
    copied = home / "lhc"
    assert (copied / "untracked.txt").exists() and (copied / "pyproject.toml").exists()
    assert not (copied / "ignored.txt").exists()
    assert not (copied / "stale.py").exists()


def test_run_with_a_repo_does_not_copy_code(cloud):
    cloud.set_state(vm="READY", queued="NOT_FOUND", ssh_rcs=[0])
    result = cloud.run(
        "run.sh", "--name", "lhc-r", "--repo", "https://example.com/x y.git", "--", "demo"
    )
    assert result.returncode == 0, result.stderr
    scp, ssh = cloud.calls
    assert [Path(a).name for a in scp[4 : scp.index("lhc-r:")]] == ["lhc-setup_worker.sh"]
    command = _flag_value(ssh, "--command")
    assert "tar -xzf" not in command
    assert "--repo https://example.com/x\\ y.git --ref main" in command


def test_run_returns_the_remote_exit_status(cloud):
    cloud.set_state(vm="READY", queued="NOT_FOUND", ssh_rcs=[3])
    result = cloud.run("run.sh", "--name", "lhc-r", "--", "demo")
    assert result.returncode == 3
    assert "failed" in result.stderr


# --- babysit.sh -------------------------------------------------------------------------


def test_babysit_recreates_after_preemption_and_stops_on_success(cloud):
    cloud.set_state(
        vm="PREEMPTED", queued="NOT_FOUND", ssh_rcs=[255, 0], after_failed_ssh="PREEMPTED"
    )
    result = cloud.run(
        "babysit.sh",
        "--name",
        "lhc-b",
        "--spot",
        "--run-id",
        "b",
        "--",
        "train",
        "--workdir",
        "gs://bucket/run 1",
    )
    assert result.returncode == 0, result.stderr
    verbs = cloud.verbs()
    assert verbs.count("tpu-vm delete") == 2
    assert verbs.count("tpu-vm create") == 2
    assert verbs.count("tpu-vm ssh") == 2
    assert verbs[-1] == "tpu-vm ssh", "nothing may run after the command succeeded"
    # Each recreation deletes the preempted VM before creating the new one.
    deletes = [i for i, v in enumerate(verbs) if v == "tpu-vm delete"]
    creates = [i for i, v in enumerate(verbs) if v == "tpu-vm create"]
    ssh_calls = [i for i, v in enumerate(verbs) if v == "tpu-vm ssh"]
    assert deletes[0] < creates[0] < ssh_calls[0] < deletes[1] < creates[1] < ssh_calls[1]
    for call in cloud.calls:
        if call[3] == "create":
            assert "--spot" in call
        if call[3] == "ssh":
            command = _flag_value(call, "--command")
            assert "--worker=all" in call
            assert "LHC_DISTRIBUTED=1" in command
            assert "--workdir gs://bucket/run\\ 1" in command
    logs = sorted(p.name for p in (cloud.tmp / "local_logs").iterdir())
    assert logs == ["lhc-b-b-a1.log", "lhc-b-b-a2.log"]


def test_babysit_gives_up_on_a_command_that_fails_on_a_healthy_vm(cloud):
    cloud.set_state(vm="READY", queued="NOT_FOUND", ssh_rcs=[1, 1, 1, 1])
    result = cloud.run("babysit.sh", "--name", "lhc-b", "--max-failures", "2", "--", "demo")
    assert result.returncode == 1
    assert cloud.verbs().count("tpu-vm ssh") == 2
    assert "tpu-vm create" not in cloud.verbs()
    assert "giving up" in result.stderr


def test_babysit_retries_are_bounded(cloud):
    cloud.set_state(
        vm="READY", queued="NOT_FOUND", ssh_rcs=[255] * 10, after_failed_ssh="PREEMPTED"
    )
    result = cloud.run("babysit.sh", "--name", "lhc-b", "--", "demo", LHC_BABYSIT_MAX_ATTEMPTS="3")
    assert result.returncode == 255
    assert cloud.verbs().count("tpu-vm ssh") == 3
    assert cloud.verbs().count("tpu-vm create") == 2
    assert "giving up after 3 attempts" in result.stderr


def test_babysit_can_delete_the_vm_when_done(cloud):
    cloud.set_state(vm="NOT_FOUND", queued="NOT_FOUND", ssh_rcs=[0])
    result = cloud.run("babysit.sh", "--name", "lhc-b", "--delete-when-done", "--", "demo")
    assert result.returncode == 0, result.stderr
    assert cloud.verbs()[-1] == "tpu-vm delete"
    assert cloud.state["vm"] == "NOT_FOUND"
