"""SRAVEN (docs/reference/paper.md section 4) as the paper's code runs it: 4 layers, width 128, 16 heads,
q/k/v width 64, 20M instances. docs/reference/compositional_setup.md compares every field with the paper's
code.

Shorten the budget with `--config.train.instances=N` (steps follow); scale the model with
`--config.width=2` (D, H, qkv_dim and F are multiplied: 4 dimensions per head at every width, as in
the paper's code). Single-head models: `--config.model.H=1`.
"""

import ml_collections

from configs import base
from data_pipelines import sraven


def get_config():
  c = base.get_config()
  c.task = "sraven"
  c.width = ml_collections.FieldReference(1)  # the paper's width multiplier (1, 2, 4)
  width = c.get_ref("width")  # a reference, so that --config.width=N reaches the fields below
  c.model.update(V=sraven.NUM_VALUES, input_dim=sraven.NUM_VALUES, L=4, causal=False, attention_dropout=0.1,
                 positions="relative_bias", relative_buckets=sraven.SEQ_LEN,
                 relative_max_distance=sraven.SEQ_LEN, relative_bidirectional=False,
                 relative_bias_per_layer=True)
  # The paper code's parametrisation (flax's Dense and Embed defaults): biases in every projection,
  # output weights at 1/sqrt(fan-in), bias tables at std buckets^-0.5 (docs/reference/compositional_setup.md).
  c.model.update(projection_bias=True, residual_init="fan_in", relative_bias_std=sraven.SEQ_LEN**-0.5)
  c.model.D, c.model.H, c.model.qkv_dim, c.model.F = width * 128, width * 16, width * 64, width * 256
  c.data = ml_collections.ConfigDict(
      dict(
          split_seed=-1,  # which 82 of the 330 tasks are held out; -1: drawn from the run's seed
          frac_ood=0.25,
          permute_features=True,  # per-column feature permutation ("finding correspondences")
          shards=0,  # logical data shards; 0: one per process (see lm/train.py HostData)
      ))
  instances = ml_collections.FieldReference(20_000_000)  # the paper's main budget (10M-40M)
  batch_size = ml_collections.FieldReference(128)
  c.train.update(batch_size=batch_size, lr=1e-3, warmup_steps=1000, schedule="cosine_paper_code",
                 end_lr_frac=0.1, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, grad_clip=0.0,
                 log_every_steps=100)
  c.train.instances = instances
  c.train.steps = instances // batch_size
  # Periodic evaluations on 4,096 instances per set; the final one on the paper's 51,200.
  c.eval.update(every_steps=5000, batch_size=512, batches=8, final_batches=100)
  c.checkpoint.update(every_steps=5000)
  # On CPU, XLA's own fusion (no YNNPACK library fusion), and the batch of 128 in 8 parts of 16 whose
  # gradients are summed, each part split over 2 devices: the same step (attention dropout's mask is
  # one per step either way), with each device's [8, H, T, T] attention arrays small enough for a
  # core's cache. This is the fastest CPU setting measured for every variant
  # (docs/results/compositional_throughput.md). On an accelerator, where larger products are faster,
  # set train.microbatches=1 (cpu_devices and cpu_library_fusion are CPU-only).
  c.cpu_library_fusion = ""
  c.train.microbatches = 8
  c.cpu_devices = 2
  return c
