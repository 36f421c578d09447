"""SRAVEN (PAPER.md section 4): 4 layers, width 128, 16 heads, q/k/v width 64, 20M instances.

Shorten the budget with `--config.train.instances=N` (steps follow); scale the model with
`--config.width=2` (D, qkv_dim and F are multiplied). Single-head models: `--config.model.H=1`.
"""

import ml_collections

from configs import base
from data_pipelines import sraven


def get_config():
  c = base.get_config()
  c.task = "sraven"
  c.width = ml_collections.FieldReference(1)  # the paper's width multiplier (1, 2, 4)
  c.model.update(V=sraven.NUM_VALUES, input_dim=sraven.NUM_VALUES, L=4, H=16, causal=False,
                 positions="relative_bias", attention_dropout=0.1)
  c.model.D, c.model.qkv_dim, c.model.F = c.width * 128, c.width * 64, c.width * 256
  c.data = ml_collections.ConfigDict(dict(
      split_seed=0,           # which 82 of the 330 tasks are held out
      frac_ood=0.25,
      permute_features=True,  # per-column feature permutation ("finding correspondences")
      shards=0,               # logical data shards; 0: one per process (see lm/train.py HostData)
  ))
  instances = ml_collections.FieldReference(20_000_000)  # the paper's main budget (10M-40M)
  batch_size = ml_collections.FieldReference(128)
  c.train.update(batch_size=batch_size, lr=1e-3, warmup_steps=1000, end_lr_frac=0.0, b2=0.999,
                 eps=1e-8, weight_decay=0.1, log_every_steps=100)
  c.train.instances = instances
  c.train.steps = instances // batch_size
  c.eval.update(every_steps=5000, batch_size=512, batches=8)
  c.checkpoint.update(every_steps=5000)
  return c
