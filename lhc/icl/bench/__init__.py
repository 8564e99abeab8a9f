r"""In-context learning: task superposition and Iterative Vectors (``superposition``, ``vectors``).

``lhc bench icl superposition``: task superposition of a model trained from scratch
(``configs/icl_superposition.py``), each task's answer probability against the
proportion d of the first task, or the paper's task families on a checkpoint
(``lhc.icl.bench.superposition``)::

    lhc bench icl superposition --workdir /tmp/sup/bias_add --prompts 50
    lhc bench icl superposition --checkpoint smollm2-135m-instruct --family case \
        --tasks copy,upper --points 5 --demos 32 --prompts 32

``lhc bench icl vectors``: Iterative Vectors against the plain prompt and Task Vectors
(``lhc.icl.bench.vectors``)::

    lhc bench icl vectors --checkpoint smollm2-135m-instruct --word-tasks \
        sentiment-letters,category-letters --seeds 1,2,3 --shots 2

``lhc bench icl superposition --help`` and ``lhc bench icl vectors --help`` list each
one's flags.
"""

from __future__ import annotations

from collections.abc import Sequence

from lhc import bench
from lhc.icl.bench import superposition, vectors


def main(argv: Sequence[str]) -> dict:
    """``lhc bench icl superposition ...`` or ``lhc bench icl vectors ...``."""
    which = argv[0] if argv else None
    if which in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0)
    if which == "superposition":
        args = superposition.parse_args(argv[1:])
        result = superposition.run(args)
    elif which == "vectors":
        args = vectors.parser().parse_args(argv[1:])
        result = vectors.vectors_table(args)
    else:
        got = "nothing" if which is None else repr(which)
        raise SystemExit(
            f"lhc bench icl: the first argument is superposition or vectors, got {got}"
        )
    return bench.finish(result, args)
