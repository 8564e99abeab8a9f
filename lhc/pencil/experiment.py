"""The PENCIL experiment builder: the shared body of ``configs/pencil_*.py``.

The model is the paper's nanoGPT block expressed through ``lhc.lm.LMConfig``: pre-norm
LayerNorm without bias, RoPE on queries and keys, a GELU MLP 4 D wide, tied embeddings,
no biases, residual dropout; the optimizer is the paper's AdamW (lr 1e-3, cosine to
1e-4, 100 warmup steps, betas (0.9, 0.99), weight decay 0.1 on matrices, clip 1.0).
(nanoGPT also drops attention probabilities; lhc's attention has no dropout, so only
the residual dropout is kept.)
"""

from __future__ import annotations

import ml_collections

from lhc.pencil.problems import make_problem, tokenizer_for
from lhc.train.config import base_config, parse_arg
from lhc.train.optim import adamw_cosine

TASK = "lhc.pencil.task:PencilTask"


def model_fields(
    vocab_size: int, num_layers: int, embed_dim: int, num_heads: int, max_len: int
) -> dict:
    """The PENCIL model's ``lhc.lm.LMConfig`` fields: the official code's GPT-2-style
    decoder (LayerNorm, a GELU MLP of 4 D, tied embeddings), heads of ``D / heads``."""
    return dict(
        vocab_size=vocab_size,
        num_layers=num_layers,
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=embed_dim // num_heads,
        mlp_dim=4 * embed_dim,
        max_len=max_len,
        norm_eps=1e-5,
        tie_embeddings=True,
        norm_type="layernorm",
        mlp_type="gelu",
    )


def pencil_config(
    *,
    problem: str,
    problem_params: dict,
    trace_format: str,
    context_limit: int,
    num_layers: int,
    num_heads: int,
    embed_dim: int,
    dropout_rate: float,
    batch_size: int,
    num_steps: int,
    dtype: str = "float32",
    learning_rate: float = 1e-3,
    warmup_steps: int = 100,
    eval_instances: int = 100,
    eval_batch_size: int = 50,
    max_new_tokens: int = 50_000,
) -> ml_collections.ConfigDict:
    """A PencilTask config (see ``lhc.pencil.task``); ``trace_format`` is what the
    model is trained on and evaluated with (``config.data.format``): ``"pencil"``
    (reduced sub-sequences) or ``"cot"`` (whole chain-of-thought traces)."""
    vocab_size = tokenizer_for(make_problem(problem, **problem_params)).vocab_size
    config = base_config(TASK)
    config.num_steps = num_steps
    config.batch_size = batch_size
    config.eval_batches = 2
    config.checkpoint_every = 500
    config.data = ml_collections.ConfigDict(
        dict(
            problem=problem,
            problem_params=dict(problem_params),
            format=trace_format,
            context_limit=context_limit,
        )
    )
    config.model = ml_collections.ConfigDict(
        dict(
            **model_fields(vocab_size, num_layers, embed_dim, num_heads, context_limit),
            rope_theta=10_000.0,
            qkv_bias=False,
            dropout_rate=dropout_rate,
            dtype=dtype,
            param_dtype="float32",
            scan_layers=False,
            remat_policy="none",
            attention_impl="xla",
        )
    )
    config.optimizer = ml_collections.ConfigDict(
        adamw_cosine(
            learning_rate=learning_rate,
            warmup_steps=warmup_steps,
            end_lr_fraction=0.1,
            b2=0.99,
            weight_decay=0.1,
        )
    )
    config.pencil_eval = ml_collections.ConfigDict(
        dict(
            num_instances=eval_instances,
            batch_size=eval_batch_size,
            max_new_tokens=max_new_tokens,
            # The paper samples at temperature 0.8 with top-k 200; 0 is greedy.
            temperature=0.8,
            top_k=200,
            methods=(trace_format,),
            results="",  # a JSON-lines file of every instance's outcome
        )
    )
    return config


def sized_config(
    arg: str | None,
    *,
    problem: str,
    sizes: dict[str, tuple],
    size_param: str,
    max_new_tokens: dict[str, int],
    problem_params: dict | None = None,
    arg_name: str | None = None,
    eval_params: dict[str, dict] | None = None,
) -> ml_collections.ConfigDict:
    """The body of ``configs/pencil_<problem>.py``'s ``get_config(arg)``.

    Args:
        arg: the part after the colon: a size (a key of ``sizes``), ``format=pencil|cot``,
            ``<arg_name>=N`` (the problem's size; 0 keeps the size's default),
            ``mix=A-B`` or ``mix=A+B+C`` (train on a ``Mixture`` of those problem sizes,
            evaluated size by size) and ``runlocal`` (4 steps, 4 evaluation instances:
            a smoke test).
        problem: the problem's name.
        sizes: per size ``(context, layers, heads, width, dropout, batch, steps, dtype,
            default problem size)``; a list of problem sizes is a default mixture.
        size_param: the problem parameter the last entry sets (``num_vars``, ``size``).
        max_new_tokens: per size, the generation cap in evaluation.
        problem_params: the problem's other parameters.
        arg_name: the name of ``size_param`` in ``arg`` (default ``size_param``).
        eval_params: per size, fields of ``config.pencil_eval`` to set (e.g. the number
            of held-out instances and the temperature of a recorded experiment).
    """
    arg_name = arg_name or size_param
    arg = parse_arg(arg, size="tiny", format="pencil", runlocal=False, mix="", **{arg_name: 0})
    if arg.size not in sizes:
        raise ValueError(f"config arg size must be one of {sorted(sizes)}, got {arg.size!r}")
    context, layers, heads, width, dropout, batch, steps, dtype, default = sizes[arg.size]
    problem_size = _mix_sizes(arg.mix) if arg.mix else arg[arg_name] or default
    config = pencil_config(
        problem=problem,
        problem_params={**(problem_params or {}), size_param: problem_size},
        trace_format=arg.format,
        context_limit=context,
        num_layers=layers,
        num_heads=heads,
        embed_dim=width,
        dropout_rate=dropout,
        batch_size=batch,
        num_steps=4 if arg.runlocal else steps,
        dtype=dtype,
        eval_instances=4 if arg.runlocal else 100,
        max_new_tokens=64 if arg.runlocal else max_new_tokens[arg.size],
    )
    if not arg.runlocal:
        config.pencil_eval.update((eval_params or {}).get(arg.size, {}))
    return config


def _mix_sizes(spec: str) -> list[int]:
    """``"3-6"`` -> ``[3, 4, 5, 6]``; ``"3+5"`` -> ``[3, 5]``."""
    try:
        if "-" in spec:
            low, high = (int(x) for x in spec.split("-"))
            sizes = list(range(low, high + 1))
        else:
            sizes = [int(x) for x in spec.split("+")]
    except ValueError:
        sizes = []
    if not sizes:
        raise ValueError(f"config arg mix: expected sizes as A-B or A+B+C, got {spec!r}")
    return sizes
