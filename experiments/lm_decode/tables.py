"""The tables of README.md, from the raw results in results/.

    python experiments/lm_decode/tables.py [results/NAME.json ...]

Each file is what ``lhc bench lm ... --json FILE`` wrote: long prompts
(``--prompt-lens``, ``*_long*.json``) or decoding against transformers in several layer
layouts (``--against transformers``, ``*_layers.json``); this prints, per file, the
command that made it, the device line and the table.
"""

import argparse
import glob
import json
import os

from lhc.bench.lm import comparison_table
from lhc.bench.lm_long import long_prompt_table

HERE = os.path.dirname(os.path.abspath(__file__))


def render(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        result = json.load(handle)
    command = " ".join(["lhc", *result["argv"][1:]])
    return "\n".join(
        [
            f"### {os.path.basename(path)}",
            "",
            f"    {command}",
            "",
            (
                long_prompt_table(result["long_prompts"])
                if "long_prompts" in result
                else comparison_table(result["against_transformers"])
            ),
            "",
            result["footer"],
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="result files (default: every *.json)")
    args = parser.parse_args()
    paths = args.paths or sorted(glob.glob(os.path.join(HERE, "results", "*.json")))
    print("\n\n".join(render(path) for path in paths))


if __name__ == "__main__":
    main()
