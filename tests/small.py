"""A small model on the generated test corpus (tests/conftest.py); importable from config files
that tests hand to `lm-train` in a subprocess, so it imports nothing that defines flags."""

from configs import tiny


def small_config(corpus_dir, **model):
  c = tiny.get_config()
  c.model.update(V=320, D=32, H=4, L=2, F=64, **model)
  c.data.update(source="array_record", dir=str(corpus_dir), seq_len=32, packing_bins=8, threads=1)
  c.train.update(steps=40, batch_size=8, lr=1e-2, warmup_steps=5, log_every_steps=10)
  c.eval.update(every_steps=20, batch_size=8)
  c.checkpoint.every_steps = 1000
  return c
