"""TabICL: ``predict_proba`` time and peak memory of lhc against ``tabicl`` 0.1.4.

Both run the same random weights (default TabICL config, every parameter perturbed),
saved once as an official ``.ckpt`` (read by the reference) and converted to Orbax (read
by lhc, which then never imports torch). Every measurement runs in a fresh subprocess,
whose peak resident memory (``VmHWM``) is the memory figure; the reference runs with
``device="cpu", use_amp=False``. Table rows are (training rows, ensemble size), with the
ratios reference / lhc.

    lhc bench tabicl --sizes 1000,10000,50000 --n-estimators 1,8 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lhc import bench

DEFAULT_SIZES = (1000, 10000, 50000)
DEFAULT_ESTIMATORS = (1, 8)
IMPLEMENTATIONS = ("reference", "lhc")


def _parser() -> argparse.ArgumentParser:
    parser = bench.parser("tabicl", __doc__)
    for flag, default, what in (
        ("--sizes", DEFAULT_SIZES, "training rows"),
        ("--n-estimators", DEFAULT_ESTIMATORS, "ensemble sizes"),
    ):
        text = f"{what}, comma-separated (default {','.join(map(str, default))})"
        parser.add_argument(flag, type=bench.int_list, default=list(default), help=text)
    parser.add_argument("--test-rows", type=int, default=1000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--classes", type=int, default=5)
    parser.add_argument(
        "--impls",
        type=bench.str_list,
        default=list(IMPLEMENTATIONS),
        help="which implementations to run (reference,lhc)",
    )
    parser.add_argument(
        "--warmup",
        choices=("auto", "0", "1"),
        default="auto",
        help="an untimed first predict_proba (auto: when training rows <= 10000)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=4 * 3600,
        help="seconds per measurement before it counts as failed",
    )
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        default=16.0,
        help="address-space limit of each measurement process (0: none); a run over it "
        "fails instead of pushing a shared machine into swap or the OOM killer",
    )
    parser.add_argument(
        "--tiny-model",
        action="store_true",
        help="a small network instead of the default config (smoke tests)",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="also time lhc's jitted stages inside the timed call (column summaries of "
        "the training rows, row embedding from kept training cells, row embedding, ICL), "
        "each waited for before the next",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--n-train", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n-est", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def _limit_memory(limit_gb: float) -> None:
    """Caps this process's address space, so a run over it fails instead of pushing a
    shared machine into the OOM killer."""
    if limit_gb:
        import resource

        size = int(limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (size, size))


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource  # pragma: no cover - non-Linux

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # pragma: no cover


def make_data(n_train: int, n_test: int, features: int, classes: int, seed: int):
    import numpy as np
    from sklearn.datasets import make_classification

    X, y = make_classification(
        n_samples=n_train + n_test,
        n_features=features,
        n_informative=max(2, features // 2),
        n_redundant=features // 4,
        n_classes=classes,
        n_clusters_per_class=1,
        random_state=seed,
    )
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:].astype(np.int64)


def _worker(args) -> None:
    """One measurement in this (fresh) process; writes a JSON result."""
    _limit_memory(args.memory_limit_gb)
    import numpy as np

    X_train, y_train, X_test, y_test = make_data(
        args.n_train, args.test_rows, args.features, args.classes, args.seed
    )
    if args.worker == "reference":
        from tabicl import TabICLClassifier

        clf = TabICLClassifier(
            n_estimators=args.n_est,
            model_path=args.model,
            allow_auto_download=False,
            device="cpu",
            use_amp=False,
        )
    else:
        from lhc.tabicl import TabICLClassifier

        clf = TabICLClassifier(n_estimators=args.n_est, model_path=args.model)
    warmup = args.warmup == "1" or (args.warmup == "auto" and args.n_train <= 10000)
    start = time.perf_counter()
    clf.fit(X_train, y_train)
    fit_s = time.perf_counter() - start
    first_s = None
    if warmup:
        start = time.perf_counter()
        clf.predict_proba(X_test)
        first_s = time.perf_counter() - start
    stages = _StageTimers() if args.stages and args.worker == "lhc" else None
    start = time.perf_counter()
    if stages is None:
        proba = clf.predict_proba(X_test)
    else:
        with stages:
            proba = clf.predict_proba(X_test)
    predict_s = time.perf_counter() - start
    np.save(args.result + ".npy", proba)
    result = dict(
        fit_s=fit_s,
        first_predict_s=first_s,
        predict_s=predict_s,
        warm=warmup,
        peak_rss_mb=_peak_rss_mb(),
        accuracy=float(np.mean(np.argmax(proba, 1) == y_test)),
        torch_imported="torch" in sys.modules,
    )
    if stages is not None:
        result["stages_s"] = dict(stages.seconds)
    with open(args.result, "w") as f:
        json.dump(result, f)


class _StageTimers:
    """Wall time of each jitted inference stage, waiting for its result (host: the rest)."""

    STAGES = ("train_summaries", "embed_cells", "embed_rows", "icl_logits")

    def __init__(self):
        self.seconds = dict.fromkeys(self.STAGES, 0.0)

    def __enter__(self):
        import jax

        from lhc.tabicl import inference

        self._saved = {name: getattr(inference, name) for name in self.STAGES}
        for name, fn in self._saved.items():

            def timed(*args, _fn=fn, _name=name, **kwargs):
                start = time.perf_counter()
                out = jax.block_until_ready(_fn(*args, **kwargs))
                self.seconds[_name] += time.perf_counter() - start
                return out

            setattr(inference, name, timed)
        return self

    def __exit__(self, *exc):
        from lhc.tabicl import inference

        for name, fn in self._saved.items():
            setattr(inference, name, fn)


def save_random_models(directory: Path, tiny: bool, seed: int) -> tuple[Path, Path]:
    """A random default-config reference model as .ckpt, and its Orbax conversion."""
    import torch
    from tabicl import TabICL

    from lhc.tabicl.checkpoint import convert_to_orbax
    from lhc.tabicl.config import TabICLConfig

    tiny_sizes = dict(
        embed_dim=32,
        col_num_blocks=1,
        col_nhead=2,
        col_num_inds=16,
        row_num_blocks=1,
        row_nhead=4,
        row_num_cls=2,
        icl_num_blocks=2,
        icl_nhead=2,
    )
    config = TabICLConfig(**(tiny_sizes if tiny else {})).to_dict()  # the default: the paper's
    torch.manual_seed(seed)
    model = TabICL(**config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("rope.freqs"):
                param.add_(0.02 * torch.randn_like(param))
    ckpt = directory / "random.ckpt"
    torch.save({"config": config, "state_dict": model.state_dict()}, ckpt)
    orbax_dir = convert_to_orbax(ckpt, directory / "random_orbax")
    return ckpt, orbax_dir


def _measured(result: dict | None, key: str):
    # "not run": the implementation was not asked for; "fail": it ran and failed.
    return "not run" if result is None else result.get(key, "fail")


def table(rows: list[dict]) -> str:
    """The rows as a markdown table: time and peak memory of both sides, ratios
    reference / lhc, and the largest difference of the probabilities."""
    shown = [
        {**row, **{f"{impl}_{key}": _measured(row.get(impl), key)
                   for impl in IMPLEMENTATIONS for key in ("predict_s", "peak_rss_mb")}}
        for row in rows
    ]  # fmt: skip
    return bench.markdown_table(
        [("train rows", "n_train"), ("n_est", "n_estimators"),
         ("ref s", "reference_predict_s", ".2f"), ("lhc s", "lhc_predict_s", ".2f"),
         ("ref/lhc", "time_ratio", ".2f"), ("ref MB", "reference_peak_rss_mb", ".0f"),
         ("lhc MB", "lhc_peak_rss_mb", ".0f"), ("ref/lhc", "memory_ratio", ".2f"),
         ("max\\|dp\\|", "max_abs_proba_diff", ".1e")],
        shown,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; prints the table; returns the ``settings`` and the ``rows``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return {}
    import numpy as np

    for impl in args.impls:
        if impl not in IMPLEMENTATIONS:
            parser.error(f"--impls entries must be in {IMPLEMENTATIONS}, got {impl!r}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lhc_tabicl_bench_") as tmp:
        tmp = Path(tmp)
        ckpt, orbax_dir = save_random_models(tmp, args.tiny_model, args.seed)
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")
        for n_train in args.sizes:
            for n_est in args.n_estimators:
                row = {"n_train": n_train, "n_estimators": n_est}
                for impl in args.impls:
                    result_file = tmp / f"{impl}_{n_train}_{n_est}.json"
                    command = [
                        sys.executable,
                        "-m",
                        "lhc.tabicl.bench",
                        "--worker",
                        impl,
                        "--model",
                        str(ckpt if impl == "reference" else orbax_dir),
                        "--n-train",
                        str(n_train),
                        "--n-est",
                        str(n_est),
                        "--test-rows",
                        str(args.test_rows),
                        "--features",
                        str(args.features),
                        "--classes",
                        str(args.classes),
                        "--warmup",
                        args.warmup,
                        "--seed",
                        str(args.seed),
                        "--memory-limit-gb",
                        str(args.memory_limit_gb),
                        "--result",
                        str(result_file),
                    ] + (["--stages"] if args.stages else [])
                    start = time.perf_counter()
                    try:
                        proc = subprocess.run(
                            command,
                            env=env,
                            capture_output=True,
                            text=True,
                            timeout=args.timeout,
                        )
                        returncode, stderr = proc.returncode, proc.stderr
                    except subprocess.TimeoutExpired:
                        returncode, stderr = "timeout", ""
                    if returncode == 0 and result_file.exists():
                        row[impl] = json.loads(result_file.read_text())
                        row[impl]["process_s"] = time.perf_counter() - start
                    else:
                        row[impl] = {"error": f"exit {returncode}", "stderr": stderr[-2000:]}
                ref, lhc = row.get("reference", {}), row.get("lhc", {})
                if "predict_s" in ref and "predict_s" in lhc:
                    row["time_ratio"] = ref["predict_s"] / lhc["predict_s"]
                    row["memory_ratio"] = ref["peak_rss_mb"] / lhc["peak_rss_mb"]
                    p_ref = np.load(tmp / f"reference_{n_train}_{n_est}.json.npy")
                    p_lhc = np.load(tmp / f"lhc_{n_train}_{n_est}.json.npy")
                    row["max_abs_proba_diff"] = float(np.abs(p_ref - p_lhc).max())
                rows.append(row)
                # The header with the first row, then each row as it is measured.
                print(table(rows[-1:]) if len(rows) == 1 else table(rows[-1:]).splitlines()[-1],
                      flush=True)  # fmt: skip
    results = {
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k not in ("worker", "model", "n_train", "n_est", "result")
        },
        "rows": rows,
    }
    print()
    print(table(rows))
    for row in rows:
        stages = row.get("lhc", {}).get("stages_s")
        if stages:
            rest = row["lhc"]["predict_s"] - sum(stages.values())
            parts = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
            print(
                f"lhc stages at {row['n_train']} rows x {row['n_estimators']}: {parts}, "
                f"rest {rest:.2f} s"
            )
    return bench.finish(results, args)


if __name__ == "__main__":
    main()
