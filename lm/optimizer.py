"""AdamW with linear warmup, cosine decay and optional global-norm clipping (NanoDO's recipe)."""

import jax
import ml_collections
import optax

# train.schedule: how the cosine after the warmup ends.
#   cosine: reaches lr * end_lr_frac at the last step.
#   cosine_paper_code: the paper's code passes decay_steps = steps - warmup_steps to optax (whose
#     decay_steps already include the warmup), so the cosine ends warmup_steps early and then holds.
SCHEDULES = ("cosine", "cosine_paper_code")


def schedule(cfg: ml_collections.ConfigDict) -> optax.Schedule:
  """cfg: the `train` section."""
  name = cfg.schedule
  if name not in SCHEDULES:
    raise ValueError(f"unknown train.schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
  end = cfg.steps - (cfg.warmup_steps if name == "cosine_paper_code" else 0)
  return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
                                            decay_steps=max(end, cfg.warmup_steps + 1),
                                            end_value=cfg.lr * cfg.end_lr_frac)


def make(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """cfg: the `train` section; grad_clip <= 0 clips nothing. Norm scales, biases and other vectors
  are not decayed."""
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  clip = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
  return optax.chain(
      *clip,
      optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                  mask=decay_mask))
