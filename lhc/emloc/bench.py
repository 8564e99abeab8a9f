"""EMLoC: many-shot accuracy against kept context, EMLoC and its baselines.

On a model trained with ``configs/emloc_manyshot.py`` (text or images)::

    lhc bench emloc --workdir /tmp/emloc/text --episodes 8 --queries 20 \
        --chunk-size 4 --deltas 0.001,0.005,0.05

On a pretrained model, text classification tasks of ``lhc.data.word_tasks``
(demonstrations from each task's train part, queries from its test part)::

    lhc bench emloc --checkpoint smollm2-135m-instruct --tasks topic-letters,sentiment-words \
        --shots 64 --episodes 5 --queries 24

Per episode (fresh labels, keywords or prototypes; fresh demonstrations): the
demonstrations are compressed with EMLoC at each ``delta``; uniform pruning,
SnapKV-style pruning and *fewer shots* (the last demonstrations, whole, as many tokens
as EMLoC kept) get the same budget: EMLoC's kept fraction of that episode and delta.
Every method answers the same queries on its memory (greedy next token = the label).
Rows: accuracy, kept fraction, memory of the kept keys and values, seconds of the
compression step with the time JAX spent compiling in it taken out (and that time), per
task, method and delta, means over the episodes.
"""

from __future__ import annotations

import time

import numpy as np

from lhc import bench, lm, stats
from lhc.data import word_tasks
from lhc.emloc import baselines
from lhc.emloc.compress import compress, next_token_logits
from lhc.emloc.config import EMLoCConfig
from lhc.emloc.manyshot import ManyShot, PatchLM, episode, text_episode, with_embeddings


def _accuracy(model, params, memory, queries, answers) -> float:
    logits = np.asarray(next_token_logits(model, params, memory, queries))
    return float(np.mean(np.argmax(logits, axis=-1) == answers))


def _load(workdir: str):
    exp, params, step = bench.restore_run(
        workdir, model_type=PatchLM, what="configs/emloc_manyshot.py"
    )
    model = exp.task.model
    fields = dict(exp.config.data)
    shots = int(fields.pop("shots"))
    fields.pop("name", None), fields.pop("min_shots", None)
    return model, params, ManyShot(**fields), shots, step


def _generated_episodes(model: PatchLM, params, task: ManyShot, shots: int, queries: int):
    """``make(seed) -> (demonstrations, queries, answers)`` of the generated task, with
    the patch encoder's embeddings for images."""

    def make(seed):
        ep = episode(np.random.default_rng(seed), task, shots, queries)
        examples = with_embeddings(model, params, ep.demonstrations + ep.queries, ep.features)
        return examples[:shots], examples[shots:], ep.answers

    return make


def _text_episodes(tokenizer, task: word_tasks.WordTask, shots: int, queries: int, split: int):
    """``make(seed) -> (demonstrations, queries, answers)`` of a word-list task
    (``lhc.emloc.manyshot.text_episode``): demonstrations from its train part,
    queries from its test part (parts drawn with ``split``)."""
    train, test = task.part("train", split), task.part("test", split)
    return lambda seed: text_episode(
        np.random.default_rng(seed), tokenizer, train, shots, queries, query_task=test
    )


def _episode_rows(model, params, make_episode, args, seed) -> list[dict]:
    """Every method's row for one episode (``model`` an ``lhc.lm.Transformer``)."""
    demos, queries, answers = make_episode(seed)
    context = sum(len(d) for d in demos)
    rows = []

    def row(method, delta, make, *args, **kwargs):
        with bench.compile_clock() as compiling:
            began = time.perf_counter()
            made = make(*args, **kwargs)
            seconds = time.perf_counter() - began
        memory = getattr(made, "memory", made)
        kept = float(np.mean(memory.sizes()) / context)
        accuracy = _accuracy(model, params, memory, queries, answers)
        rows.append(
            dict(
                method=method,
                delta=delta,
                accuracy=accuracy,
                kept=kept,
                memory_kib=memory.nbytes() / 1024,
                seconds=seconds - compiling["seconds"],
                compile_seconds=compiling["seconds"],
                context_tokens=context,
            )
        )
        return made

    row("full context", None, baselines.uniform_memory, model, params, demos, 1.0)
    for delta in args.deltas:
        config = EMLoCConfig(chunk_size=args.chunk_size, ratios=tuple(args.ratios), delta=delta)
        compression = row("EMLoC", delta, compress, model, params, demos, config)
        keep = max(compression.kept_fraction(), 1 / context)
        row("uniform", delta, baselines.uniform_memory, model, params, demos, keep)
        snapkv = baselines.snapkv_memory
        row("SnapKV-style", delta, snapkv, model, params, demos, keep, window=args.window)
        budget, shots = keep * context, 0
        while shots < len(demos) and sum(len(d) for d in demos[-(shots + 1) :]) <= budget:
            shots += 1
        fewer = demos[-max(shots, 1) :]
        row("fewer shots", delta, baselines.uniform_memory, model, params, fewer, 1.0)
    return rows


