r"""PENCIL (or chain of thought) on random 3-SAT with DPLL traces.

    lhc train --config configs/pencil_sat.py:tiny --workdir /tmp/pencil_sat
    lhc train --config configs/pencil_sat.py:tiny,format=cot --workdir /tmp/pencil_sat_cot

Sizes (the part after the colon):
  tiny   n = 5 variables (22 clauses), context limit 768 tokens (every reduced PENCIL
         context fits; most chain-of-thought traces do not), a 4-layer width-128
         model, 8 rows a step for 1,500 steps; trains on a 2-core CPU
         (experiments/pencil/README.md has the times).
  paper  the paper's SAT model: 6 layers, 6 heads, width 384 (10.6M parameters),
         context 2048, dropout 0.2, bf16, 256 rows a step (the official code steps on
         the sub-sequences of 5 instances x 4 accumulations) for 10,000 steps; n = 10 by
         default (``num_vars=``). Compiled for a v5p-8 (``lhc compile --topology
         v5p:2x2x2``), the train step peaks at 24.3 GiB a chip.
Flags: ``format=pencil|cot``, ``num_vars=N``, ``runlocal`` (a few steps, a smoke test).

Evaluation solves held-out instances by generation under the same context limit (the
paper: 100 instances, temperature 0.8, top-k 200) and reports accuracy, trace rate,
the largest context and the tokens generated.
"""

from lhc.pencil.experiment import sized_config

_SIZES = {
    # context, layers, heads, width, dropout, batch, steps, dtype, default n
    "tiny": (768, 4, 4, 128, 0.0, 8, 1500, "float32", 5),
    "paper": (2048, 6, 6, 384, 0.2, 256, 10_000, "bfloat16", 10),
}


def get_config(arg=None):
    return sized_config(
        arg,
        problem="sat",
        sizes=_SIZES,
        size_param="num_vars",
        problem_params=dict(clause_ratio=4.3),
        max_new_tokens={"tiny": 4096, "paper": 50_000},
    )
