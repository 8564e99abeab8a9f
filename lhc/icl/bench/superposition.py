"""``lhc bench icl superposition``: task superposition of a model trained from scratch
(``configs/icl_superposition.py``), each task's answer probability against the
proportion d of the first task::

    lhc bench icl superposition --workdir /tmp/sup/bias_add --prompts 50

The paper's task families on a checkpoint (a Hugging Face directory, a GGUF file or
``smollm2-135m-instruct``; ``lhc.icl.mixtures``): every task's probability, of its
answer's first token and of the whole answer with its line end, each prompt prefilled
once and its answers scored on copies of the cache. ``--single-task`` runs each task
alone (accuracy); ``--points N`` sweeps the share d of the first of ``--tasks`` (the
others sharing 1 - d); without it, the even mixture::

    lhc bench icl superposition --checkpoint smollm2-135m-instruct --family case,numbers \
        --single-task --demos 32 --prompts 16
    lhc bench icl superposition --checkpoint smollm2-135m-instruct --family case \
        --tasks copy,upper --points 5 --demos 32 --prompts 32
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

from lhc import bench, lm, stats
from lhc.icl import mixtures, taskvectors
from lhc.icl.families import get_family
from lhc.icl.scoring import continuation_logprobs, kl_to_proportions, with_other
from lhc.icl.shared_prefix import score_answers
from lhc.icl.superposition import NEWLINE, SEPARATOR, mixture_prompt, superposition_curve


def ascii_plot(xs, series: dict[str, np.ndarray], height: int = 11) -> str:
    """A text plot of each series (values in [0, 1]) against ``xs``: one letter per series."""
    width = len(xs)
    grid = [[" "] * width for _ in range(height)]
    for mark, values in zip("ABCDEFGH", series.values()):
        for i, v in enumerate(values):
            row = height - 1 - int(round(float(np.clip(v, 0, 1)) * (height - 1)))
            grid[row][i] = mark if grid[row][i] == " " else "*"
    lines = [f"{1 - r / (height - 1):4.1f} |" + "  ".join(row) for r, row in enumerate(grid)]
    lines.append("     +" + "-" * (3 * width - 2))
    lines.append("      " + " ".join(f"{round(10 * float(x)):<2d}" for x in xs) + "  (10 d)")
    legend = ", ".join(f"{m} = {name}" for m, name in zip("ABCDEFGH", series))
    return "\n".join(lines + [f"      {legend}; * = overlap"])


def scratch_curve(args) -> dict:
    exp, params, step = bench.restore_run(
        args.workdir, model_type=lm.Transformer, what="configs/icl_superposition.py"
    )
    task = exp.task.scratch_task()
    params_pair = tuple(args.task_params)
    proportions = np.round(np.linspace(0, 1, args.points), 3)
    began = time.perf_counter()
    curve = superposition_curve(
        exp.task.model,
        params,
        task,
        proportions,
        prompts=args.prompts,
        seed=args.seed,
        task_params=params_pair,
        demos=args.demos or None,
    )
    seconds = time.perf_counter() - began
    names = [f"{task.kind}({p})" for p in params_pair]
    print(
        f"model: {args.workdir} (step {step}), {task.kind}, {args.demos or task.demos} "
        f"demonstrations, {args.prompts} prompts per proportion, {seconds:.0f} s"
    )
    rows, shown = [], []
    for i, d in enumerate(curve["proportion"]):
        mean, std = curve["mean"][i], curve["std"][i]
        kl = float(kl_to_proportions(mean, [d, 1 - d]))
        rows.append(
            dict(
                d=float(d),
                realised=float(curve["realised"][i]),
                first=float(mean[0]),
                second=float(mean[1]),
                first_std=float(std[0]),
                second_std=float(std[1]),
                kl=kl,
                both=float(curve["both"][i]),
            )
        )
        shown.append(
            dict(
                rows[-1],
                first=f"{mean[0]:.3f} ± {std[0]:.3f}",
                second=f"{mean[1]:.3f} ± {std[1]:.3f}",
                other=float(with_other(mean)[-1]),
            )
        )
    columns = [("d", "d", ".1f"), ("realised", "realised", ".2f"),
               (f"P({names[0]})", "first"), (f"P({names[1]})", "second"),
               ("other", "other", ".3f"), ("KL", "kl", ".3f"),
               ("both >= 0.1", "both", ".2f")]  # fmt: skip
    print("\n" + bench.markdown_table(columns, shown))
    print("\n" + ascii_plot(curve["proportion"], dict(zip(names, curve["mean"].T))))
    result = dict(workdir=args.workdir, step=step, kind=task.kind, rows=rows)
    if args.task_vectors:
        result["task_vectors"] = scratch_task_vectors(
            exp.task.model, params, task, params_pair, proportions, names, args
        )
    return result


def scratch_task_vectors(model, params, task, pair, proportions, names, args) -> dict:
    """Task vectors of the two tasks (mean residual at the query separator of
    single-task prompts), the best layer for each on zero-shot queries, and the convex
    combination (1 - w) v_B + w v_A patched into zero-shot queries at w = d."""
    rng = np.random.default_rng(args.seed + 1)
    prompts = {
        p: [mixture_prompt(rng, task, 1.0, (p, pair[1 - i])).tokens for _ in range(args.prompts)]
        for i, p in enumerate(pair)
    }
    vectors = np.stack([taskvectors.task_vector(model, params, prompts[p]) for p in pair])
    queries, answers = [], []
    for _ in range(args.prompts):
        inputs = task.sample_input(rng)
        while task.answer(inputs, pair[0]) == task.answer(inputs, pair[1]):
            inputs = task.sample_input(rng)
        queries.append(np.concatenate([inputs, [SEPARATOR]]))
        answers.append([[task.answer(inputs, p), NEWLINE] for p in pair])
    layers = [
        taskvectors.best_layer(model, params, vectors[i], queries, answers, task=i)
        for i in range(2)
    ]
    layer = int(np.argmax(layers[0][1] + layers[1][1]))  # best for both together
    print(
        f"\ntask vectors: zero-shot answer probability per layer: {names[0]} "
        f"{np.round(layers[0][1], 3).tolist()}, {names[1]} {np.round(layers[1][1], 3).tolist()}; "
        f"composed at layer {layer}"
    )
    rows = []
    for w in proportions:
        mixed = taskvectors.compose(vectors, [w, 1 - w])
        probs = taskvectors.patched_probabilities(model, params, mixed, layer, queries, answers)
        mean = probs.mean(0)
        rows.append(dict(w=float(w), first=float(mean[0]), second=float(mean[1])))
    columns = [
        ("w", "w", ".1f"),
        (f"P({names[0]})", "first", ".3f"),
        (f"P({names[1]})", "second", ".3f"),
    ]
    print("\n" + bench.markdown_table(columns, rows))
    return dict(layer=layer, per_layer=[scores.tolist() for _, scores in layers], rows=rows)


def _probability_table(tasks, rows, kind: str) -> str:
    """One row per mixture: the first task's share, each task's mean probability, "other",
    the KLs, the spread and (first tokens) the top-K share."""
    shown = []
    for row in rows:
        stats = row[kind]
        cells = {f"p{i}": m for i, m in enumerate(stats["mean"])}
        shown.append(
            dict(
                cells,
                d=row["proportions"][0],
                other=stats["other"],
                kl=stats["kl"],
                kl_within=stats["kl_within"],
                spread=stats["spread"],
                top=row["top"] if kind == "first" else None,
            )
        )
    columns = [("d", "d", ".2f")] + [(f"P({t})", f"p{i}", ".3f") for i, t in enumerate(tasks)]
    columns += [("other", "other", ".3f"), ("KL", "kl", ".2f"),
                ("KL within", "kl_within", ".3f"), ("spread", "spread", ".2f")]  # fmt: skip
    if kind == "first":
        columns.append(("top-K", "top", ".2f"))
    return bench.markdown_table(columns, shown)


def _calibration_line(tasks, calibration: dict) -> str:
    grows = ", ".join(
        f"{t} {'monotone' if m else 'grows' if g else 'does not grow'}"
        for t, g, m in zip(tasks, calibration["grows"], calibration["monotone"])
    )
    return f"calibration: {grows}; r {calibration['r']:.2f}, slope {calibration['slope']:.2f}"


def _timing_line(name: str, rows, compile_seconds: float) -> str:
    """The first call compiles; the others show the steady cost."""
    seconds = [row["seconds"] for row in rows]
    rest = f", the others {np.mean(seconds[1:]):.1f} s each" if len(seconds) > 1 else ""
    return (
        f"{name}: {len(rows)} mixtures, prompts padded to {rows[0]['width']} tokens; "
        f"first {seconds[0]:.1f} s (compilation {compile_seconds:.1f} s){rest}; "
        f"{sum(seconds):.0f} s in all"
    )


def _single_task_table(args, model, params, tokenizer) -> dict:
    result, shown = {}, []
    for name in args.family:
        family = get_family(name)
        with bench.compile_clock() as compiling:
            result[name] = mixtures.single_task(
                model,
                params,
                tokenizer,
                family,
                num_demos=args.demos or 60,
                prompts=args.prompts,
                seed=args.seed,
                batch=args.batch,
            )
        rows = list(result[name].values())
        print(_timing_line(name, rows, compiling["seconds"]), flush=True)
        for task, row in result[name].items():
            shown.append(
                dict(
                    family=name,
                    task=task,
                    first=row["first"]["mean"][0],
                    first_acc=row["first_accuracy"][0],
                    full=row["full"]["mean"][0],
                    greedy=row["greedy_accuracy"][0],
                    alone="yes" if row["greedy_accuracy"][0] >= 0.5 else "no",
                )
            )
    columns = [("family", "family"), ("task", "task"), ("P(first token)", "first", ".3f"),
               ("first-token acc", "first_acc", ".2f"), ("P(answer)", "full", ".3f"),
               ("greedy acc", "greedy", ".2f"), ("alone (greedy >= 0.5)", "alone")]  # fmt: skip
    print("\nsingle-task prompts (every demonstration of the task):\n")
    print(bench.markdown_table(columns, shown))
    return result


def family_table(args) -> dict:
    """The paper's families on a checkpoint: the single tasks (``--single-task``), the
    proportion sweep (``--points``) or the even mixture."""
    if args.tasks and len(args.family) != 1:
        raise SystemExit(f"--tasks: expected one --family, got {len(args.family)}")
    for name in args.family:
        try:
            family = get_family(name)
        except ValueError as error:
            raise SystemExit(f"--family: {error}") from None
    if args.tasks and (len(set(args.tasks)) < 2 or not set(args.tasks) <= set(family.tasks)):
        raise SystemExit(
            f"--tasks: expected two or more distinct tasks of family {family.name!r} "
            f"({', '.join(family.tasks)}), got {','.join(args.tasks)}"
        )
    ckpt = bench.load_model_source(args)
    model, params = ckpt.model, ckpt.params
    tokenizer = lm.load_tokenizer(args.tokenizer) if args.tokenizer else ckpt.tokenizer
    demos = args.demos or 60
    print(f"model: {args.checkpoint}; {demos} demonstrations, {args.prompts} prompts per mixture")
    began = time.perf_counter()
    if args.single_task:
        result = _single_task_table(args, model, params, tokenizer)
    else:
        result = {}
        tags = {"model": args.checkpoint, **bench.provenance(args)} if args.results else {}
        done = {
            (r["family"], tuple(r["tasks"]), r["seed"], r["prompts"], r["demos"])
            for r in (stats.read_records(args.results) if args.results else [])
            if r.get("model") == args.checkpoint
        }
        for name in args.family:
            family = get_family(name)
            tasks = tuple(args.tasks or family.tasks)
            if (name, tasks, args.seed, args.prompts, demos) in done:
                print(f"{name} {','.join(tasks)} seed {args.seed}: in {args.results}, skipped")
                continue
            points = _Points(args, name, tasks, demos) if tags else None
            result[name] = _family_sweep(args, model, params, tokenizer, family, demos, points)
            if tags:
                record = {
                    **tags, **result[name], "family": name, "tasks": list(tasks),
                    "seed": args.seed, "prompts": args.prompts, "demos": demos,
                }  # fmt: skip
                stats.append_records(args.results, [record])
                points.clear()
    print(f"\n{time.perf_counter() - began:.0f} s")
    return result


class _Points:
    """The finished points of a sweep not yet in ``--results``, in ``RESULTS.points``
    (a point of 64 prompts on a real model takes minutes; a sweep of five, an hour):
    a sweep interrupted and run again measures only the points it lacks."""

    def __init__(self, args, family: str, tasks, demos: int):
        self.path = f"{args.results}.points"
        self.sweep = dict(
            model=args.checkpoint, family=family, tasks=list(tasks), seed=args.seed,
            prompts=args.prompts, demos=demos, points=args.points,
        )  # fmt: skip
        self.done = {
            r["point"]: r["row"] for r in stats.read_records(self.path) if r["sweep"] == self.sweep
        }
        if self.done:
            print(f"{family}: points {sorted(self.done)} from {self.path}", flush=True)

    def add(self, index: int, row: dict) -> None:
        stats.append_records(self.path, [{"sweep": self.sweep, "point": index, "row": row}])

    def clear(self) -> None:
        """Drops this sweep's points (its record is in ``--results`` now)."""
        rest = [r for r in stats.read_records(self.path) if r["sweep"] != self.sweep]
        if os.path.exists(self.path):
            os.remove(self.path)
        stats.append_records(self.path, rest)


