"""NoLiMa (Modarressi et al., ICML 2025): needle-in-a-haystack with minimal lexical
overlap, for any ``lhc.lm`` protocol model.

A question names a keyword the needle never states: "Which character has been to
Dresden?" against "Actually, Yuki lives next to the Semper Opera House." Finding the
needle takes the latent association, not a literal match::

    cases = lhc.nolima.needle_cases(lhc.nolima.lhc_needle_set(), ("onehop", "twohop"))
    haystack = lhc.nolima.Haystack(lhc.nolima.shuffled_haystack(paths), tokenizer)
    records = lhc.nolima.evaluate(model, params, tokenizer, cases, [haystack],
                                  lengths=(250, 500, 1000, 4000), depths=(0, 0.5, 1),
                                  results_path="nolima.jsonl")
    print(lhc.nolima.table(lhc.nolima.summary(records)))

* ``lhc.nolima.needles``: the needle-set JSON format (the official set is the user's to
  download, under its research licence), lhc's own set, ROUGE-1 precision.
* ``lhc.data.haystack`` (re-exported here): shuffled snippets of text files, the
  literal-match filter, needles placed at depths measured in the model's tokens.
* ``lhc.nolima.evaluate``: prompts (chat templates included), batched greedy
  generation, resumable JSON-lines results, the multiple-choice and distractor variants.
* ``lhc.nolima.scores``: "contains", base score, effective length, normalized score,
  heat maps and curves.
"""

from lhc.data.haystack import (
    Haystack,
    Placement,
    clean_lines,
    filter_lines,
    names_absent,
    shuffled_haystack,
)
from lhc.nolima.evaluate import (
    DEFAULT_TASK_TEMPLATE,
    PromptFormat,
    Test,
    build,
    common_prefix,
    evaluate,
    make_tests,
    model_generate,
    prompt_tokens,
    read_results,
)
from lhc.nolima.needles import (
    NeedleCase,
    NeedleSet,
    NeedleTest,
    fill,
    lhc_needle_set,
    load_needle_set,
    needle_cases,
    parse_needle_set,
    rouge1_precision,
    sample_cases,
    to_json,
)
from lhc.nolima.scores import (
    base_score,
    contains,
    effective_length,
    interval_table,
    length_scores,
    pair_scores,
    plot,
    summary,
    table,
    wilson_interval,
)

__all__ = [
    "DEFAULT_TASK_TEMPLATE",
    "Haystack",
    "NeedleCase",
    "NeedleSet",
    "NeedleTest",
    "Placement",
    "PromptFormat",
    "Test",
    "base_score",
    "build",
    "clean_lines",
    "contains",
    "effective_length",
    "evaluate",
    "fill",
    "filter_lines",
    "interval_table",
    "length_scores",
    "lhc_needle_set",
    "load_needle_set",
    "make_tests",
    "common_prefix",
    "model_generate",
    "names_absent",
    "needle_cases",
    "pair_scores",
    "parse_needle_set",
    "plot",
    "prompt_tokens",
    "read_results",
    "rouge1_precision",
    "sample_cases",
    "shuffled_haystack",
    "summary",
    "table",
    "wilson_interval",
    "to_json",
]
