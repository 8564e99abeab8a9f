"""Perplexity by position and Effective Remembrance of trained recurrent-LM runs.

    python experiments/recurrent_length_generalization/curves.py \
        --workdirs /tmp/runs/mamba2_zero /tmp/runs/mamba2_noise --length 25600 \
        --out /tmp/runs/curves

For each run: the next-token loss at every position of ``--sequences`` passkey
sequences of ``--length`` tokens (generated filler, needle at a random depth), read in
chunks through the state cache, averaged and exponentiated in buckets (perplexity by
position); and ``EffRem_T(t)`` at T = ``--effrem-length`` for 16 values of t on one such
sequence. Prints markdown tables and writes ``perplexity.png`` and ``effrem.png``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from lhc.data.passkey import passkey_example
from lhc.lm.tokenizers import ByteTokenizer
from lhc.recurrent import bucket_means, effective_remembrance, loss_by_position, plot_curves
from lhc.train import restore_params


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdirs", nargs="+", required=True)
    parser.add_argument("--length", type=int, default=25_600)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--effrem-length", type=int, default=1024)
    parser.add_argument("--out", required=True, help="folder for the plots")
    args = parser.parse_args(argv)
    tokenizer = ByteTokenizer()
    rng = np.random.default_rng(0)
    sequences = np.stack([
        passkey_example(rng, length=args.length, tokenizer=tokenizer)["tokens"]
        for _ in range(args.sequences)
    ])  # fmt: skip
    edges = [0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, args.length - 1]
    edges = sorted({e for e in edges if e <= args.length - 1})
    starts = np.unique(np.linspace(0, args.effrem_length - 1, 16).astype(int))
    perplexity, effrem = {}, {}
    for workdir in args.workdirs:
        name = os.path.basename(os.path.normpath(workdir))
        exp, params, step = restore_params(None, workdir)
        model = exp.task.model
        nll = loss_by_position(model, params, sequences, chunk_size=1024)
        perplexity[name] = np.exp(bucket_means(nll, edges))
        effrem[name] = effective_remembrance(
            model, params, sequences[0, : args.effrem_length], starts
        )
        print(f"{name}: step {step}")
    print("\n| positions | " + " | ".join(perplexity) + " |")
    print("|---|" + "---|" * len(perplexity))
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        print(f"| {lo}-{hi} | " + " | ".join(f"{p[i]:.2f}" for p in perplexity.values()) + " |")
    print(f"\n| t (T = {args.effrem_length}) | " + " | ".join(effrem) + " |")
    print("|---|" + "---|" * len(effrem))
    for i, t in enumerate(starts):
        print(f"| {t} | " + " | ".join(f"{e[i]:.3f}" for e in effrem.values()) + " |")
    mids = [np.sqrt(max(lo, 1) * hi) for lo, hi in zip(edges, edges[1:])]
    plot_curves(os.path.join(args.out, "perplexity.png"), mids, perplexity, xlabel="position",
                ylabel="perplexity", title="perplexity by position", logx=True)  # fmt: skip
    plot_curves(os.path.join(args.out, "effrem.png"), starts, effrem, xlabel="t",
                ylabel="EffRem", title=f"Effective Remembrance, T = {args.effrem_length}")  # fmt: skip


if __name__ == "__main__":
    main()
