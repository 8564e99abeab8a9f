r"""PENCIL (or chain of thought) on Einstein puzzles with propagate-and-branch traces.

    lhc train --config configs/pencil_einstein.py:tiny --workdir /tmp/pencil_einstein
    lhc train --config configs/pencil_einstein.py:tiny,format=cot --workdir /tmp/pencil_einstein_cot

Sizes (the part after the colon):
  tiny   3x3 puzzles, context limit 256 tokens (every reduced PENCIL context fits, no
         chain-of-thought trace does), a 4-layer width-128 model; trains on a 2-core
         CPU (experiments/pencil/README.md has the times).
  paper  the paper's puzzle model: 8 layers, 8 heads, width 512 (25M parameters),
         context 2048, dropout 0.2, bf16, 50 sub-sequences a step (the official
         ``max_nsubseq``) for 20,000 steps; 5x5 puzzles by default (``puzzle_size=``).
Flags: ``format=pencil|cot``, ``puzzle_size=3|4|5``, ``runlocal`` (a smoke test).
"""

from lhc.pencil.config import pencil_config
from lhc.train.config import parse_arg

_SIZES = {
    # context, layers, heads, width, dropout, batch, steps, dtype, default puzzle size
    "tiny": (256, 4, 4, 128, 0.0, 16, 2000, "float32", 3),
    "paper": (2048, 8, 8, 512, 0.2, 50, 20_000, "bfloat16", 5),
}


def get_config(arg=None):
    arg = parse_arg(arg, size="tiny", format="pencil", puzzle_size=0, runlocal=False)
    if arg.size not in _SIZES:
        raise ValueError(f"config arg size must be one of {sorted(_SIZES)}, got {arg.size!r}")
    context, layers, heads, width, dropout, batch, steps, dtype, puzzle_size = _SIZES[arg.size]
    return pencil_config(
        problem="einstein",
        problem_params=dict(size=arg.puzzle_size or puzzle_size),
        format=arg.format,
        context_limit=context,
        num_layers=layers,
        num_heads=heads,
        embed_dim=width,
        dropout_rate=dropout,
        batch_size=batch,
        num_steps=4 if arg.runlocal else steps,
        dtype=dtype,
        eval_instances=4 if arg.runlocal else 100,
        max_new_tokens=64 if arg.runlocal else (2048 if arg.size == "tiny" else 350_000),
    )
