r"""PENCIL (or chain of thought) on quantified Boolean formulas with quantifier-tree traces.

    lhc train --config configs/pencil_qbf.py:tiny --workdir /tmp/pencil_qbf
    lhc train --config configs/pencil_qbf.py:tiny,format=cot --workdir /tmp/pencil_qbf_cot

The scaling experiment of ``experiments/pencil`` (one model per format, n = 3-6):

    lhc train --config configs/pencil_qbf.py:scaling --workdir /tmp/runs/qbf_mix_pencil
    lhc train --config configs/pencil_qbf.py:scaling,format=cot --workdir /tmp/runs/qbf_mix_cot

Sizes (the part after the colon):
  tiny     n = 5 variables, context limit 384 tokens (every reduced PENCIL context fits;
           most chain-of-thought traces do not), a 4-layer width-128 model (CPU).
  scaling  the tiny model trained on a mixture of n = 3, 4, 5 and 6 variables at a
           context limit of 512 tokens, 2,400 steps; evaluated greedily on 200 held-out
           instances per size.
  paper    the paper's QBF model: 6 layers, 6 heads, width 384 (10.6M parameters),
           context 2048, dropout 0.2, bf16, 256 sub-sequences a step; n = 9 by default
           (``num_vars=``).
Flags: ``format=pencil|cot``, ``num_vars=N``, ``mix=A-B``, ``runlocal`` (a smoke test).
"""

from lhc.pencil.experiment import sized_config

_SIZES = {
    # context, layers, heads, width, dropout, batch, steps, dtype, default n
    "tiny": (384, 4, 4, 128, 0.0, 16, 2000, "float32", 5),
    "scaling": (512, 4, 4, 128, 0.0, 16, 2400, "float32", [3, 4, 5, 6]),
    "paper": (2048, 6, 6, 384, 0.2, 256, 10_000, "bfloat16", 9),
}


def get_config(arg=None):
    return sized_config(
        arg,
        problem="qbf",
        sizes=_SIZES,
        size_param="num_vars",
        max_new_tokens={"tiny": 8192, "scaling": 8192, "paper": 50_000},
        eval_params={"scaling": dict(num_instances=200, temperature=0.0, batch_size=100)},
    )
