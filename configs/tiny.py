"""A small model on the embedded Shakespeare corpus: trains in a few minutes on a 2-core CPU."""

from configs import base


def get_config():
  c = base.get_config()
  c.model.update(V=2048, D=128, H=4, L=2, F=512)
  c.data.seq_len = 128
  c.train.update(steps=500, batch_size=32, lr=3e-3, warmup_steps=50, log_every_steps=25)
  c.eval.update(every_steps=250, batch_size=64)
  c.checkpoint.every_steps = 250
  return c
