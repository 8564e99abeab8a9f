"""One accelerator run: lhc's Pallas kernels compiled and timed, decoding against the
memory roofline, QuantSpec at long context and TabICL against its reference.

    experiments/accelerator/run.sh OUT            # one GPU: at most about 8 minutes
    experiments/accelerator/run.sh OUT --smoke    # any machine: tiny shapes, kernels interpreted

Each section runs in its own process under its own time budget: a row that fails
records its error and the section goes on; a section out of time records the rows it
skipped. Rows land in ``OUT/rows.jsonl`` as they are measured; at the end
``OUT/results.json`` (every row and the environment) and ``OUT/report.md`` (the tables)
are written from it.

* ``ceilings``: the copy bandwidth (a jitted ``x + 1`` over 1 GiB, bytes read plus
  written) and the bf16 matmul rate (8192^3), the denominators of every fraction.
* ``flash``: ``kernels_pallas.flash_attention`` at 4K-32K tokens (causal; 32 query and
  8 kv heads of 128, bf16), forward and forward+backward: the Pallas kernels against
  lhc's XLA path and cuDNN (``jax.nn.dot_product_attention``), errors against the
  float32 reference; a block-size sweep at 16K.
* ``chunk``: ``kernels_pallas.chunk_retrieval`` at GCA's sizes (the 128M model's
  training step, the official kernel's test shape, one decoding token at 128K).
* ``quant``: ``quant_kv_attention`` over QuantSpec's store at 8K-128K tokens, 4 and 8
  bits, 1 and gamma + 1 = 7 queries, against its XLA path and bf16 attention over the
  same context; ``buffer_attention``.
* ``decode``: greedy ``lhc.lm.generate`` of random Llama-3.2-1B and Llama-3.1-8B shaped
  models in bf16, batch 1 and 8, after a 512-token context: tokens/s, and the bytes a
  step reads against the copy bandwidth.
* ``quantspec``: QuantSpec self-speculation (gamma 6, 90 tokens) against plain decoding
  with a bf16 cache at 128K and 32K tokens (Llama-3.1-8B shape), with the draft as
  shipped (4-bit KV, 4-bit MLP) and with the 4-bit KV alone.
* ``tabicl``: ``predict_proba`` of lhc's TabICL against ``tabicl==0.1.4`` on the same
  device (torch CUDA there), same random weights, 10K and 50K training rows, 1 and 8
  members: time and peak device memory, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for path in (str(HERE), str(ROOT)):  # the sibling modules, and lhc from this checkout
    if path not in sys.path:
        sys.path.insert(0, path)

from harness import Section, append_row, check_environment, json_default, read_rows  # noqa: E402

# Seconds per section on an accelerator (the run stays under 8 minutes) and in --smoke.
BUDGETS = {
    "ceilings": (15, 60),
    "flash": (80, 120),
    "chunk": (25, 90),
    "quant": (35, 90),
    "decode": (65, 120),
    "quantspec": (150, 150),
    "tabicl": (65, 150),
}
# Seconds past its budget before a section's process is killed: a row checks the
# budget before it starts, and the one in flight may run over.
GRACE_S = 10


def _section(name: str):
    """The function of section ``name`` (imported here: the driver never imports JAX)."""
    if name in ("ceilings", "flash", "chunk", "quant"):
        import kernels

        return getattr(kernels, f"section_{name}")
    import models

    return getattr(models, f"section_{name}")


# --------------------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------------------


def _cell(value, spec: str) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int) and spec:
        return format(value, spec)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if spec == "%":
            return f"{100 * value:.0f}%"
        if spec == "x":
            return f"{value:.2f}x"
        return format(value, spec)
    return str(value)


def _status(row: dict) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    if "error" in row:
        return f"error: {row['error'][:160]}"
    return ""


# table: (title, [(header, key, format)])
TABLES = {
    "ceilings": (
        "Ceilings measured in this run",
        [
            ("copy GB/s (read + write)", "copy_gbps", ".0f"),
            ("bf16 matmul TFLOP/s", "matmul_tflops", ".0f"),
        ],
    ),
    "flash": (
        "Flash attention (causal, bf16; errors against the float32 reference)",
        [
            ("tokens", "length", ""),
            ("pass", "direction", ""),
            ("impl", "impl", ""),
            ("ms", "ms", ".3f"),
            ("TFLOP/s", "tflops", ".1f"),
            ("of matmul", "matmul_fraction", "%"),
            ("max abs err", "max_abs_err", ".2e"),
            ("rel err", "rel_err", ".2e"),
            ("first call s", "first_call_s", ".1f"),
        ],
    ),
    "flash_blocks": (
        "Flash attention, Pallas block sizes",
        [
            ("tokens", "length", ""),
            ("block_q", "block_q", ""),
            ("block_k", "block_k", ""),
            ("pass", "direction", ""),
            ("ms", "ms", ".3f"),
            ("TFLOP/s", "tflops", ".1f"),
        ],
    ),
    "chunk": (
        "Chunk retrieval (GCA; bf16)",
        [
            ("shape", "shape", ""),
            ("pass", "direction", ""),
            ("impl", "impl", ""),
            ("ms", "ms", ".3f"),
            ("TFLOP/s", "tflops", ".1f"),
            ("of matmul", "matmul_fraction", "%"),
            ("GB/s", "gbps", ".0f"),
            ("of copy", "copy_fraction", "%"),
            ("max abs err", "max_abs_err", ".2e"),
            ("rel err", "rel_err", ".2e"),
        ],
    ),
    "quant": (
        "QuantSpec store attention (one layer, batch 1; bytes: codes and scales read)",
        [
            ("context", "context", ""),
            ("queries", "queries", ""),
            ("store", "store", ""),
            ("ms", "ms", ".3f"),
            ("GB/s", "gbps", ".0f"),
            ("of copy", "copy_fraction", "%"),
            ("vs bf16 (xla)", "vs_bf16_xla", "x"),
            ("max abs err", "max_abs_err", ".2e"),
            ("rel err", "rel_err", ".2e"),
        ],
    ),
    "buffer": (
        "QuantSpec buffer attention (Pallas against its XLA reference)",
        [
            ("keys", "length", ""),
            ("queries", "queries", ""),
            ("pallas ms", "ms", ".3f"),
            ("xla ms", "xla_ms", ".3f"),
            ("max abs err", "max_abs_err", ".2e"),
        ],
    ),
    "decode": (
        "Greedy decoding, random weights, bf16 (`lhc.lm.generate` on a filled cache)",
        [
            ("config", "config", ""),
            ("params", "params", ","),
            ("batch", "batch", ""),
            ("context", "context", ""),
            ("ms / step", "step_ms", ".3f"),
            ("tok/s", "tokens_per_s", ".0f"),
            ("GB / step", "gb_per_step", ".2f"),
            ("GB/s", "gbps", ".0f"),
            ("of copy", "copy_fraction", "%"),
            ("first call s", "first_call_s", ".1f"),
        ],
    ),
    "quantspec": (
        "QuantSpec self-speculation, batch 1, greedy, random weights",
        [
            ("context", "context", ""),
            ("path", "path", ""),
            ("ms / token", "ms_per_token", ".3f"),
            ("acceptance", "acceptance", ".3f"),
            ("tokens / round", "tokens_per_round", ".2f"),
            ("speedup vs bf16", "speedup_vs_fp", "x"),
            ("at the paper's acceptance", "speedup_at_paper_acceptance", "x"),
            ("traffic model", "traffic_model_at_paper_acceptance", "x"),
            ("= 8-bit tokens (bf16 / 4-bit draft weights)", "equal", ""),
            ("first call s", "first_call_s", ".1f"),
        ],
    ),
    "tabicl": (
        "TabICL predict_proba (same random weights; each run a fresh process)",
        [
            ("train rows", "rows", ""),
            ("members", "members", ""),
            ("impl", "impl", ""),
            ("predict s", "predict_s", ".3f"),
            ("first call s", "first_predict_s", ".2f"),
            ("device peak MB", "device_peak_mb", ".0f"),
            ("host peak MB", "host_peak_mb", ".0f"),
            ("accuracy", "accuracy", ".3f"),
        ],
    ),
    "tabicl_ratio": (
        "TabICL: reference / lhc",
        [
            ("train rows", "rows", ""),
            ("members", "members", ""),
            ("time", "time_ratio", "x"),
            ("device memory", "memory_ratio", "x"),
            ("max abs dp", "max_abs_proba_diff", ".1e"),
        ],
    ),
}


def _prepare(row: dict) -> dict:
    row = dict(row)
    for key in ("device_peak_bytes", "host_peak_bytes"):
        if row.get(key) is not None:
            row[key.replace("_bytes", "_mb")] = row[key] / 2**20
    flags = [row.get(f"spec_{w}_equal") for w in ("bf16", "int4")]
    if any(flag is not None for flag in flags):
        row["equal"] = " / ".join(_cell(flag, "") or "-" for flag in flags)
    return row


def report(environment: dict, rows: list[dict], smoke: bool) -> str:
    lines = [
        "# Accelerator run" + (" (--smoke)" if smoke else ""),
        "",
        f"{environment.get('date')}: {environment.get('device')} ({environment.get('platform')}), "
        f"jax {environment.get('jax')}, jaxlib {environment.get('jaxlib')}, torch "
        f"{environment.get('torch')}, tabicl {environment.get('tabicl')}, Python "
        f"{environment.get('python')}, {environment.get('host_cpus')} host CPUs.",
    ]
    for table, (title, columns) in TABLES.items():
        selected = [_prepare(row) for row in rows if row.get("table") == table]
        if not selected:
            continue
        headers = [header for header, _, _ in columns] + ["status"]
        lines += ["", f"## {title}", "", "| " + " | ".join(headers) + " |",
                  "|" + "---|" * len(headers)]  # fmt: skip
        for row in selected:
            cells = [_cell(row.get(key), spec) for _, key, spec in columns] + [_status(row)]
            lines.append("| " + " | ".join(cells) + " |")
    failed = [row for row in rows if row.get("table") == "section_failed"]
    if failed:
        lines += ["", "## Sections that did not finish", ""]
        lines += [f"- {row['section']}: {row['error']}" for row in failed]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# The driver.
# --------------------------------------------------------------------------------------


def _environment() -> dict[str, Any]:
    """``check_environment()`` in a child process, so that this one never opens the
    device and each section's process has all of its memory."""
    proc = subprocess.run([sys.executable, __file__, "--environment"], capture_output=True,
                          text=True)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ENVIRONMENT ")]
    if proc.returncode or not lines:
        message = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise SystemExit(f"accelerator: the environment check failed: {message[0]}")
    return json.loads(lines[-1][len("ENVIRONMENT ") :])


