"""A learnable miniature of NoLiMa: a generated world of latent associations.

Landmarks lie in cities, cities in regions; the names are made up, so only training can
teach which is where. A context is filler prose with lines such as "Olga lives next to
the Vornak Gate." (the needle, and decoys: other people next to landmarks elsewhere).
Questions ask:

* ``direct``: "Which character lives next to the Vornak Gate?" (a literal match);
* ``onehop``: "Which character has visited Pelmora?" (the needle never names the city:
  the model must know the Vornak Gate is in Pelmora);
* ``twohop``: "Which character has visited Ostrelia?" (landmark -> city -> region).

Decoys stand next to landmarks of other regions, so exactly one line answers. The
training task (``config.task = "lhc.nolima.task:WorldTask"``) shows every landmark in
every question type, with fresh names, filler and decoys each time; the association is
learned into the weights, never stated in a context. Evaluation goes through the
ordinary harness: ``World.needle_set`` writes the world as a needle set (landmarks of
the chosen regions) and ``World.haystack_lines`` a haystack whose decoys come from the
other regions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lhc.data.haystack import Haystack
from lhc.lm.tokenizers import ByteTokenizer
from lhc.nolima.evaluate import PromptFormat, prompt_tokens
from lhc.nolima.needles import NeedleCase, NeedleSet, NeedleTest, fill

TEMPLATE = "{haystack}\nQuestion: {question}\nAnswer:"
FORMAT = PromptFormat(task_template=TEMPLATE, add_bos=True)
NEEDLES = ("{CHAR} lives next to {1}.", "Next to {1} lives {CHAR}.")
QUESTIONS = {
    "onehop": "Which character has visited {2}?",
    "twohop": "Which character has visited {3}?",
    "direct": "Which character lives next to {1}?",
}
NAMES = (
    "Yuki Stuart Katie Veronica Gerald Calvin Mandy Diana Megan Caleb Mohammed Ingrid "
    "Rashid Aiko Tomasz Olga Kwame Lucia Priya Mateo Niamh Hamid Sven Leila Amara Dmitri "
    "Farah Jonas Thandiwe Rosa Ivan Greta Omar Mei Pablo Sofia Kenji Nadia Tariq Elena "
    "Bruno Hana Felix Zara Marek Ines Ravi Chloe Emeka Astrid Luis Noor Pavel Wanda Idris "
    "Lena Hugo Sana Otto Maya"
).split()
_SYLLABLES = "ka lo ve ri sta mor pel dun vo ra ni tes gal bri ol sen tar um fen dri".split()
_KINDS = ("Gate", "Tower", "Bridge", "Hall", "Market", "Fountain", "Abbey", "Arch")
_SUBJECTS = "The old miller|A tired farmer|The baker|Her cousin|The young clerk|A stranger|The ferryman|His neighbour".split(
    "|"
)
_VERBS = "carried|mended|sold|painted|found|forgot|counted|cleaned".split("|")
_OBJECTS = "the bread|a wooden chair|the nets|some apples|an old coat|the ledger|a clay jar|the lamps".split(
    "|"
)
_PLACES = "before dawn|across the yard|in the rain|after supper|by the river|near the barn|at noon|without a word".split(
    "|"
)


def _word(rng: np.random.Generator, syllables: int) -> str:
    return "".join(rng.choice(_SYLLABLES, syllables)).capitalize()


@dataclasses.dataclass(frozen=True)
class World:
    """``landmarks[i]`` lies in city ``city_of[i]``; city ``j`` in region ``region_of[j]``."""

    landmarks: tuple[str, ...]
    cities: tuple[str, ...]
    regions: tuple[str, ...]
    city_of: tuple[int, ...]
    region_of: tuple[int, ...]

    @classmethod
    def generate(
        cls, *, regions: int = 4, cities: int = 3, landmarks: int = 3, seed: int = 0
    ) -> World:
        """``regions`` x ``cities`` x ``landmarks`` made-up names, all distinct."""
        rng = np.random.default_rng(seed)
        used: set[str] = set()

        def fresh(make):
            while (name := make()) in used:
                pass
            used.add(name)
            return name

        region_names = [fresh(lambda: _word(rng, 3) + "ia") for _ in range(regions)]
        city_names, region_of, landmark_names, city_of = [], [], [], []
        for r in range(regions):
            for _ in range(cities):
                region_of.append(r)
                city_names.append(fresh(lambda: _word(rng, 3)))
                for _ in range(landmarks):
                    city_of.append(len(city_names) - 1)
                    landmark_names.append(
                        fresh(lambda: f"the {_word(rng, 2)} {_KINDS[rng.integers(len(_KINDS))]}")
                    )
        return cls(
            tuple(landmark_names),
            tuple(city_names),
            tuple(region_names),
            tuple(city_of),
            tuple(region_of),
        )

    def region_of_landmark(self, landmark: int) -> int:
        return self.region_of[self.city_of[landmark]]

    def args(self, landmark: int) -> list[str]:
        """The needle-set ``input_args``: landmark, its city, its region."""
        city = self.city_of[landmark]
        return [self.landmarks[landmark], self.cities[city], self.regions[self.region_of[city]]]

    def needle_set(
        self, regions: tuple[int, ...] | None = None, names: tuple[str, ...] = NAMES[:30]
    ) -> list[NeedleSet]:
        """The world as a needle set: both needle orders, the three question types, one
        test per landmark of ``regions`` (all by default)."""
        keep = [
            i
            for i in range(len(self.landmarks))
            if regions is None or self.region_of_landmark(i) in regions
        ]
        tests = {f"L{i:02d}": NeedleTest(tuple(self.args(i))) for i in keep}
        return [
            NeedleSet(
                id=f"{9001 + k}" + ("Inv" if k else ""),
                system_prompt="",
                needle=needle,
                questions=dict(QUESTIONS),
                character_set=tuple(names),
                tests=tests,
            )
            for k, needle in enumerate(NEEDLES)
        ]

    def haystack_lines(
        self,
        num_lines: int,
        *,
        decoy_regions: tuple[int, ...],
        decoy_rate: float = 0.2,
        names: tuple[str, ...] = NAMES[30:],
        seed: int = 0,
    ) -> list[str]:
        """Filler lines, a fraction ``decoy_rate`` of them decoys (a name from ``names``
        next to a landmark of ``decoy_regions``)."""
        rng = np.random.default_rng(seed)
        decoys = [
            i for i in range(len(self.landmarks)) if self.region_of_landmark(i) in decoy_regions
        ]
        return [self._line(rng, decoys, names, decoy_rate) for _ in range(num_lines)]

    def _line(self, rng, decoys, names, decoy_rate) -> str:
        if decoys and rng.random() < decoy_rate:
            return self._decoy(rng, decoys, names)
        return filler_sentence(rng)

    def _decoy(self, rng, decoys, names) -> str:
        needle = NEEDLES[rng.integers(len(NEEDLES))]
        landmark = decoys[rng.integers(len(decoys))]
        return fill(needle, self.args(landmark), str(names[rng.integers(len(names))]))


def filler_sentence(rng: np.random.Generator) -> str:
    parts = (_SUBJECTS, _VERBS, _OBJECTS, _PLACES)
    return " ".join(str(p[rng.integers(len(p))]) for p in parts) + "."


def world_example(
    rng: np.random.Generator,
    world: World,
    *,
    length: int,
    tokenizer=None,
    decoy_rate: float = 0.2,
    min_decoys: int = 2,
    question_types: tuple[str, ...] = ("onehop", "twohop", "direct"),
) -> dict[str, np.ndarray]:
    """One training sequence of exactly ``length`` tokens: context, question, answer
    (the name, then eos); ``weights`` mark the answer's tokens. A fraction ``decoy_rate``
    of the lines are decoys, and at least ``min_decoys`` (filler lines are replaced), so
    that "copy the name of the only such line" never answers."""
    tokenizer = tokenizer or ByteTokenizer()
    landmark = int(rng.integers(len(world.landmarks)))
    region = world.region_of_landmark(landmark)
    question_type = str(question_types[rng.integers(len(question_types))])
    people = rng.choice(NAMES, 2, replace=False)
    name, _ = people
    needle = fill(NEEDLES[rng.integers(len(NEEDLES))], world.args(landmark), str(name))
    question = fill(QUESTIONS[question_type], world.args(landmark))
    decoys = [i for i in range(len(world.landmarks)) if world.region_of_landmark(i) != region]
    others = tuple(n for n in NAMES if n != name)
    answer = [*tokenizer.encode(" " + str(name)), tokenizer.eos_id]
    case = NeedleCase("", "", question_type, needle, question, "", (), 0, TEMPLATE)
    overhead = len(prompt_tokens(tokenizer, FORMAT, case, [], question)) + len(answer)
    context_len = length - overhead
    lines, total = [], 0
    while total < context_len:
        lines.append(world._line(rng, decoys, others, decoy_rate))
        total += len(tokenizer.encode(lines[-1] + "\n"))
    filler = [i for i, line in enumerate(lines) if " lives" not in line and "Next to" not in line]
    missing = min(min_decoys - (len(lines) - len(filler)), len(filler))
    for i in rng.choice(filler, max(missing, 0), replace=False):
        lines[i] = world._decoy(rng, decoys, others)
    placement = Haystack(lines, tokenizer).place(needle, length=context_len, depth=rng.random())
    prompt = prompt_tokens(tokenizer, FORMAT, case, placement.tokens, question)
    tokens = np.asarray(prompt + answer, np.int32)
    weights = np.zeros(length - 1, np.float32)
    weights[len(prompt) - 1 :] = 1.0  # the targets that are the answer's tokens
    return {"tokens": tokens[None, :-1], "targets": tokens[None, 1:], "weights": weights[None]}
