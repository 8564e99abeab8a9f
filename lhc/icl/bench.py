"""``lhc bench icl-superposition`` and ``lhc bench icl-vectors``.

Task superposition of a model trained from scratch (``configs/icl_superposition.py``):
each task's answer probability against the proportion d of the first task::

    lhc bench icl-superposition --workdir /tmp/sup/bias_add --prompts 50

The paper's task families on an imported Hugging Face checkpoint (answer probability of
every task, "other", KL to the in-context proportions)::

    lhc bench icl-superposition --checkpoint ~/Llama-3.1-8B --family addition,country \
        --demos 60 --prompts 100

Iterative Vectors against the plain prompt and Task Vectors on generated classification
tasks, with a model of ``configs/icl_classification.py``::

    lhc bench icl-vectors --workdir /tmp/iv/model --tasks 3 --shots 1
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import numpy as np

from lhc.data import topics
from lhc.icl import classification, iterative, taskvectors
from lhc.icl.families import get_family, superposition_prompt
from lhc.icl.scoring import answer_probabilities, kl_to_proportions, with_other
from lhc.icl.superposition import NEWLINE, SEPARATOR, mixture_prompt, superposition_curve


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _restore(workdir: str):
    from lhc.train.trainer import restore_params

    exp, params, step = restore_params(None, workdir)
    return exp, params, step


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
    exp, params, step = _restore(args.workdir)
    task = exp.task.scratch_task()
    params_pair = tuple(int(x) for x in args.task_params.split(","))
    proportions = np.round(np.linspace(0, 1, args.points), 3)
    began = time.perf_counter()
    curve = superposition_curve(exp.task.model, params, task, proportions, prompts=args.prompts,
                                seed=args.seed, task_params=params_pair,
                                demos=args.demos or None)  # fmt: skip
    seconds = time.perf_counter() - began
    names = [f"{task.kind}({p})" for p in params_pair]
    print(f"model: {args.workdir} (step {step}), {task.kind}, {args.demos or task.demos} "
          f"demonstrations, {args.prompts} prompts per proportion, {seconds:.0f} s")  # fmt: skip
    print(f"\n| d | realised | P({names[0]}) | P({names[1]}) | other | KL | both >= 0.1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for i, d in enumerate(curve["proportion"]):
        mean = curve["mean"][i]
        kl = float(kl_to_proportions(mean, [d, 1 - d]))
        rows.append(dict(d=float(d), realised=float(curve["realised"][i]), first=float(mean[0]),
                         second=float(mean[1]), first_std=float(curve["std"][i][0]),
                         second_std=float(curve["std"][i][1]), kl=kl,
                         both=float(curve["both"][i])))  # fmt: skip
        print(f"| {d:.1f} | {curve['realised'][i]:.2f} | {mean[0]:.3f} ± "
              f"{curve['std'][i][0]:.3f} | {mean[1]:.3f} ± {curve['std'][i][1]:.3f} | "
              f"{with_other(mean)[-1]:.3f} | {kl:.3f} | {curve['both'][i]:.2f} |")  # fmt: skip
    print("\n" + ascii_plot(curve["proportion"], dict(zip(names, curve["mean"].T))))
    result = dict(workdir=args.workdir, step=step, kind=task.kind, rows=rows)
    if args.task_vectors:
        result["task_vectors"] = scratch_task_vectors(exp.task.model, params, task, params_pair,
                                                      proportions, names, args)  # fmt: skip
    return result


def scratch_task_vectors(model, params, task, pair, proportions, names, args) -> dict:
    """Task vectors of the two tasks (mean residual at the query separator of
    single-task prompts), the best layer for each on zero-shot queries, and the convex
    combination (1 - w) v_B + w v_A patched into zero-shot queries at w = d."""
    rng = np.random.default_rng(args.seed + 1)
    prompts = {p: [mixture_prompt(rng, task, 1.0, (p, pair[1 - i])).tokens
                   for _ in range(args.prompts)] for i, p in enumerate(pair)}  # fmt: skip
    vectors = np.stack([taskvectors.task_vector(model, params, prompts[p]) for p in pair])
    queries, answers = [], []
    for _ in range(args.prompts):
        inputs = task.sample_input(rng)
        while task.answer(inputs, pair[0]) == task.answer(inputs, pair[1]):
            inputs = task.sample_input(rng)
        queries.append(np.concatenate([inputs, [SEPARATOR]]))
        answers.append([[task.answer(inputs, p), NEWLINE] for p in pair])
    layers = [taskvectors.best_layer(model, params, vectors[i], queries, answers, task=i)
              for i in range(2)]  # fmt: skip
    layer = int(np.argmax(layers[0][1] + layers[1][1]))  # best for both together
    print(f"\ntask vectors: zero-shot answer probability per layer: {names[0]} "
          f"{np.round(layers[0][1], 3).tolist()}, {names[1]} {np.round(layers[1][1], 3).tolist()}; "
          f"composed at layer {layer}")  # fmt: skip
    print(f"\n| w | P({names[0]}) | P({names[1]}) |")
    print("|---:|---:|---:|")
    rows = []
    for w in proportions:
        mixed = taskvectors.compose(vectors, [w, 1 - w])
        probs = taskvectors.patched_probabilities(model, params, mixed, layer, queries, answers)
        mean = probs.mean(0)
        rows.append(dict(w=float(w), first=float(mean[0]), second=float(mean[1])))
        print(f"| {w:.1f} | {mean[0]:.3f} | {mean[1]:.3f} |")
    return dict(layer=layer, per_layer=[scores.tolist() for _, scores in layers], rows=rows)


def _answer_tokens(tokenizer, text: str, answer: str) -> list[int]:
    """The answer's tokens as the model sees them after ``text`` (the tail of the joint
    encoding when it extends the prompt's, else the answer alone)."""
    prompt, joint = tokenizer.encode(text), tokenizer.encode(text + answer)
    if joint[: len(prompt)] == prompt and len(joint) > len(prompt):
        return joint[len(prompt) :]
    return tokenizer.encode(answer)


