"""AdamW with linear warmup, cosine decay and global-norm clipping (NanoDO's recipe)."""

import jax
import ml_collections
import optax


def schedule(cfg: ml_collections.ConfigDict) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.end_lr_frac)


def make(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """cfg: the `train` section. Norm scales, biases and other vectors are not decayed."""
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay, mask=decay_mask))
