"""PENCIL (Yang, Srebro, McAllester, Li, ICML 2025): long thoughts with short memory.

A model writes its reasoning as nested calls, ``[CALL] question ... [SEP] answer
[RETURN]``, and every ``[RETURN]`` erases the finished call, keeping only its answer
(``C [CALL] T [SEP] A [RETURN] -> C A``), so the context stays short however long the
thought. This package has:

* the rule (``reduce``, ``reduce_once`` and their id versions) and the training data it
  defines (``subsequences``: each trace token trained once, in the context in which it
  is generated);
* the reasoning problems with solver traces: random 3-SAT with DPLL (``SAT``), QBF
  with quantifier-tree traces (``QBF``), Einstein puzzles 3x3 to 5x5 with propagation,
  branching and tail calls (``Einstein``); ``make_problem`` by name and the word-level
  ``PencilTokenizer``;
* reduction-aware generation on the KV cache (``generate``: the cache is cut back to the
  ``[CALL]`` and only the answer is fed again, batched, each sequence on its own
  schedule), the official code's recompute-every-token way (``generate_recompute``),
  and ``lhc bench pencil`` comparing them;
* the training task (``lhc.pencil.task:PencilTask``: PENCIL sub-sequences or whole
  chain-of-thought traces) and evaluation by generation under one context limit
  (``evaluate_generation``); configs ``configs/pencil_{sat,qbf,einstein}.py``.
"""

from lhc.pencil.einstein import Einstein
from lhc.pencil.evaluation import (
    EvalResult,
    comparison_table,
    evaluate_generation,
    generate_cot,
)
from lhc.pencil.generation import PencilOutput, generate, generate_recompute, trace_rate
from lhc.pencil.problems import (
    Instance,
    make_problem,
    parse_answer,
    tokenizer_for,
    trace_statistics,
)
from lhc.pencil.qbf import QBF
from lhc.pencil.reduction import (
    CALL,
    RETURN,
    SEP,
    Subsequence,
    reduce,
    reduce_ids,
    reduce_once,
    reduce_once_ids,
    subsequences,
)
from lhc.pencil.sat import SAT
from lhc.pencil.tokenizer import PencilTokenizer

__all__ = [
    # The rule and its training data.
    "CALL",
    "RETURN",
    "SEP",
    "Subsequence",
    "reduce",
    "reduce_ids",
    "reduce_once",
    "reduce_once_ids",
    "subsequences",
    # Problems and their tokens.
    "Einstein",
    "Instance",
    "PencilTokenizer",
    "QBF",
    "SAT",
    "make_problem",
    "parse_answer",
    "tokenizer_for",
    "trace_statistics",
    # Generation and evaluation.
    "EvalResult",
    "PencilOutput",
    "comparison_table",
    "generate_cot",
    "evaluate_generation",
    "generate",
    "generate_recompute",
    "trace_rate",
]
