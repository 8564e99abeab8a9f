"""lhc bench pencil at toy size: both ways draw the same tokens, the table prints and the
JSON file holds the rows. The timer reports chosen seconds (the real ones are only
checked to be positive), so the rates and the speedup are checked against closed forms;
the reductions counted are those of the rule replayed on the generated tokens."""

import json
import math

import numpy as np
import pytest

from lhc.pencil import bench
from lhc.pencil.reduction import reduce_once_ids

from ..support import fixed_timings


def _replayed_reductions(prompts, out, tokenizer) -> int:
    """The reductions of the rule applied to Python lists as each token comes."""
    special = dict(
        call_id=tokenizer.call_id, sep_id=tokenizer.sep_id, return_id=tokenizer.return_id
    )
    count = 0
    for prompt, tokens, length in zip(prompts, np.asarray(out.tokens), np.asarray(out.lengths)):
        context = list(prompt)
        for token in tokens[:length].tolist():
            context.append(token)
            if token == tokenizer.return_id:
                reduced = reduce_once_ids(context, **special)
                count += reduced != context
                context = reduced
    return count


def test_bench_rows(capsys, tmp_path, monkeypatch):
    path = tmp_path / "pencil.json"
    measured = fixed_timings(monkeypatch, timed=[0.5, 3.0])  # rewind, then recompute
    runs = []

    def generate(model, params, prompts, tokenizer, **kwargs):
        out = bench.generate.__wrapped__(model, params, prompts, tokenizer, **kwargs)
        runs.append((prompts, out, tokenizer))
        return out

    generate.__wrapped__ = bench.generate
    monkeypatch.setattr(bench, "generate", generate)
    # Seed 1 samples a reduction within these 60 tokens of the random tiny model.
    flags = "--size tiny --contexts 64 --new-tokens 30 --batch 2 --seed 1"
    result = bench.main([*flags.split(), "--json", str(path)])
    (row,) = result["rows"]
    assert row["same_tokens"] and row["context"] == 64 and row["batch"] == 2
    reductions = {_replayed_reductions(*run) for run in runs}  # the warm-up run and the timed
    assert row["new_tokens"] == 30 and reductions == {row["reductions"]} and row["reductions"] > 0
    assert len(measured) == 2 and all(0 < s < math.inf for s in measured)
    # No stop tokens: each of the 2 sequences generates all 30 tokens, 60 tokens in 0.5 s
    # rewinding and in 3 s recomputing, a speedup of 6.
    assert (row["rewind_s"], row["recompute_s"]) == (0.5, 3.0)
    assert row["rewind_tokens_per_s"] == pytest.approx(120)
    assert row["recompute_tokens_per_s"] == pytest.approx(20)
    assert row["speedup"] == pytest.approx(6)
    out = capsys.readouterr().out
    assert "| 64 | 30 x 2 | 120.0 | 20.00 | 6.0x |" in out and "device: " in out
    assert json.loads(path.read_text())["rows"] == [row]


def test_bad_contexts_are_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--contexts", "40,x"])
    assert "--contexts: expected comma-separated ints, got '40,x'" in capsys.readouterr().err
