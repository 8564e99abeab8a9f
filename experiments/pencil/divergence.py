"""Where a trained run's traces leave the solver's: greedy generation on held-out
instances, the first position where the generated trace differs, and its surroundings.
A PENCIL run generates with reductions, a chain-of-thought run (``data.format=cot``) the
whole trace in a sliding window of the context limit, as its evaluation does.

    python experiments/pencil/divergence.py --workdir /tmp/runs/sat2_pencil \
        --instances 6 --context-limit 1024
    python experiments/pencil/divergence.py --workdir /tmp/runs/qbf_mix --size 6

``--context-limit`` may exceed the run's (the model uses RoPE, so a longer context only
changes the cache size), to tell a trace that needs more room from one that loops.
"""

from __future__ import annotations

import argparse
import dataclasses

from lhc import pencil
from lhc.lm.model import Transformer
from lhc.train import restore_params


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--instances", type=int, default=6)
    parser.add_argument("--context-limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=40, help="tokens shown around it")
    parser.add_argument(
        "--size", type=int, default=None, help="a run on a mixture: this problem size only"
    )
    args = parser.parse_args(argv)

    exp, params, _ = restore_params(None, args.workdir)
    task, tokenizer = exp.task, exp.task.tokenizer
    limit = args.context_limit or int(exp.config.data.context_limit)
    config = task.model.config
    model = Transformer(dataclasses.replace(config, max_len=max(limit, config.max_len)))
    parts = dict(task.eval_parts())
    if args.size is not None and f"n{args.size}/" not in parts:
        sizes = sorted(int(key[1:-1]) for key in parts if key)
        raise SystemExit(f"--size: expected one of the run's sizes {sizes}, got {args.size}")
    problem = parts[f"n{args.size}/"] if args.size is not None else None
    instances = task.eval_instances(args.instances, problem)
    prompts = [tokenizer.encode(i.prompt) for i in instances]
    cot = exp.config.data.format == "cot"
    if cot:
        tokens, lengths, contexts, over = pencil.generate_cot(
            model, params, prompts, tokenizer,
            max_new_tokens=args.max_new_tokens, context_limit=limit,
        )  # fmt: skip
    else:
        out = pencil.generate(
            model, params, prompts, tokenizer,
            max_new_tokens=args.max_new_tokens, context_limit=limit,
        )  # fmt: skip
        tokens, lengths, contexts, over = out.tokens, out.lengths, out.max_context, out.overflowed
    w = args.window
    for k, instance in enumerate(instances):
        generated = tokenizer.decode_tokens(tokens[k, : int(lengths[k])])
        reference = list(instance.trace)
        first = next(
            (j for j, (a, b) in enumerate(zip(generated, reference)) if a != b),
            min(len(generated), len(reference)),
        )
        # The largest context the solver's trace needs: its last token (a [RETURN] or
        # the end of text) is generated, never fed.
        if cot:
            largest = len(instance.prompt) + len(reference) - 1
        else:
            subs = pencil.subsequences(instance.prompt, reference)
            largest = max(len(s.tokens) for s in subs) - 1
        print(
            f"--- instance {k}: label {instance.label}; trace length {len(generated)} "
            f"(solver {len(reference)}); largest context {int(contexts[k])} "
            f"(solver {largest}); over the limit {bool(over[k])}; "
            f"first difference at token {first}"
        )
        print("solver:   ", " ".join(reference[max(0, first - w) : first + w]))
        print("generated:", " ".join(generated[max(0, first - w) : first + w]))
        print("last tokens:", " ".join(generated[-w:]))


if __name__ == "__main__":
    main()