def family_table(args) -> dict:

    from lhc import lm
    from lhc.train import load_language_model

    try:
        ckpt = load_language_model(args.checkpoint, dtype=args.dtype)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        raise SystemExit(f"--checkpoint: {error}") from None
    model, params = ckpt.model, ckpt.params
    tokenizer = lm.load_tokenizer(args.tokenizer) if args.tokenizer else ckpt.tokenizer
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    rng = np.random.default_rng(args.seed)
    result = {}
    print(f"model: {args.checkpoint}; {args.demos} demonstrations, {args.prompts} prompts")
    for name in args.family.split(","):
        family = get_family(name)
        proportions = {t: 1 / len(family.tasks) for t in family.tasks}
        prompts, answers = [], []
        for _ in range(args.prompts):
            prompt = superposition_prompt(rng, family, proportions, args.demos)
            prompts.append(bos + tokenizer.encode(prompt.text))
            answers.append([_answer_tokens(tokenizer, prompt.text, prompt.answers[t])
                            for t in family.tasks])  # fmt: skip
        probs = answer_probabilities(model, params, prompts, answers, batch_size=args.batch)
        kl = kl_to_proportions(probs, [proportions[t] for t in family.tasks])
        top = np.mean([set(np.argsort(-p)[: len(p)]) == set(range(len(p))) for p in probs])
        mean = probs.mean(0)
        print(f"\n{name}: " + ", ".join(f"P({t}) {m:.3f}" for t, m in zip(family.tasks, mean))
              + f", other {with_other(mean)[-1]:.3f}; KL {kl.mean():.3f}")  # fmt: skip
        result[name] = dict(tasks=list(family.tasks), mean=mean.tolist(), kl=float(kl.mean()),
                            top=float(top))  # fmt: skip
    return result


