"""Where a batch-1 decode step of a checkpoint spends its time, by kind of XLA operation.

    JAX_PLATFORMS=cpu python experiments/lm_decode/profile_decode.py \
        [--checkpoint smollm2-135m-instruct] [--steps 64]

Generates ``--steps`` greedy tokens after a 128-token prompt under ``jax.profiler`` and
reads the trace's per-thunk events of XLA's CPU runtime (``jax._src.lib._profile_data``):
per decode step, how many operations of each kind ran (``dot``, ``fusion`` kinds...) and
the time they took. The profiler adds its own cost to every event, so the times are
upper bounds; the counts are exact. A ``cond`` (a ``lax.switch`` of switched layers) or
``while`` event contains the operations it runs, so the total leaves them out.
"""

import argparse
import collections
import glob
import tempfile

import jax
import numpy as np
from jax._src.lib import _profile_data

from lhc import lm

# Thunks that run others (a conditional's branch, a loop's body): their time includes
# the operations inside, which are listed too.
CONTAINERS = ("cond", "while")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    ckpt = lm.load_checkpoint(args.checkpoint, dtype="float32")
    prompt = np.arange(10, 138)[None]
    run = lambda: lm.generate(ckpt.model, ckpt.params, prompt, max_new_tokens=args.steps)
    jax.block_until_ready(run().tokens)  # compiles
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        jax.block_until_ready(run().tokens)
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        data = _profile_data.ProfileData.from_file(path)
    count, nanoseconds = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "XLAEigen" not in line.name:  # the CPU runtime's worker threads
                continue
            for event in line.events:
                if "ThunkExecutor" in event.name or event.name.startswith("end:"):
                    continue
                kind = event.name.split(".")[0]
                count[kind] += 1
                nanoseconds[kind] += event.duration_ns
    steps = args.steps  # the prompt's operations are spread over the steps too
    print(f"{args.checkpoint}, layers {lm.default_layers()}; per token, {steps} tokens")
    print("| operation | per token | ms per token |")
    print("|---|---:|---:|")
    for kind, total in nanoseconds.most_common(12):
        print(f"| {kind} | {count[kind] / steps:.0f} | {total / steps / 1e6:.2f} |")
    leaves = [kind for kind in count if kind not in CONTAINERS]
    total = sum(nanoseconds[kind] for kind in leaves) / steps / 1e6
    print(
        f"| all but {', '.join(CONTAINERS)} | {sum(count[k] for k in leaves) / steps:.0f} | {total:.2f} |"
    )


if __name__ == "__main__":
    main()
