r"""PENCIL (or chain of thought) on quantified Boolean formulas with quantifier-tree traces.

    lhc train --config configs/pencil_qbf.py:tiny --workdir /tmp/pencil_qbf
    lhc train --config configs/pencil_qbf.py:tiny,format=cot --workdir /tmp/pencil_qbf_cot

Sizes (the part after the colon):
  tiny   n = 5 variables, context limit 384 tokens (every reduced PENCIL context fits;
         most chain-of-thought traces do not), a 4-layer width-128 model (CPU).
  paper  the paper's QBF model: 6 layers, 6 heads, width 384 (10.6M parameters),
         context 2048, dropout 0.2, bf16, 256 sub-sequences a step; n = 9 by default
         (``num_vars=``).
Flags: ``format=pencil|cot``, ``num_vars=N``, ``runlocal`` (a smoke test).
"""

from lhc.pencil.config import pencil_config
from lhc.train.config import parse_arg

_SIZES = {
    # context, layers, heads, width, dropout, batch, steps, dtype, default n
    "tiny": (384, 4, 4, 128, 0.0, 16, 2000, "float32", 5),
    "paper": (2048, 6, 6, 384, 0.2, 256, 10_000, "bfloat16", 9),
}


def get_config(arg=None):
    arg = parse_arg(arg, size="tiny", format="pencil", num_vars=0, runlocal=False)
    if arg.size not in _SIZES:
        raise ValueError(f"config arg size must be one of {sorted(_SIZES)}, got {arg.size!r}")
    context, layers, heads, width, dropout, batch, steps, dtype, num_vars = _SIZES[arg.size]
    return pencil_config(
        problem="qbf",
        problem_params=dict(num_vars=arg.num_vars or num_vars),
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
        max_new_tokens=64 if arg.runlocal else (8192 if arg.size == "tiny" else 50_000),
    )