def superposition_main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="lhc bench icl-superposition",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--workdir", help="a model of configs/icl_superposition.py")
    p.add_argument("--checkpoint",
                   help="a Hugging Face directory, a .gguf file or smollm2-135m-instruct (with --family)")  # fmt: skip
    p.add_argument("--tokenizer", default=None, help="default: the checkpoint's")
    p.add_argument("--family", default="addition", help="comma-separated family names")
    p.add_argument("--dtype", default=None, help="for --checkpoint (float32 on CPU, else bfloat16)")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--demos", type=int, default=0, help="default: the training prompts'")
    p.add_argument("--points", type=int, default=11, help="proportions in [0, 1]")
    p.add_argument("--task-params", default="2,6", help="the two tasks' hidden parameters")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--task-vectors", action="store_true",
                   help="from scratch: also compose the two tasks' vectors")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if bool(args.workdir) == bool(args.checkpoint):
        raise SystemExit("give exactly one of --workdir (from scratch) and --checkpoint")
    if args.checkpoint:
        args.demos = args.demos or 60
        result = family_table(args)
    else:
        result = scratch_curve(args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


def _generated_task(classes, keywords, input_length, noise, seed):
    """``(labels, format, split(count, seed))`` of the generated task ``seed``."""
    task = classification.fixed_task(seed, classes, keywords=keywords,
                                     input_length=input_length, noise=noise)  # fmt: skip
    return task.labels, task.format(), functools.partial(classification.split, task)


def _topic_task(tokenizer, classes, labels, seed):
    """``(labels, format, split(count, seed))`` of ``classes`` English topics drawn with
    ``seed`` (``lhc.data.topics``) in ``tokenizer``'s tokens."""
    names = np.random.default_rng(seed).choice(sorted(topics.TOPICS), classes, replace=False)
    task = topics.TopicTask(tuple(str(n) for n in names), labels)
    split = functools.partial(classification.text_split, tokenizer, task)
    shown = [f"{text.strip()}={topic}" for text, topic in zip(task.label_texts(), task.topics)]
    return tuple(shown), classification.text_format(tokenizer, task), split


def vectors_main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="lhc bench icl-vectors", description="Iterative Vectors")
    p.add_argument("--workdir", help="a model of configs/icl_classification.py")
    p.add_argument("--checkpoint",
                   help="a Hugging Face directory, a .gguf file or smollm2-135m-instruct: "
                   "English topic classification (lhc.data.topics) instead")  # fmt: skip
    p.add_argument("--labels", default="letters", choices=("letters", "names"),
                   help="--checkpoint: arbitrary labels (A, B, ...) or the topics' names")  # fmt: skip
    p.add_argument("--tasks", type=int, default=3, help="generated tasks (seeds 1..N)")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--noise", type=float, default=None, help="default: the run's data.noise")
    p.add_argument("--shots", type=int, default=1, help="demonstrations per class at test")
    p.add_argument("--episodes", type=int, default=200, help="extraction episodes")
    p.add_argument("--val-episodes", type=int, default=200)
    p.add_argument("--test-episodes", type=int, default=1000)
    p.add_argument("--ext-shots", type=_floats, default=(1, 2, 3, 4))
    p.add_argument("--strengths", type=_floats, default=(0.1, 0.3, 0.5, 0.7, 0.9))
    p.add_argument("--ext-strengths", type=_floats, default=(0.1, 0.3, 0.5, 0.7, 0.9))
    p.add_argument("--negative-shift", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if bool(args.workdir) == bool(args.checkpoint):
        raise SystemExit("give exactly one of --workdir and --checkpoint")
    source = args.workdir or args.checkpoint
    if args.checkpoint:
        from lhc.train import load_language_model

        try:
            loaded = load_language_model(args.checkpoint)
        except (FileNotFoundError, ValueError, RuntimeError) as error:
            raise SystemExit(f"--checkpoint: {error}") from None
        model, params, step = loaded.model, loaded.params, None
        make_task = functools.partial(_topic_task, loaded.tokenizer, args.classes, args.labels)
    else:
        exp, params, step = _restore(args.workdir)
        model = exp.task.model
        # The fixed tasks draw inputs as the model's pretraining prompts did.
        data = exp.task.config.data
        noise = float(data.noise if args.noise is None else args.noise)
        make_task = functools.partial(
            _generated_task, args.classes, int(data.keywords), int(data.input_length), noise
        )
    print(f"model: {source} (step {step}); {args.tasks} tasks of {args.classes} classes, "
          f"{args.shots}-shot, {args.test_episodes} test episodes")  # fmt: skip
    rows = []
    for seed in range(1, args.tasks + 1):
        labels, fmt, split = make_task(seed)
        train = split(400, 10 * seed)
        val = iterative.evaluation_episodes(split(400, 10 * seed + 1), args.shots,
                                            args.val_episodes, seed)  # fmt: skip
        test = iterative.evaluation_episodes(split(400, 10 * seed + 2), args.shots,
                                             args.test_episodes, seed)  # fmt: skip
        num_classes = len(labels)
        true = np.array([q[1] for _, q in test])

        def score(predicted, true=true, classes=num_classes):
            return iterative.macro_f1(predicted, true, classes), float(np.mean(predicted == true))

        began = time.perf_counter()
        clean = score(iterative.predict(model, params, fmt, test))
        tv = iterative.TaskVectors.extract(model, params, fmt, train, shots=args.shots,
                                           episodes=args.episodes, seed=seed)  # fmt: skip
        tv_layers = tv.choose_layer(model, params, fmt, val)
        tvs = score(iterative.predict(model, params, fmt, test, patch=tv.patch(model)))
        best, grid = iterative.grid_search(
            model, params, fmt, train, val, ext_shots=tuple(int(x) for x in args.ext_shots),
            strengths=args.strengths, ext_strengths=args.ext_strengths,
            episodes=args.episodes, negative_shift=args.negative_shift, seed=seed,
        )  # fmt: skip
        ivs = score(iterative.predict(model, params, fmt, test, best["vectors"], best["strength"]))
        row = dict(task=seed, labels=list(labels), clean_f1=clean[0], clean_acc=clean[1],
                   tv_f1=tvs[0], tv_acc=tvs[1], tv_layer=tv.layer, tv_val_f1=tv_layers,
                   iv_f1=ivs[0], iv_acc=ivs[1], iv_val_f1=best["macro_f1"],
                   ext_shot=best["ext_shot"], strength=best["strength"],
                   ext_strength=best["ext_strength"], grid=grid,
                   seconds=time.perf_counter() - began)  # fmt: skip
        rows.append(row)
        print(f"task {seed}: clean {clean[0]:.3f}, TV {tvs[0]:.3f} (layer {tv.layer}), "
              f"IV {ivs[0]:.3f} (ext_shot {best['ext_shot']}, strength {best['strength']}, "
              f"ext_strength {best['ext_strength']}), {row['seconds']:.0f} s", flush=True)  # fmt: skip
    print(
        "\n| task | labels | clean F1 (acc) | Task Vectors F1 (acc, layer) | "
        "Iterative Vectors F1 (acc; ext_shot, strength, ext_strength) |"
    )
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['task']} | {' '.join(r['labels'])} | {r['clean_f1']:.3f} "
              f"({r['clean_acc']:.3f}) | {r['tv_f1']:.3f} ({r['tv_acc']:.3f}, {r['tv_layer']}) "
              f"| {r['iv_f1']:.3f} ({r['iv_acc']:.3f}; {r['ext_shot']}, {r['strength']}, "
              f"{r['ext_strength']}) |")  # fmt: skip
    mean = {k: float(np.mean([r[k] for r in rows])) for k in ("clean_f1", "tv_f1", "iv_f1")}
    print(f"| mean | | {mean['clean_f1']:.3f} | {mean['tv_f1']:.3f} | {mean['iv_f1']:.3f} |")
    result = dict(workdir=args.workdir, checkpoint=args.checkpoint, step=step, rows=rows,
                  mean=mean, shots=args.shots)  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return result
