"""NoLiMa's training task: any causal LM learns the latent associations of a generated
world (``lhc.nolima.world``) from its questions."""

from __future__ import annotations

from lhc.data.iterators import row_rngs, stack_rows
from lhc.nolima.world import QUESTIONS, World, world_example
from lhc.train.causal_lm import CausalLMTask
from lhc.train.passkey import PasskeyTask, right_pad


class WorldTask(PasskeyTask):
    """Trains any causal LM (``config.model_factory``) on the world's questions.

    Config keys: those of ``CausalLMTask``; ``world`` = ``regions``, ``cities``,
    ``landmarks``, ``seed``; ``data`` = ``length`` (tokens per sequence), ``min_length``
    (optional: lengths uniform in [min_length, length], right-padded), ``decoy_rate``,
    ``min_decoys``, ``question_types``, ``lm_loss_weight``.
    """

    def world(self) -> World:
        w = self.config.world
        return World.generate(
            regions=int(w.regions),
            cities=int(w.cities),
            landmarks=int(w.landmarks),
            seed=int(w.seed),
        )

    def _make_batch(self, seed, index, rows):
        data, world = self.config.data, self.world()
        longest = int(data.length)
        shortest = int(data.get("min_length") or longest)
        if not 1 <= shortest <= longest:
            raise ValueError(
                f"config.data.min_length must lie in [1, length={longest}], got {shortest}"
            )
        types = tuple(data.get("question_types", ("onehop", "twohop", "direct")))
        unknown = set(types) - set(QUESTIONS)
        if unknown:
            raise ValueError(
                f"config.data.question_types: unknown {sorted(unknown)}; known {sorted(QUESTIONS)}"
            )

        def row(rng):
            n = int(rng.integers(shortest, longest + 1))
            example = world_example(
                rng,
                world,
                length=n + 1,
                tokenizer=self.tokenizer,
                decoy_rate=float(data.get("decoy_rate", 0.2)),
                min_decoys=int(data.get("min_decoys", 2)),
                question_types=types,
            )
            return right_pad(example, longest, self.tokenizer.pad_id)

        return stack_rows(row, row_rngs(seed, index, rows))

    def evaluate(self, params):
        # Held-out loss and answer accuracy; the NoLiMa sweep is the harness's.
        return CausalLMTask.evaluate(self, params)
