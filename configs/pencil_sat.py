r"""PENCIL (or chain of thought) on random 3-SAT with DPLL traces.

    lhc train --config configs/pencil_sat.py:tiny --workdir /tmp/pencil_sat
    lhc train --config configs/pencil_sat.py:tiny,format=cot --workdir /tmp/pencil_sat_cot

Sizes (the part after the colon):
  tiny   n = 5 variables (22 clauses), context limit 768 tokens (every reduced PENCIL
         context fits; most chain-of-thought traces do not), a 4-layer width-128
         model; trains on a 2-core CPU (experiments/pencil/README.md has the times).
  paper  the paper's SAT model: 6 layers, 6 heads, width 384 (10.6M parameters),
         context 2048, dropout 0.2, bf16; n = 10 by default (``num_vars=``).
Flags: ``format=pencil|cot``, ``num_vars=N``, ``runlocal`` (a few steps, a smoke test).

Evaluation solves held-out instances by generation under the same context limit (the
paper: 100 instances, temperature 0.8, top-k 200) and reports accuracy, trace rate,
the largest context and the tokens generated.
"""

from lhc.pencil.config import pencil_config
from lhc.train.config import parse_arg

_SIZES = {
    # context, layers, heads, width, dropout, batch, steps, dtype, default n
    "tiny": (768, 4, 4, 128, 0.0, 16, 2000, "float32", 5),
    "paper": (2048, 6, 6, 384, 0.2, 256, 10_000, "bfloat16", 10),
}


def get_config(arg=None):
    arg = parse_arg(arg, size="tiny", format="pencil", num_vars=0, runlocal=False)
    if arg.size not in _SIZES:
        raise ValueError(f"config arg size must be one of {sorted(_SIZES)}, got {arg.size!r}")
    context, layers, heads, width, dropout, batch, steps, dtype, num_vars = _SIZES[arg.size]
    config = pencil_config(
        problem="sat",
        problem_params=dict(num_vars=arg.num_vars or num_vars, clause_ratio=4.3),
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
        max_new_tokens=64 if arg.runlocal else (4096 if arg.size == "tiny" else 50_000),
    )
    return config