def _family_sweep(args, model, params, tokenizer, family, demos, points=None) -> dict:
    tasks = list(args.tasks or family.tasks)
    shares = np.linspace(0, 1, args.points) if args.points else [1 / len(tasks)]
    try:
        with bench.compile_clock() as compiling:
            result = mixtures.sweep(
                model,
                params,
                tokenizer,
                family,
                tasks,
                shares,
                num_demos=demos,
                prompts=args.prompts,
                seed=args.seed,
                batch=args.batch,
                done=points.done if points else None,
                on_row=points.add if points else None,
            )
    except ValueError as error:
        raise SystemExit(f"--family {family.name}: {error}") from None
    print(f"\n{family.name}: d = share of {tasks[0]}, the others (1 - d) / {len(tasks) - 1}")
    for kind, title in (("first", "first token"), ("full", "full answer and line end")):
        print(f"\n{title}:\n\n" + _probability_table(tasks, result["rows"], kind))
        if len(shares) > 1:
            print(_calibration_line(tasks, result["calibration"][kind]))
    result["compile_seconds"] = compiling["seconds"]
    print("\n" + _timing_line(family.name, result["rows"], compiling["seconds"]), flush=True)
    if args.baseline:
        first = result["rows"][0]["proportions"]
        result["baseline"] = _separate_baseline(
            args, model, params, tokenizer, family, tasks, first, demos
        )
    if len(shares) == 1:  # the even mixture, as the bench reported it before the sweep
        row = result["rows"][0]
        result.update(mean=row["full"]["mean"], kl=row["full"]["kl"], top=row["top"])
    return result


