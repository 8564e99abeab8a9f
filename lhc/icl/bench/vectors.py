"""``lhc bench icl vectors``: Iterative Vectors against the plain few-shot prompt and
Task Vectors, each task with its own extraction, a grid chosen on validation episodes
by macro-F1, and macro-F1 and accuracy on separate test episodes.

On a checkpoint (a Hugging Face directory, a GGUF file or ``smollm2-135m-instruct``),
the word tasks of ``lhc.data.word_tasks`` (``--word-tasks``), each for every
``--seeds`` (a seed draws the task's train / validation / test parts of its inputs,
the episodes and the extraction)::

    lhc bench icl vectors --checkpoint smollm2-135m-instruct --word-tasks \
        sentiment-letters,category-letters --seeds 1,2,3 --shots 2

On a model of ``configs/icl_classification.py`` (``--workdir``), ``--tasks`` generated
tasks (seeds 1..N), their inputs drawn as in its pretraining::

    lhc bench icl vectors --workdir /tmp/iv/model --tasks 3 --shots 1

The default grid (``--ext-shots 1,2``, ``--ext-strengths 0.1,0.5``, ``--strengths
0.01,0.03,0.1,0.3,0.9``; 100 extraction episodes, 64 validation episodes, and one test
episode per test input, each input the query once) is smaller than the released
code's (ext_shot 1-4, both strengths in 0.1..0.9, 200 extraction and 10,000 test
episodes) and reaches lower strengths (on SmolLM2 the best strength was the grid's
lowest, 0.1, in 10 of 12 runs); pass those flags for the full one. ``--results FILE``
keeps one JSON line per task and seed with every test episode's class and each
method's prediction (``experiments/icl/iterative_vectors/report.py`` renders them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Sequence

import numpy as np

from lhc import bench, lm, stats
from lhc.data import word_tasks
from lhc.icl import classification, iterative
from lhc.icl.iterative import Examples, Format


@dataclasses.dataclass
class Case:
    """One task at one seed: its label names, prompt format and the three parts."""

    task: str
    seed: int
    labels: tuple[str, ...]
    fmt: Format
    train: Examples
    validation: Examples
    test: Examples


def generated_case(classes, keywords, input_length, noise, seed) -> Case:
    """The generated task ``seed`` (``lhc.icl.classification.fixed_task``): 400 inputs per
    part, drawn with seeds ``10 seed``, ``10 seed + 1``, ``10 seed + 2``."""
    task = classification.fixed_task(
        seed, classes, keywords=keywords, input_length=input_length, noise=noise
    )
    parts = [classification.split(task, 400, 10 * seed + k) for k in range(3)]
    return Case(str(seed), seed, task.labels, task.format(), *parts)


def word_case(tokenizer, name: str, seed: int) -> Case:
    """The word task ``name`` at ``seed``: its inputs split into disjoint train /
    validation / test parts (``WordTask.part``), each input once per part."""
    task = word_tasks.task(name)
    parts = []
    for which in word_tasks.PARTS:
        part = task.part(which, seed)
        count = sum(len(texts) for texts in part.inputs)
        parts.append(classification.text_split(tokenizer, part, count, seed))
    labels = tuple(label.strip() for label in task.label_texts())
    return Case(name, seed, labels, classification.text_format(tokenizer, task), *parts)


def run_case(model, params, case: Case, args) -> dict:
    """Clean, Task Vectors and Iterative Vectors on one case: a row of the table."""
    # Validation and test episodes from their own streams of the case's seed.
    val = iterative.evaluation_episodes(
        case.validation, args.shots, args.val_episodes, [case.seed, 0]
    )
    num_classes = case.fmt.num_classes
    began = time.perf_counter()
    if args.clean_only:  # choosing tasks: the plain prompt on validation episodes
        predicted = iterative.separator_logits(model, params, case.fmt, val)[0].argmax(-1)
        truth = np.array([q[1] for _, q in val])
        return dict(
            task=case.task,
            seed=case.seed,
            shots=args.shots,
            chance=1 / num_classes,
            val_f1=iterative.macro_f1(predicted, truth, num_classes),
            val_acc=float(np.mean(predicted == truth)),
            seconds=time.perf_counter() - began,
        )
    test = iterative.evaluation_episodes(
        case.test, args.shots, args.test_episodes or None, [case.seed, 1]
    )
    true = np.array([q[1] for _, q in test])

    def score(predicted):
        return iterative.macro_f1(predicted, true, num_classes), float(np.mean(predicted == true))

    with bench.compile_clock() as compiling:
        tv = iterative.TaskVectors.extract(
            model, params, case.fmt, case.train, args.shots, args.episodes, seed=case.seed
        )
        tv_layers = tv.choose_layer(model, params, case.fmt, val)
        # The plain prompt and Task Vectors from one pass over the test prompts.
        plain, patched = tv.layer_logits(model, params, case.fmt, test, [tv.layer]).argmax(-1)
        clean, tvs = score(plain), score(patched)
        best, grid = iterative.grid_search(
            model,
            params,
            case.fmt,
            case.train,
            val,
            ext_shots=tuple(args.ext_shots),
            strengths=tuple(args.strengths),
            ext_strengths=tuple(args.ext_strengths),
            episodes=args.episodes,
            negative_shift=args.negative_shift,
            seed=case.seed,
        )
        iv = iterative.predict(model, params, case.fmt, test, best["vectors"], best["strength"])
        ivs = score(iv)
    return dict(
        task=case.task,
        seed=case.seed,
        labels=list(case.labels),
        chance=1 / num_classes,
        clean_f1=clean[0],
        clean_acc=clean[1],
        tv_f1=tvs[0],
        tv_acc=tvs[1],
        tv_layer=tv.layer,
        tv_val_f1=tv_layers,
        iv_f1=ivs[0],
        iv_acc=ivs[1],
        iv_val_f1=best["macro_f1"],
        ext_shot=best["ext_shot"],
        strength=best["strength"],
        ext_strength=best["ext_strength"],
        grid=grid,
        seconds=time.perf_counter() - began,
        compile_seconds=compiling["seconds"],
        # Per test episode (each test input the query once, unless --test-episodes): its
        # class and each method's prediction, for paired statistics over the inputs.
        test_classes=true.tolist(),
        predicted=dict(clean=plain.tolist(), tv=patched.tolist(), iv=iv.tolist()),
    )


def _means(rows, key: str) -> list[dict]:
    """Mean F1s and accuracies over the rows of each ``key`` value (in first-seen order)."""
    groups = {}
    for row in rows:
        groups.setdefault(row[key], []).append(row)
    fields = ("clean_f1", "clean_acc", "tv_f1", "tv_acc", "iv_f1", "iv_acc")
    return [
        {
            key: name,
            "runs": len(group),
            **{f: float(np.mean([r[f] for r in group])) for f in fields},
        }
        for name, group in groups.items()
    ]


def _tables(rows) -> str:
    shown = [
        dict(
            task=r["task"],
            seed=r["seed"],
            labels=" ".join(r["labels"]),
            clean=f"{r['clean_f1']:.3f} ({r['clean_acc']:.3f})",
            tv=f"{r['tv_f1']:.3f} ({r['tv_acc']:.3f}, {r['tv_layer']})",
            iv=f"{r['iv_f1']:.3f} ({r['iv_acc']:.3f}; {r['ext_shot']}, {r['strength']}, "
            f"{r['ext_strength']})",
        )
        for r in rows
    ]
    columns = [
        ("task", "task"),
        ("seed", "seed"),
        ("labels", "labels"),
        ("clean F1 (acc)", "clean"),
        ("Task Vectors F1 (acc, layer)", "tv"),
        ("Iterative Vectors F1 (acc; ext_shot, strength, ext_strength)", "iv"),
    ]
    means = _means(rows, "task")
    means.append(dict(_overall(rows), task="all"))
    summary = [
        ("task", "task"),
        ("runs", "runs"),
        ("clean F1", "clean_f1", ".3f"),
        ("TV F1", "tv_f1", ".3f"),
        ("IV F1", "iv_f1", ".3f"),
        ("clean acc", "clean_acc", ".3f"),
        ("TV acc", "tv_acc", ".3f"),
        ("IV acc", "iv_acc", ".3f"),
    ]
    return bench.markdown_table(columns, shown) + "\n\n" + bench.markdown_table(summary, means)


def _overall(rows) -> dict:
    return _means([dict(r, all="all") for r in rows], "all")[0]


def merged_table(paths: Sequence[str]) -> dict:
    """The tables of the rows of earlier ``--json`` files (one run per seed, say)."""
    rows = []
    for path in paths:
        try:
            with open(path) as f:
                rows += json.load(f)["rows"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"--merge: {path!r}: {type(error).__name__}: {error}") from None
    if not rows or "iv_f1" not in rows[0]:
        raise SystemExit("--merge: expected the --json files of vectors runs (not --clean-only)")
    print(_tables(rows))
    return dict(rows=rows, mean=_overall(rows), per_task=_means(rows, "task"), merged=list(paths))


def vectors_table(args) -> dict:
    if args.merge:
        return merged_table(args.merge)
    if args.checkpoint is None and args.workdir is None:
        raise SystemExit("lhc bench icl vectors: give --checkpoint, --workdir or --merge")
    if args.checkpoint:
        for name in args.word_tasks:
            try:
                word_tasks.task(name)
            except ValueError as error:
                raise SystemExit(f"--word-tasks: {error}") from None
        loaded = bench.load_model_source(args)
        model, params, step = loaded.model, loaded.params, None
        cases = (
            functools.partial(word_case, loaded.tokenizer, name, seed)
            for name in args.word_tasks
            for seed in args.seeds
        )
        what = f"word tasks {','.join(args.word_tasks)} x seeds {','.join(map(str, args.seeds))}"
    else:
        exp, params, step = bench.restore_run(
            args.workdir, model_type=lm.Transformer, what="configs/icl_classification.py"
        )
        model = exp.task.model
        # The fixed tasks draw inputs as the model's pretraining prompts did.
        data = exp.task.config.data
        noise = float(data.noise if args.noise is None else args.noise)
        cases = (
            functools.partial(
                generated_case,
                args.classes,
                int(data.keywords),
                int(data.input_length),
                noise,
                seed,
            )
            for seed in range(1, args.tasks + 1)
        )
        what = f"{args.tasks} generated tasks of {args.classes} classes"
    print(
        f"model: {args.workdir or args.checkpoint} (step {step}); {what}; {args.shots}-shot, "
        f"{args.episodes} extraction, {args.val_episodes} validation, "
        f"{args.test_episodes or 'one per test input as'} test episodes"
    )
    began = time.perf_counter()
    rows, done, tags = [], set(), {}
    if args.results:
        if not args.checkpoint or args.clean_only:
            raise SystemExit("--results: only with --checkpoint, without --clean-only")
        tags = {"model": args.checkpoint, **bench.provenance(args)}
        for record in stats.read_records(args.results):
            if record.get("model") == args.checkpoint:
                done.add((record["task"], record["seed"], record["shots"]))
                rows.append(record)
    for make in cases:
        case = make()
        if (case.task, case.seed, args.shots) in done:
            continue
        row = run_case(model, params, case, args)
        rows.append(row)
        if tags:
            record = dict(tags, shots=args.shots, episodes=args.episodes, **row)
            stats.append_records(args.results, [record])
        if args.clean_only:
            print(
                f"{row['task']} seed {row['seed']}, {row['shots']}-shot: validation F1 "
                f"{row['val_f1']:.3f}, accuracy {row['val_acc']:.3f} (chance {row['chance']:.3f})",
                flush=True,
            )
            continue
        print(
            f"{row['task']} seed {row['seed']}: clean {row['clean_f1']:.3f}, TV "
            f"{row['tv_f1']:.3f} (layer {row['tv_layer']}), IV {row['iv_f1']:.3f} (ext_shot "
            f"{row['ext_shot']}, strength {row['strength']}, ext_strength "
            f"{row['ext_strength']}); {row['seconds']:.0f} s, compilation "
            f"{row['compile_seconds']:.0f} s",
            flush=True,
        )
    seconds = time.perf_counter() - began
    if args.clean_only:
        columns = [
            ("task", "task"),
            ("seed", "seed"),
            ("shots", "shots"),
            ("chance", "chance", ".3f"),
            ("validation F1", "val_f1", ".3f"),
            ("validation acc", "val_acc", ".3f"),
        ]
        print("\n" + bench.markdown_table(columns, rows) + f"\n\n{seconds:.0f} s in all")
        return dict(checkpoint=args.checkpoint, workdir=args.workdir, rows=rows, seconds=seconds)
    print("\n" + _tables(rows) + f"\n\nmacro-F1 (accuracy); {seconds:.0f} s in all")
    return dict(
        workdir=args.workdir,
        checkpoint=args.checkpoint,
        step=step,
        rows=rows,
        mean=_overall(rows),
        per_task=_means(rows, "task"),
        shots=args.shots,
        seconds=seconds,
    )


def parser():
    p = bench.parser("icl vectors", __doc__)
    bench.add_model_source(
        p, workdir_help="a model of configs/icl_classification.py", required=False
    )
    p.add_argument(
        "--merge",
        type=bench.str_list,
        default=None,
        help="comma-separated --json files of earlier runs: their rows in one table",
    )
    p.add_argument(
        "--word-tasks",
        type=bench.str_list,
        default="sentiment-letters,sentiment-words,case-letters,topic-letters",
        help="with --checkpoint: names from lhc.data.word_tasks.TASKS",
    )
    p.add_argument("--seeds", type=bench.int_list, default="1", help="with --checkpoint")
    p.add_argument("--tasks", type=int, default=3, help="with --workdir: generated tasks 1..N")
    p.add_argument("--classes", type=int, default=4, help="with --workdir")
    p.add_argument(
        "--noise", type=float, default=None, help="with --workdir; default: the run's data.noise"
    )
    p.add_argument("--shots", type=int, default=1, help="demonstrations per class at test")
    p.add_argument("--episodes", type=int, default=100, help="extraction episodes")
    p.add_argument("--val-episodes", type=int, default=64)
    p.add_argument(
        "--test-episodes",
        type=int,
        default=0,
        help="test episodes drawn at random; 0: one per test input, each the query once",
    )
    p.add_argument("--ext-shots", type=bench.int_list, default="1,2")
    p.add_argument("--strengths", type=bench.float_list, default="0.01,0.03,0.1,0.3,0.9")
    p.add_argument(
        "--results",
        default=None,
        help="with --checkpoint: JSON lines, one per task and seed with every test "
        "prediction, appended; a rerun skips the (task, seed, shots) already there",
    )
    p.add_argument("--ext-strengths", type=bench.float_list, default="0.1,0.5")
    p.add_argument("--negative-shift", type=int, default=1)
    p.add_argument(
        "--clean-only",
        action="store_true",
        help="only the plain prompt's macro-F1 and accuracy on validation episodes (to choose "
        "tasks without looking at the test split)",
    )
    return p
