r"""PENCIL (or chain of thought) on Einstein puzzles with propagate-and-branch traces.

    lhc train --config configs/pencil_einstein.py:tiny --workdir /tmp/pencil_einstein
    lhc train --config configs/pencil_einstein.py:tiny,format=cot --workdir /tmp/pencil_einstein_cot

Sizes (the part after the colon):
  tiny   3x3 puzzles, context limit 320 tokens (the reduced PENCIL context fits in
         about 99% of puzzles, no chain-of-thought trace does), a 4-layer width-128
         model, 16 rows a step for 2,000 steps; trains on a 2-core CPU
         (experiments/pencil/README.md has the times).
  paper  the paper's puzzle model: 8 layers, 8 heads, width 512 (25M parameters),
         context 2048, dropout 0.2, bf16, 48 sub-sequences a step for 20,000 steps
         (the official ``max_nsubseq`` is 50; 48 divides over 8 or 16 chips); 5x5
         puzzles by default (``puzzle_size=``). Compiled for a v5p-8
         (``lhc compile --topology v5p:2x2x2``), the train step peaks at 8.1 GiB a chip.
Flags: ``format=pencil|cot``, ``puzzle_size=3|4|5``, ``runlocal`` (a smoke test).
"""

from lhc.pencil.experiment import sized_config

_SIZES = {
    # context, layers, heads, width, dropout, batch, steps, dtype, default puzzle size
    "tiny": (320, 4, 4, 128, 0.0, 16, 2000, "float32", 3),
    "paper": (2048, 8, 8, 512, 0.2, 48, 20_000, "bfloat16", 5),
}


def get_config(arg=None):
    return sized_config(
        arg,
        problem="einstein",
        sizes=_SIZES,
        size_param="size",
        arg_name="puzzle_size",
        max_new_tokens={"tiny": 2048, "paper": 350_000},
    )
