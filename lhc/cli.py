"""The ``lhc`` command. It parses arguments and calls library functions, nothing more.

lhc train   --config configs/X.py:tiny --workdir DIR [--config.key=value ...]
lhc eval    --workdir DIR [--config configs/X.py:tiny] [--step N] [--config.key=value ...]
lhc compile --config configs/X.py:tiny --topology v5e:2x2
lhc demo    [--workdir DIR]
lhc generate --checkpoint PATH|NAME (or --workdir DIR) --prompt TEXT [--chat] [...]
lhc plot    --workdir DIR [--out PNG]
lhc bench   NAME [benchmark flags]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import shlex
import signal
import sys
import tempfile

from lhc.bench import CHECKPOINT_HELP

DEMO_CONFIG = "lm_assoc_recall.py:tiny"


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separates ``--config.key=value`` (and ``--config.key value``) from other args."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            if "=" in arg:
                overrides.append(arg)
            elif i + 1 < len(argv):
                overrides.append(f"{arg}={argv[i + 1]}")
                i += 1
            else:
                raise SystemExit(f"lhc: {arg} needs a value")
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _version() -> str:
    """The installed distribution's version (the source tree's when not installed)."""
    try:
        return importlib.metadata.version("lhc")
    except importlib.metadata.PackageNotFoundError:
        import lhc

        return lhc.__version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lhc", description="lhc: long-context methods in JAX")
    parser.add_argument("--version", action="version", version=f"lhc {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train",
        help="train a config (resumes from --workdir)",
        description="Trains a config in --workdir, resuming from its latest checkpoint. Any "
        "config value can be overridden with --config.KEY=VALUE (nested keys with dots).",
        epilog="example:\n  lhc train --config configs/lm_assoc_recall.py:tiny --workdir "
        "/tmp/recall \\\n      --config.num_steps=600 --config.model.num_layers=3\n\n"
        "Ctrl-C (or SIGTERM) saves the current step; the same command resumes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", required=True, help="configs/X.py[:arg]")
    train.add_argument("--workdir", required=True)

    evaluate = commands.add_parser("eval", help="evaluate the latest checkpoint in --workdir")
    evaluate.add_argument(
        "--config", default=None, help="configs/X.py[:arg] (default: the run's config.json)"
    )
    evaluate.add_argument("--workdir", required=True)
    evaluate.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    evaluate.add_argument(
        "--fallback",
        action="store_true",
        help="an unreadable latest checkpoint gives way to the newest readable one",
    )

    compile_ = commands.add_parser(
        "compile", help="compile the train step for a Cloud TPU topology on this host"
    )
    compile_.add_argument("--config", required=True)
    compile_.add_argument("--topology", required=True, help="e.g. v5e:2x2 or v5p:2x2x2")

    demo = commands.add_parser("demo", help="train the tiny demo experiment on this machine")
    demo.add_argument("--workdir", default=None, help="default: a fresh temporary directory")

    generate = commands.add_parser(
        "generate", help="generate text with a checkpoint (HF directory, .gguf, a model name)"
    )
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint",
        help=CHECKPOINT_HELP,
    )
    source.add_argument("--workdir", help="an lhc training run")
    generate.add_argument(
        "--prompt", action="append", default=[], help="a prompt (repeat for a batch)"
    )
    generate.add_argument("--prompts-file", help="a text file, one prompt per line")
    generate.add_argument("--chat", action="store_true", help="prompts are user messages")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-k", type=int, default=0, help="0: off")
    generate.add_argument("--top-p", type=float, default=1.0, help="1: off")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 elsewhere")

    export = commands.add_parser(
        "export", help="write a run's language model as a Hugging Face directory"
    )
    export.add_argument("--workdir", required=True, help="an lhc training run")
    export.add_argument("--out", required=True, help="the directory to write")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a run with LoRA adapters: a PEFT adapter directory (default: merged weights)",
    )

    plot = commands.add_parser("plot", help="draw a run's train and eval curves to a PNG")
    plot.add_argument("--workdir", required=True)
    plot.add_argument("--out", default=None, help="the PNG (default: WORKDIR/metrics.png)")

    report = commands.add_parser(
        "report", help="an experiment's tables from its results/*.jsonl (lhc.report)"
    )
    report.add_argument("directory", help="an experiment directory, e.g. experiments/nolima")
    report.add_argument(
        "--write", action="store_true", help="into its README's <!-- report: NAME --> blocks"
    )

    bench = commands.add_parser("bench", help="run a benchmark (lhc bench --list)")
    bench.add_argument("name", nargs="?", help="a package's benchmark, e.g. lm, gca, nolima")
    bench.add_argument("--list", action="store_true", help="list the benchmarks")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        args, overrides = _parser().parse_args(argv), []
    else:
        rest, overrides = _split_overrides(argv)
        args = _parser().parse_args(rest)
        if overrides and args.command not in ("train", "eval", "compile"):
            raise SystemExit(f"lhc {args.command}: --config.* overrides are not accepted")

    from lhc.train import config as config_lib

    if args.command == "bench":
        from lhc import bench

        if args.list or args.name is None:
            print(bench.listing())
            return 0
        main_fn, bench_args = bench.resolve(args.name, args.bench_args)
        main_fn(bench_args)
        return 0

    if args.command == "demo":
        return _demo(args.workdir)

    if args.command == "generate":
        return _generate(args)

    if args.command == "export":
        from lhc.train.export import export

        _show_progress_notes()
        try:
            for path in export(args.workdir, args.out, step=args.step, adapter=args.adapter):
                print(path)
        except (FileNotFoundError, ValueError) as error:
            raise SystemExit(f"lhc export: {error}") from None
        return 0

    if args.command == "report":
        from lhc import report

        try:
            blocks = report.render(args.directory)
            if args.write:
                print("wrote", ", ".join(report.write_readme(args.directory, blocks)))
            else:
                print("\n\n".join(f"<!-- {name} -->\n{text}" for name, text in blocks.items()))
        except (FileNotFoundError, ValueError) as error:
            raise SystemExit(f"lhc report: {error}") from None
        return 0

    if args.command == "plot":
        from lhc.train.metrics import plot_metrics

        try:
            print(plot_metrics(args.workdir, args.out))
        except FileNotFoundError as error:
            raise SystemExit(f"lhc plot: {error}") from None
        return 0

    try:
        if args.command == "eval" and args.config is None:
            config = config_lib.load_run_config(args.workdir, overrides)
        else:
            config = config_lib.load_config(args.config, overrides)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"lhc {args.command}: {error}") from None

    from lhc.train import trainer

    try:  # before any model is built
        config_lib.check_config(config)
        if args.command == "train":
            trainer.check_workdir(args.workdir)
    except ValueError as error:
        raise SystemExit(f"lhc {args.command}: {error}") from None
    if args.command == "eval" and args.step is not None and args.step < 0:
        raise SystemExit(f"lhc eval: --step: expected a step >= 0, got {args.step}")

    if args.command == "train":
        from lhc.train import Interrupted, NonFiniteLossError, WorkdirError, train_and_evaluate

        _show_progress_notes()
        try:
            summary = train_and_evaluate(config, args.workdir, command=shlex.join(["lhc", *argv]))
        except (NonFiniteLossError, WorkdirError) as error:
            raise SystemExit(f"lhc train: {error}") from None
        except Interrupted as error:
            print(f"lhc train: interrupted by {error}", file=sys.stderr)
            return 128 + int(getattr(signal, error.signal_name))
        except KeyboardInterrupt:
            print(
                "lhc train: stopped at once by a second interrupt; run the same command to "
                "resume from the last complete checkpoint",
                file=sys.stderr,
            )
            return 130
        print(json.dumps(summary, indent=2, sort_keys=True))
    elif args.command == "eval":
        from lhc.train import evaluate

        _show_progress_notes()
        try:
            metrics = evaluate(config, args.workdir, args.step, fallback=args.fallback)
        except (FileNotFoundError, ValueError) as error:
            raise SystemExit(f"lhc eval: {error}") from None
        print(json.dumps(metrics, indent=2, sort_keys=True))
    elif args.command == "compile":
        import jax

        from lhc.train.aot import compile_train_step

        try:
            report = compile_train_step(config, args.topology)
        except ValueError as error:
            raise SystemExit(f"lhc compile: {error}") from None
        except jax.errors.JaxRuntimeError as error:
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            # The step does not fit the device's memory: the compiler's one-line reason.
            reason = str(error).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
            raise SystemExit(f"lhc compile: does not fit {args.topology}: {reason}") from None
        print(report.format())
    return 0


class _Stderr(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is when a record comes."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _show_progress_notes() -> None:
    """``lhc``'s own log lines ("resumed from step N", warnings) on the terminal, once
    (not also through a handler some library gave the root logger)."""
    logger = logging.getLogger("lhc")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("lhc: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _generate(args) -> int:
    """Loads the model, generates a reply to each prompt; one prompt is streamed."""
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as handle:
                prompts += [line.rstrip("\n") for line in handle if line.strip()]
        except OSError as error:
            raise SystemExit(f"lhc generate: --prompts-file: {error}") from None
    if not prompts:
        raise SystemExit("lhc generate: give --prompt TEXT (repeatable) or --prompts-file FILE")
    if args.max_new_tokens < 1:
        raise SystemExit(f"lhc generate: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from lhc.lm import SamplingParams, generate_text
    from lhc.train import load_language_model

    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
        kwargs = {} if args.dtype is None else {"dtype": args.dtype}
        checkpoint = load_language_model(args.checkpoint, args.workdir, **kwargs)
        streaming = len(prompts) == 1  # one prompt: its reply is printed as it comes
        replies = generate_text(
            checkpoint,
            prompts,
            chat=args.chat,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
            on_text=(lambda row, text: print(text, end="", flush=True)) if streaming else None,
        )
        if streaming:
            print()
        else:
            for index, reply in enumerate(replies):
                print(f"[{index}] {reply}")
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        raise SystemExit(f"lhc generate: {error}") from None
    return 0


def _demo(workdir: str | None) -> int:
    """Trains the tiny associative-recall LM and prints what it learned."""
    from lhc.train import config as config_lib
    from lhc.train import read_metrics, train_and_evaluate

    config = config_lib.load_config(DEMO_CONFIG)
    workdir = workdir or tempfile.mkdtemp(prefix="lhc-demo-")
    print(f"lhc demo: {DEMO_CONFIG} ({config.task}, {config.data.name}) in {workdir}")
    summary = train_and_evaluate(config, workdir)
    rows = [r for r in read_metrics(workdir) if "train/loss" in r]
    shown = rows[:: max(len(rows) // 8, 1)]
    if rows and shown[-1] is not rows[-1]:
        shown.append(rows[-1])
    print()
    print("| step | train loss | answer accuracy |")
    print("|---:|---:|---:|")
    for row in shown:
        print(f"| {row['step']} | {row['train/loss']:.4f} | {row['train/accuracy']:.3f} |")
    print()
    print(
        f"final eval loss {summary['eval/loss']:.4f} vs chance {summary['eval/chance_loss']:.4f} "
        f"nats; answer accuracy {summary['eval/accuracy']:.3f} "
        f"(chance {1 / config.data.num_values:.3f})"
    )
    print(f"metrics: {os.path.join(workdir, 'metrics.jsonl')}")
    return 0


def run() -> int:
    """The ``lhc`` console script: ``main``, an expected error (``SystemExit`` with a
    message) printed as its one line with exit status 2."""
    try:
        return main()
    except SystemExit as error:
        if isinstance(error.code, str):
            print(error.code, file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(run())
