"""Perplexity by position, Effective Remembrance and passkey accuracy by length of
trained recurrent-LM runs.

    python experiments/recurrent/curves.py \
        --workdirs /tmp/runs/mamba2_s0_base /tmp/runs/mamba2_s0_noise --length 25600 \
        --passkey-lengths 256 1024 4096 25600 --out /tmp/runs/curves

For each run: the next-token loss at every position of ``--sequences`` passkey
sequences of ``--length`` tokens (generated filler, needle at a random depth), read in
chunks through the state cache, averaged and exponentiated in buckets (perplexity by
position); ``EffRem_T(t)`` at T = ``--effrem-length`` for 16 values of t, averaged over
the same sequences' first T tokens; the passkey accuracy at each of ``--passkey-lengths``
over five depths (0, 0.25, 0.5, 0.75, 1) with ``--samples`` keys each. Prints markdown
tables and writes ``perplexity.png``, ``effrem.png``, ``passkey.png`` and the numbers
(``results.json``, which ``summarize.py`` averages over seeds) to ``--out``. A run is
named by its workdir's folder name. With ``--results``, each run's record is appended as
soon as it is measured, and a run whose record for the same step and settings is already
there is read back instead of measured again (an interrupted evaluation resumes).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from lhc import stats
from lhc.lm.tokenizers import ByteTokenizer
from lhc.recurrent import bucket_means, effective_remembrance, loss_by_position, plot_curves
from lhc.train import restore_params
from lhc.train.passkey import passkey_accuracy, passkey_example

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _table(title: str, rows, columns: dict, fmt: str) -> str:
    lines = [f"| {title} | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for i, row in enumerate(rows):
        lines.append(f"| {row} | " + " | ".join(format(c[i], fmt) for c in columns.values()) + " |")
    return "\n".join(lines)


def _done(records: list[dict], name: str, step: int, args) -> dict | None:
    """The record of run ``name`` at ``step`` measured with these settings, if any."""
    wanted = (name, step, args.length, args.sequences, args.passkey_lengths)
    for record in records:
        keys = ("run", "step", "length", "sequences", "passkey_lengths")
        if tuple(record[k] for k in keys) != wanted:
            continue
        cells = [c for row in record["passkey_hits"] for c in row]
        if all(len(c) == args.samples for c in cells):
            return record
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdirs", nargs="+", required=True)
    parser.add_argument("--length", type=int, default=25_600)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--effrem-length", type=int, default=1024)
    parser.add_argument("--passkey-lengths", type=int, nargs="*", default=[])
    parser.add_argument("--samples", type=int, default=8, help="passkey keys per cell")
    parser.add_argument("--out", required=True, help="folder for the plots")
    parser.add_argument(
        "--results",
        default=None,
        help="JSON lines: one record per workdir (its numbers and every passkey hit), appended",
    )
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
    perplexity, effrem, passkey = {}, {}, {}
    earlier = stats.read_records(args.results) if args.results else []
    for workdir in args.workdirs:
        name = os.path.basename(os.path.normpath(workdir))
        exp, params, step = restore_params(None, workdir)
        record = _done(earlier, name, int(step), args)
        if record is not None:
            print(f"{name}: step {step}, read from {args.results}", flush=True)
            perplexity[name] = np.asarray(record["perplexity"])
            effrem[name] = np.asarray(record["effrem"])
            if args.passkey_lengths:
                hits = record["passkey_hits"]
                passkey[name] = np.array([[np.mean(c) for c in r] for r in hits]).mean(axis=1)
            continue
        model = exp.task.model
        nll = loss_by_position(model, params, sequences, chunk_size=1024)
        perplexity[name] = np.exp(bucket_means(nll, edges))
        effrem[name] = np.mean(
            [
                effective_remembrance(model, params, seq[: args.effrem_length], starts)
                for seq in sequences
            ],
            axis=0,
        )
        if args.passkey_lengths:
            result = passkey_accuracy(
                model, params, tokenizer, lengths=args.passkey_lengths, depths=DEPTHS,
                samples=args.samples, seed=2_000_003, prefill_chunk=1024,
            )  # fmt: skip
            passkey[name] = result.accuracy.mean(axis=1)
            print(f"\n{name} (step {step}), passkey accuracy:\n\n{result.table()}")
        print(f"{name}: step {step}", flush=True)
        record = dict(
            run=name, step=int(step), seed=int(exp.config.seed), length=args.length,
            sequences=args.sequences, buckets=edges, perplexity=perplexity[name].tolist(),
            effrem_t=starts.tolist(), effrem=np.asarray(effrem[name]).tolist(),
            passkey_lengths=args.passkey_lengths, passkey_depths=list(DEPTHS),
            passkey_hits=result.hits if args.passkey_lengths else [],
        )  # fmt: skip
        if args.results:
            stats.append_records(args.results, [record])
    buckets = [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:])]
    print("\nPerplexity by position:\n\n" + _table("positions", buckets, perplexity, ".2f"))
    print(
        f"\nEffective Remembrance at T = {args.effrem_length}:\n\n"
        + _table("t", list(starts), effrem, ".3f")
    )
    if passkey:
        print(
            "\nPasskey accuracy (mean over depths):\n\n"
            + _table("length", args.passkey_lengths, passkey, ".2f")
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        lists = lambda d: {k: np.asarray(v).tolist() for k, v in d.items()}  # noqa: E731
        json.dump(
            {
                "buckets": buckets, "perplexity": lists(perplexity),
                "effrem_length": args.effrem_length, "effrem_t": starts.tolist(),
                "effrem": lists(effrem), "passkey_lengths": args.passkey_lengths,
                "passkey_samples": args.samples, "passkey": lists(passkey),
            },
            handle, indent=1,
        )  # fmt: skip
    mids = [np.sqrt(max(lo, 1) * hi) for lo, hi in zip(edges, edges[1:])]
    plot_curves(os.path.join(args.out, "perplexity.png"), mids, perplexity, xlabel="position",
                ylabel="perplexity", title="perplexity by position", logx=True)  # fmt: skip
    plot_curves(os.path.join(args.out, "effrem.png"), starts, effrem, xlabel="t",
                ylabel="EffRem", title=f"Effective Remembrance, T = {args.effrem_length}")  # fmt: skip
    if passkey:
        plot_curves(os.path.join(args.out, "passkey.png"), args.passkey_lengths, passkey,
                    xlabel="length", ylabel="accuracy", title="passkey accuracy by length",
                    logx=True)  # fmt: skip


if __name__ == "__main__":
    main()