def run_sections(out: Path, smoke: bool, names: list[str]) -> dict:
    """Runs each section in a fresh process under its budget; returns the results."""
    environment = _environment()
    if environment["platform"] not in ("gpu", "tpu") and not smoke:
        raise SystemExit(
            f"accelerator: JAX sees no accelerator (platform {environment['platform']!r}); "
            "pass --smoke to run the tiny shapes here"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("")
    print(f"accelerator: {json.dumps(environment)}", flush=True)
    for name in names:
        budget = BUDGETS[name][1 if smoke else 0]
        start = time.time()
        command = [
            sys.executable,
            __file__,
            "--section",
            name,
            "--out",
            str(out),
            "--deadline",
            str(start + budget),
            "--platform",
            environment["platform"],
        ]
        command += ["--smoke"] if smoke else []  # fmt: skip
        # The TabICL section's own process only converts a checkpoint: it leaves the
        # device's memory to the processes it measures.
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false") if name == "tabicl" else None
        try:
            proc = subprocess.run(command, timeout=budget + GRACE_S, env=env)
            error = f"exit {proc.returncode}" if proc.returncode else None
        except subprocess.TimeoutExpired:
            error = f"killed after {budget + GRACE_S} s (budget {budget} s)"
        if error:
            append_row(out, dict(section=name, table="section_failed", error=error))
        print(f"accelerator: section {name} took {time.time() - start:.0f} s"
              + (f" ({error})" if error else ""), flush=True)  # fmt: skip
    rows = read_rows(out)
    results = dict(environment=environment, smoke=smoke, rows=rows)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=json_default))
    text = report(environment, rows, smoke)
    (out / "report.md").write_text(text)
    print(text, flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for rows.jsonl, results.json, report.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernels interpreted")
    parser.add_argument("--sections", default=",".join(BUDGETS),
                        help=f"comma-separated, run in this order (default: {','.join(BUDGETS)})")  # fmt: skip
    # A section's own process, the environment check and a TabICL measurement.
    parser.add_argument("--section", choices=tuple(BUDGETS), help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--platform", help=argparse.SUPPRESS)
    parser.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tabicl-worker", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.environment:
        print("ENVIRONMENT " + json.dumps(check_environment()), flush=True)
        return
    if args.tabicl_worker:
        from models import tabicl_worker

        result = tabicl_worker(**json.loads(args.tabicl_worker))
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.out is None:
        parser.error("--out is required")
    if args.section:
        section = Section(args.section, args.out, args.smoke, args.deadline, args.platform)
        _section(args.section)(section)
        return
    names = [name for name in args.sections.split(",") if name]
    unknown = sorted(set(names) - set(BUDGETS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; known: {list(BUDGETS)}")
    run_sections(args.out, args.smoke, names)


if __name__ == "__main__":
    main()