def _separate_baseline(args, model, params, tokenizer, family, tasks, proportions, demos):
    """The first ``--batch`` prompts (at most ``--prompts``) of the first mixture scored
    both ways: each prompt prefilled once (``score_answers``) and each prompt + answer run
    separately (``continuation_logprobs``, as the bench did before); the best of
    ``--repeats`` calls of each, in turn, after a compiling call."""
    groups = [(tasks, proportions)]
    count = min(args.batch, args.prompts)
    (group,) = mixtures.draw(tokenizer, family, groups, demos, count, args.seed)
    prompts, answers = [p.tokens for p in group], [p.answers for p in group]
    flat_prompts = [p for p, group in zip(prompts, answers) for _ in group]
    flat_answers = [a for group in answers for a in group]
    scores = {}

    def shared():
        scores["shared"] = score_answers(model, params, prompts, answers, batch_size=args.batch)

    def separate():
        scores["separate"] = continuation_logprobs(
            model, params, flat_prompts, flat_answers, batch_size=args.batch
        )

    seconds = bench.interleaved_best({"separate": separate, "shared": shared}, args.repeats)
    difference = float(np.abs(scores["shared"].logprobs.ravel() - scores["separate"]).max())
    print(
        f"\nbaseline: {len(prompts)} prompts of d = {proportions[0]:.2f}, best of "
        f"{args.repeats}: each prompt + answer run separately {seconds['separate']:.1f} s, "
        f"shared prefix {seconds['shared']:.1f} s ({seconds['separate'] / seconds['shared']:.2f}x); "
        f"largest |log p(answer)| difference {difference:.1e}"
    )
    return dict(
        separate_seconds=seconds["separate"],
        shared_seconds=seconds["shared"],
        largest_difference=difference,
    )