def run(args) -> dict:
    if args.checkpoint:
        # EMLoC's memory keeps different tokens per layer: layers unrolled.
        loaded = bench.load_model_source(args, scan_layers=False)
        args.shots = args.shots or 16
        try:
            tasks = {name: word_tasks.task(name) for name in args.tasks}
        except ValueError as error:
            raise SystemExit(f"--tasks: {error}") from None
        model, params, step, kind = loaded.model, loaded.params, None, "text (word tasks)"
        episodes = {
            name: _text_episodes(loaded.tokenizer, task, args.shots, args.queries, args.seed)
            for name, task in tasks.items()
        }
    else:
        patch_model, patch_params, task, trained_shots, step = _load(args.workdir)
        args.shots = args.shots or trained_shots
        model, params = lm.Transformer(patch_model.config), patch_params["lm"]
        kind = task.modality
        episodes = {
            kind: _generated_episodes(patch_model, patch_params, task, args.shots, args.queries)
        }
    print(
        f"model: {args.workdir or args.checkpoint} (step {step}), {kind}, {args.shots} shots, "
        f"{args.episodes} episodes x {args.queries} queries per task",
        flush=True,
    )
    return dict(
        workdir=args.workdir,
        checkpoint=args.checkpoint,
        step=step,
        **evaluate(model, params, episodes, kind, args),
    )


MEANS = ("accuracy", "kept", "memory_kib", "seconds", "compile_seconds")


def _setting(args) -> dict:
    """What makes an episode's rows comparable with another run's (``--results``)."""
    return dict(
        shots=args.shots, queries=args.queries, chunk_size=args.chunk_size,
        ratios=list(args.ratios), deltas=list(args.deltas), window=args.window,
        seed=args.seed, dtype=args.dtype,
    )  # fmt: skip


def evaluate(model, params, episodes, kind: str, args) -> dict:
    """The table (means per task, method and delta; over all tasks too when there are
    several) and every episode's rows. ``episodes``: ``{task: make(seed)}``."""
    rows, done, tags = [], {}, {}
    if getattr(args, "results", None):
        tags = {"model": args.checkpoint, **bench.provenance(args)}
        setting = _setting(args)
        for record in stats.read_records(args.results):
            if record.get("model") == args.checkpoint and record["setting"] == setting:
                done.setdefault((record["task"], record["episode"]), []).append(record)
    for task, make_episode in episodes.items():
        for index in range(args.episodes):
            if (task, index) in done:
                rows += done[(task, index)]
                continue
            made = _episode_rows(model, params, make_episode, args, seed=args.seed + index)
            made = [dict(row, task=task, episode=index) for row in made]
            rows += made
            if tags:
                records = [dict(tags, setting=setting, **row) for row in made]
                stats.append_records(args.results, records)
            print(f"{task}: episode {index + 1}/{args.episodes} done", flush=True)
    groups = list(episodes) + (["all"] if len(episodes) > 1 else [])
    table = []
    for task in groups:
        of_task = [r for r in rows if task in ("all", r["task"])]
        keys = sorted({(r["method"], r["delta"]) for r in of_task}, key=lambda k: (k[1] or 0, k[0]))
        for method, delta in keys:
            group = [r for r in of_task if r["method"] == method and r["delta"] == delta]
            means = {k: float(np.mean([r[k] for r in group])) for k in MEANS}
            table.append(dict(task=task, method=method, delta=delta, episodes=len(group), **means))
    columns = [
        ("task", "task"),
        ("method", "method"),
        ("delta", "delta", "g"),
        ("accuracy", "accuracy", ".3f"),
        ("kept", "kept", ".3f"),
        ("memory (KiB)", "memory_kib", ".1f"),
        ("compression (s)", "seconds", ".2f"),
        ("compiling (s)", "compile_seconds", ".1f"),
    ]
    shown = [dict(t, delta="—") if t["delta"] is None else t for t in table]
    print("\n" + bench.markdown_table(columns, shown))
    return dict(
        modality=kind,
        tasks=list(episodes),
        shots=args.shots,
        episodes=args.episodes,
        queries=args.queries,
        chunk_size=args.chunk_size,
        ratios=list(args.ratios),
        table=table,
        rows=rows,
    )


def _parser():
    p = bench.parser("emloc", __doc__)
    bench.add_model_source(p, workdir_help="a model of configs/emloc_manyshot.py")
    p.add_argument(
        "--tasks",
        type=bench.str_list,
        default="topic-letters",
        help="with --checkpoint: word-list tasks of lhc.data.word_tasks (comma-separated)",
    )
    p.add_argument(
        "--shots", type=int, default=0, help="default: the training shots (16 with --checkpoint)"
    )
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--chunk-size", type=int, default=4, help="demonstrations per chunk")
    p.add_argument("--deltas", type=bench.float_list, default="0.001,0.005,0.05")
    p.add_argument("--ratios", type=bench.float_list, default="0.1,0.2,0.5")
    p.add_argument("--window", type=int, default=8, help="SnapKV's observation window")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument(
        "--results",
        default=None,
        help="with --checkpoint: JSON lines, every method's row of each episode, appended; "
        "a rerun with the same settings skips the episodes already there",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.results and not args.checkpoint:
        parser.error("--results: expected with --checkpoint")
    return bench.finish(run(args), args)


if __name__ == "__main__":
    main()
