"""PENCIL and chain of thought as a training task (``config.task =
"lhc.pencil.task:PencilTask"``).

Config keys: those of ``lhc.train.causal_lm.CausalLMTask`` (``model``: the fields of
``lhc.lm.LMConfig``; ``batch_size``, ``seed``, ``eval_batches``), and

* ``data.problem``: ``"sat"``, ``"qbf"`` or ``"einstein"``; ``data.problem_params``: its
  parameters (``num_vars``, ``size``, ...; a list of sizes trains on all of them, a size
  drawn per row, and evaluates each apart: ``eval/pencil/n4/accuracy``);
* ``data.format``: ``"pencil"`` (each row is one sub-sequence of
  ``lhc.pencil.reduction.subsequences``, trained from the first token generated in its
  context) or ``"cot"`` (each row is a whole trace, trained after the prompt);
* ``data.context_limit``: L, the model's context; rows hold L + 1 tokens (inputs and the
  last target). A longer example is cut there, as the official code cuts at 2049; the
  metric ``truncated`` is the fraction of rows cut;
* ``pencil_eval``: ``num_instances`` held-out instances solved by generation at every
  evaluation (0: none), ``batch_size``, ``max_new_tokens``, ``temperature``, ``top_k``,
  ``methods`` (a subset of ``("pencil", "cot")``; a model is evaluated with the method
  it was trained for unless both are listed), ``results`` (a JSON-lines file that each
  evaluation appends one record per instance to, tagged with the problem size, format,
  seed, steps and temperature; "" for none).

Each row of global batch ``i`` comes from its own instance, drawn from
``(seed, i, row)``; a PENCIL row is one of that instance's sub-sequences, drawn with
probability proportional to the tokens it trains (``pick_subsequence``), so that every
trace token is equally likely to be trained. (The official code flattens and shuffles
all sub-sequences of 5 instances x 4 accumulation steps, so it trains every sub-sequence
of an instance; here every row sees a fresh instance. Either way a PENCIL row trains
far fewer tokens than a CoT row of the same width: one sub-sequence's new tokens
against a whole trace.)
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from lhc.data.iterators import row_rngs
from lhc.lm.sampling import SamplingParams
from lhc.pencil.evaluation import METHODS, evaluate_generation
from lhc.pencil.problems import Mixture, make_problem, tokenizer_for
from lhc.pencil.reduction import Subsequence, subsequences
from lhc.stats import append_records
from lhc.train.causal_lm import CausalLMTask

FORMATS = ("pencil", "cot")


def pick_subsequence(subs, rng: np.random.Generator) -> int:
    """The index of one sub-sequence, drawn with probability proportional to the number
    of tokens it trains: every token of the trace is then equally likely to be trained,
    as in the official data, where every sub-sequence of every instance is trained once.
    (Uniform over sub-sequences would over-train the short ones.)"""
    trained = np.array([len(sub.trained) for sub in subs], float)
    return int(rng.choice(len(subs), p=trained / trained.sum()))


def example_row(
    problem, tokenizer, rng: np.random.Generator, *, trace_format: str, context_limit: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """One training row: ``(tokens int32 [L + 1], trained bool [L + 1], truncated)``.

    ``trained[t]`` marks the tokens that are targets of the loss (never the padding).
    """
    instance = problem.sample(rng)
    prompt, trace = tokenizer.encode(instance.prompt), tokenizer.encode(instance.trace)
    if trace_format == "pencil":
        subs = subsequences(prompt, trace, tokenizer.call_id, tokenizer.sep_id, tokenizer.return_id)
        example = subs[pick_subsequence(subs, rng)]
    else:
        example = Subsequence(tuple(prompt + trace), len(prompt))
    width = context_limit + 1
    tokens = np.full(width, tokenizer.pad_id, np.int32)
    trained = np.zeros(width, bool)
    kept = min(len(example.tokens), width)
    tokens[:kept] = example.tokens[:kept]
    trained[:kept] = example.loss_mask()[:kept]
    return tokens, trained, len(example.tokens) > width


class PencilTask(CausalLMTask):
    """Trains a ``lhc.lm`` decoder on PENCIL's sub-sequences or on whole CoT traces and
    evaluates it by generation (see the module docstring)."""

    def __init__(self, config, mesh, rules):
        data = config.data
        if data.format not in FORMATS:
            raise ValueError(f"config.data.format must be one of {FORMATS}, got {data.format!r}")
        limit = int(data.context_limit)
        if not 1 <= limit <= int(config.model.max_len):
            raise ValueError(
                f"config.data.context_limit must lie in [1, config.model.max_len="
                f"{config.model.max_len}], got {limit}"
            )
        self.problem = make_problem(data.problem, **dict(data.get("problem_params") or {}))
        self.tokenizer = tokenizer_for(self.problem)
        vocab = int(config.model.vocab_size)
        if vocab != self.tokenizer.vocab_size:
            raise ValueError(
                f"config.model.vocab_size must be the {data.problem} vocabulary's "
                f"{self.tokenizer.vocab_size}, got {vocab} (a config's arg such as num_vars= "
                "sets both)"
            )
        super().__init__(config, mesh, rules)

    def _make_batch(self, seed, index, rows):
        make = functools.partial(
            example_row,
            self.problem,
            self.tokenizer,
            trace_format=self.config.data.format,
            context_limit=int(self.config.data.context_limit),
        )
        tokens, trained, truncated = zip(*(make(rng) for rng in row_rngs(seed, index, rows)))
        tokens, trained = np.stack(tokens), np.stack(trained)
        return {
            "tokens": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": trained[:, 1:].astype(np.float32),
            "truncated": np.asarray(truncated, np.float32),
        }

    def loss(self, params, batch, rng):
        loss, metrics = super().loss(params, batch, rng)
        return loss, {**metrics, "truncated": batch["truncated"].mean()}

    def eval_instances(self, num_instances: int, problem=None):
        """Held-out instances of ``problem`` (default: the task's) from a seed stream
        disjoint from training and evaluation."""
        seed = int(self.config.seed) + 2_000_003
        problem = self.problem if problem is None else problem
        return [problem.sample(np.random.default_rng([seed, i])) for i in range(num_instances)]

    def eval_parts(self) -> list[tuple[str, object]]:
        """``(metric prefix, problem)`` per evaluated problem: the task's, or each size
        of a ``Mixture`` apart (``"n4/"``: its size)."""
        if isinstance(self.problem, Mixture):
            return [(f"n{size}/", problem) for size, problem in self.problem.parts]
        return [("", self.problem)]

    def _size(self) -> int | None:
        """The problem's size (its one integer parameter), None when it has several."""
        sizes = [v for v in self.config.data.problem_params.values() if isinstance(v, int)]
        return sizes[0] if len(sizes) == 1 else None

    def evaluate(self, params):
        metrics = super().evaluate(params)
        settings = self.config.get("pencil_eval")
        if settings is None or not int(settings.num_instances):
            return metrics
        methods = tuple(settings.get("methods") or (self.config.data.format,))
        unknown = set(methods) - set(METHODS)
        if unknown:
            raise ValueError(f"config.pencil_eval.methods must be in {METHODS}, got {methods}")
        sampling = SamplingParams(
            temperature=float(settings.temperature), top_k=int(settings.top_k)
        )
        for part, problem in self.eval_parts():
            instances = self.eval_instances(int(settings.num_instances), problem)
            for method in methods:
                result = evaluate_generation(
                    self.model,
                    params,
                    instances,
                    self.tokenizer,
                    self.problem.labels(),
                    method=method,
                    context_limit=int(self.config.data.context_limit),
                    max_new_tokens=int(settings.max_new_tokens),
                    sampling=sampling,
                    rng=jax.random.key(int(self.config.seed)),
                    batch_size=int(settings.batch_size),
                )
                metrics.update(result.metrics(prefix=f"eval/{method}/{part}"))
                if settings.get("results"):
                    tags = dict(
                        problem=str(self.config.data.problem),
                        size=int(part[1:-1]) if part else self._size(),
                        format=str(self.config.data.format),
                        seed=int(self.config.seed),
                        steps=int(self.config.num_steps),
                        temperature=float(settings.temperature),
                    )
                    append_records(str(settings.results), result.records(**tags))
        return metrics
