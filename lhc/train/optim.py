"""Optimizers and learning-rate schedules from config."""

from __future__ import annotations

import jax
import optax

_SCHEDULES = ("cosine", "linear", "polynomial", "constant", "rsqrt")


def adamw_cosine(
    *,
    learning_rate: float = 2e-3,
    warmup_steps: int | None = None,
    warmup_fraction: float = 0.02,
    end_lr_fraction: float = 0.2,
    b2: float = 0.95,
    weight_decay: float = 0.001,
) -> dict:
    """``config.optimizer`` fields for AdamW at ``learning_rate`` with linear warm-up
    (``warmup_steps``, or else ``warmup_fraction`` of the run's final ``num_steps``, so
    that an override of ``num_steps`` moves it) and cosine decay to
    ``end_lr_fraction`` of it, betas (0.9, ``b2``), eps 1e-8, ``weight_decay`` and
    gradient clipping at 1.0. The defaults are the settings of GCA's official
    pre-training, which train the small models of several experiments here."""
    return dict(
        name="adamw",
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        warmup_fraction=warmup_fraction,
        schedule="cosine",
        end_lr_fraction=end_lr_fraction,
        b1=0.9,
        b2=b2,
        eps=1e-8,
        weight_decay=weight_decay,
        grad_clip_norm=1.0,
    )


def warmup_steps(opt_config, num_steps: int) -> int:
    """The warm-up length of ``make_schedule``."""
    steps, fraction = opt_config.get("warmup_steps"), opt_config.get("warmup_fraction")
    if steps is not None:
        return int(steps)
    if fraction:
        return max(round(float(fraction) * num_steps), 1)
    return 0


def make_schedule(opt_config, num_steps: int) -> optax.Schedule:
    """Linear warmup to ``learning_rate``, then ``opt_config.schedule`` decay.

    The warm-up is ``warmup_steps`` when set (not None), else ``warmup_fraction`` of
    ``num_steps`` (at least one step), else none; every length follows ``num_steps`` as
    the run has it, after its overrides.

    ``cosine``, ``linear`` and ``polynomial`` (power ``decay_power``) decay to
    ``learning_rate * end_lr_fraction`` at ``num_steps``; ``rsqrt`` decays as
    ``1/sqrt(step / warmup_steps)``.
    """
    peak = float(opt_config.learning_rate)
    warmup = warmup_steps(opt_config, num_steps)
    end = peak * float(opt_config.get("end_lr_fraction", 0.0))
    kind = opt_config.get("schedule", "cosine")
    if kind not in _SCHEDULES:
        raise ValueError(f"optimizer.schedule must be one of {_SCHEDULES}, got {kind!r}")
    decay_steps = max(num_steps - warmup, 1)
    if kind == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=end / peak if peak else 0.0)
    elif kind == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    elif kind == "polynomial":
        power = float(opt_config.get("decay_power", 1.0))
        decay = optax.polynomial_schedule(peak, end, power, decay_steps)
    elif kind == "rsqrt":
        offset = max(warmup, 1)
        decay = lambda step: peak * jax.lax.rsqrt((step + offset) / offset)
    else:
        decay = optax.constant_schedule(peak)
    if warmup <= 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def weight_decay_mask(params):
    """Decays matrices (ndim >= 2) only: no decay on biases, norm scales or scalars."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def frozen_labels(params, frozen: tuple[str, ...]):
    """``"frozen"`` for parameters whose path starts with one of ``frozen``, else ``"train"``.

    Paths are ``/``-joined parameter names, e.g. ``"col_embedder"`` or
    ``"icl_predictor/decoder"``.
    """
    prefixes = tuple(p.strip("/") for p in frozen)

    def label(path, _):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        frozen_here = any(name == p or name.startswith(p + "/") for p in prefixes)
        return "frozen" if frozen_here else "train"

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(
    opt_config, num_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds the optimizer named by ``opt_config.name`` (``adamw``, ``adafactor``, ``sgd``).

    Gradient clipping by global norm (``grad_clip_norm``; 0 disables) comes first;
    AdamW's weight decay uses ``weight_decay_mask``. Parameters under the path prefixes
    in ``opt_config.frozen`` (if present) get zero updates (``frozen_labels``).

    Returns:
      ``(transformation, schedule)``; the schedule is also used to log the learning rate.
    """
    schedule = make_schedule(opt_config, num_steps)
    name = opt_config.get("name", "adamw")
    if name == "adamw":
        core = optax.adamw(
            schedule,
            b1=float(opt_config.get("b1", 0.9)),
            b2=float(opt_config.get("b2", 0.95)),
            eps=float(opt_config.get("eps", 1e-8)),
            weight_decay=float(opt_config.get("weight_decay", 0.0)),
            mask=weight_decay_mask,
        )
    elif name == "adafactor":
        core = optax.adafactor(schedule)
    elif name == "sgd":
        core = optax.sgd(schedule, momentum=float(opt_config.get("momentum", 0.0)) or None)
    else:
        raise ValueError(f"optimizer.name must be adamw, adafactor or sgd, got {name!r}")
    clip = float(opt_config.get("grad_clip_norm", 0.0))
    if clip > 0:
        core = optax.chain(optax.clip_by_global_norm(clip), core)
    frozen = tuple(opt_config.get("frozen", ()) or ())
    if frozen:
        core = optax.multi_transform(
            {"train": core, "frozen": optax.set_to_zero()},
            lambda params: frozen_labels(params, frozen),
        )
    return core, schedule
