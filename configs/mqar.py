"""Multi-query associative recall (data_pipelines/mqar.py): Zoology's standard grid point, scaled for a CPU.

Zoology (Arora et al. 2023, Figure 2) trains 2-layer models of width 64-512 on a vocabulary of 8,192,
sequences of 64-512 tokens holding 4-64 key-value pairs, 100,000 training and 3,000 test examples, batch
512 for 64 epochs, its learning rate tuned per width. Kept here: 2 layers, the 100,000 / 3,000 examples,
power_a 0.01 and token-0 filler (its Figure 2 configs), and its shortest sequences (64 tokens, 8 pairs).
Scaled for a CPU: a vocabulary of 512, width 64 with 4 heads, batch 64 and 3,000 steps (192,000
examples, 1.9 epochs, not 64). With Zoology's 8,192 token ids a step is slower (at these widths the
vocabulary's embedding and readout outweigh the layers) and the pairs take more steps to learn
(docs/results/mqar.md); `--config.data.vocab_size=8192` restores them. Not Zoology's: every block has
an MLP (F = 2 D; Zoology's MQAR models have none) and positions are rotary. `--config.model.D=N` scales
the width (F follows); `--config.data.num_kv_pairs=N` and `--config.data.seq_len=N` move along the grid
(pairs at most seq_len / 4).
"""

import ml_collections

from configs import base


def get_config():
  c = base.get_config()
  c.task = "mqar"
  vocab_size = ml_collections.FieldReference(512)
  c.data = ml_collections.ConfigDict(
      dict(
          vocab_size=vocab_size,
          seq_len=64,
          num_kv_pairs=8,
          power_a=0.01,  # query gaps ∝ (g + 1)^(power_a - 1); 1 is uniform
          random_filler=False,  # True: random tokens between the queries (Zoology's random_non_queries)
          train_examples=100_000,
          test_examples=3_000,
          train_seed=0,  # the fixed training set; the run's seed shuffles it
          test_seed=1,  # the fixed test set: another seed than training's
          shards=0,
      ))
  width = ml_collections.FieldReference(64)
  c.model.update(V=vocab_size, D=width, H=4, L=2, F=width * 2)
  c.train.update(steps=3000, batch_size=64, lr=1e-3, warmup_steps=200, log_every_steps=100)
  c.eval.update(every_steps=500, batch_size=32)
  c.checkpoint.update(every_steps=1000)
  return c
