"""Per-step losses of the same global batches on different meshes (run with 16 CPU devices).

Usage: mesh_losses.py CORPUS_DIR → prints JSON {mesh name: [losses]}.
"""

import json
import sys

import jax
from small import small_config

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
  print(json.dumps(results))


if __name__ == "__main__":
  main()