def parser():
    p = bench.parser(
        "icl superposition",
        "Task superposition: each task's answer probability "
        "against the proportion d of the first (--workdir), or the paper's task "
        "families on an imported checkpoint (--checkpoint).",
    )
    bench.add_model_source(p, workdir_help="a model of configs/icl_superposition.py")
    p.add_argument("--tokenizer", default=None, help="default: the checkpoint's")
    p.add_argument(
        "--family",
        type=bench.str_list,
        default="addition",
        help="with --checkpoint: comma-separated family names",
    )
    p.add_argument(
        "--tasks",
        type=bench.str_list,
        default=None,
        help="with --checkpoint and one --family: the tasks mixed (default: all of the "
        "family's); --points sweeps the first one's share",
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help="with --checkpoint: also time the first --batch prompts of the first mixture "
        "scored with every prompt + answer run separately, and compare the scores",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each --baseline")
    p.add_argument(
        "--single-task",
        action="store_true",
        help="with --checkpoint: each task of each family alone (accuracy table)",
    )
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument(
        "--demos", type=int, default=0, help="default: the training prompts' (60 with --checkpoint)"
    )
    p.add_argument(
        "--points",
        type=int,
        default=None,
        help="proportions d in [0, 1] (default 11 with --workdir; with --checkpoint the "
        "even mixture unless given)",
    )
    p.add_argument(
        "--task-params",
        type=bench.index_list,
        default="2,6",
        help="the two tasks' hidden parameters",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--task-vectors",
        action="store_true",
        help="from scratch: also compose the two tasks' vectors",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--results",
        default=None,
        help="with --checkpoint and --points: JSON lines, one per family, tasks and seed "
        "with every prompt's probabilities, appended; a rerun skips the sweeps already there",
    )
    return p


def parse_args(argv: Sequence[str]):
    """Parsed and checked: counts in range, checkpoint-only flags only with --checkpoint."""
    command_line = parser()
    args = command_line.parse_args(argv)
    bounds = {
        "--prompts": (args.prompts, 1),
        "--demos": (args.demos, 0),
        "--batch": (args.batch, 1),
        "--repeats": (args.repeats, 1),
        "--points": (args.points, 2),
    }
    for flag, (value, least) in bounds.items():
        if value is not None and value < least:
            command_line.error(f"{flag}: expected an integer >= {least}, got {value}")
    if args.workdir and (args.tasks or args.single_task):
        command_line.error("--tasks and --single-task: expected with --checkpoint, got --workdir")
    if args.single_task and (args.tasks or args.points or args.baseline):
        command_line.error(
            "--single-task: expected without --tasks, --points and --baseline (it runs every task)"
        )
    if args.workdir and args.baseline:
        command_line.error("--baseline: expected with --checkpoint, got --workdir")
    if args.results and (args.workdir or args.single_task or not args.points):
        command_line.error("--results: expected with --checkpoint and --points")
    if args.workdir and args.points is None:
        args.points = 11
    return args


def run(args) -> dict:
    """The families on a checkpoint (``--checkpoint``) or the from-scratch curve."""
    return family_table(args) if args.checkpoint else scratch_curve(args)
