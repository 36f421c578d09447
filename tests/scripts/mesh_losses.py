"""Per-step losses of the same global batches on different meshes (run with 16 CPU devices).

Usage: mesh_losses.py CORPUS_DIR → prints JSON {model: {mesh name: [losses]}}: the language model on
the corpus (also at 128 tokens, a length the TPU kernels take, whose branch initialisation traces on
one row), and SRAVEN with attention dropout (one mask per step, shared over the batch however the
batch is split: over devices, as cpu_devices does on a CPU host, and into microbatches).
"""

import json
import sys

import jax
from small import small_config, tiny_compositional

from configs import sraven
from lm.experiment import Experiment
from lm.train import HostData


def losses(config, devices, steps=6):
  exp = Experiment(config, devices)
  data, state, out = HostData(exp), exp.init_state(), []
  for _ in range(steps):
    state, stats = exp.train_step(state, exp.global_batch(data.next()))
    out.append(float(stats["loss"]))
  return out


def main():
  results = {}
  meshes = {
      "1 device": (dict(data=1, fsdp=1, tensor=1), 1),
      "16 devices data=4 fsdp=2 tensor=2": (dict(data=4, fsdp=2, tensor=2), 16),
      "8 devices fsdp=8": (dict(data=1, fsdp=8, tensor=1), 8)
  }
  for name, (mesh, n) in meshes.items():
    c = small_config(sys.argv[1])
    c.train.batch_size = 16
    c.mesh.update(mesh)
    results[name] = losses(c, jax.devices()[:n])
  c = small_config(sys.argv[1])
  c.train.update(batch_size=16, microbatches=2)
  c.mesh.update(data=4, fsdp=2, tensor=2)
  results["16 devices, 2 microbatches"] = losses(c, jax.devices())
  long = {}
  for name, n in (("1 device", 1), ("2 devices", 2)):
    c = small_config(sys.argv[1])
    c.data.seq_len = 128
    c.train.batch_size = 4
    long[name] = losses(c, jax.devices()[:n], steps=3)
  compositional = {}
  for name, n, k in (("1 device", 1, 1), ("2 devices, 4 microbatches", 2, 4)):
    c = tiny_compositional(sraven, attention_dropout=0.3)
    c.train.microbatches = k
    compositional[name] = losses(c, jax.devices()[:n])
  print(json.dumps({"language model": results, "language model, 128 tokens": long, "sraven": compositional}))


if __name__ == "__main__":
  main()
