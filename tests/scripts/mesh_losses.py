"""Per-step losses of the same global batches on different meshes (run with 16 CPU devices).

Usage: mesh_losses.py CORPUS_DIR → prints JSON {model: {mesh name: [losses]}}: the language model on
the corpus at 128 tokens (a length the TPU kernels take, whose branch initialisation traces on one row,
which every mesh must shard), and SRAVEN with attention dropout (one mask per step, shared over the
batch however the batch is split: over devices, as cpu_devices does on a CPU host, and into
microbatches); and under "all-reduces", for each mesh, the shapes of the all-reduces in its compiled
train step (on CPU, with the parameters whole on every device, the step sums the gradients itself, as
one vector), how many parameters are whole on every device and how many all-gathers the step holds.
"""

import json
import re
import sys

import jax
from small import small_config, tiny_compositional

from configs import sraven
from lm.experiment import Experiment
from lm.train import HostData

ALL_REDUCES = {}


def losses(config, devices, name=None):
  exp = Experiment(config, devices)
  data, state, out = HostData(exp), exp.init_state(), []
  for _ in range(6):
    state, stats = exp.train_step(state, exp.global_batch(data.next()))
    out.append(float(stats["loss"]))
  if name:
    hlo = exp.lower_train_step().compile().as_text()
    ALL_REDUCES[name] = {
        "shapes": re.findall(r"= (.*?) all-reduce\(", hlo),
        "parameters": exp.num_params,
        "sums_on_devices": exp.sums_on_devices,
        "params_whole": sum(s.is_fully_replicated for s in jax.tree.leaves(exp.state_shardings.params)),
        "all_gathers": len(re.findall(r"all-gather(?:-start)?\(", hlo)),
    }
  return out


def main():
  results = {}
  meshes = {
      "1 device": (dict(data=1, fsdp=1, tensor=1), 1, 1),
      "8 devices fsdp=8": (dict(data=1, fsdp=8, tensor=1), 8, 1),
      "16 devices data=4 fsdp=2 tensor=2, 2 microbatches": (dict(data=4, fsdp=2, tensor=2), 16, 2),
      "4 devices data=4, 2 microbatches": (dict(data=4, fsdp=1, tensor=1), 4, 2),
      "4 devices data=4, state over data, 2 microbatches": (dict(data=4, fsdp=1, tensor=1,
                                                                 shard_state_over_data=True), 4, 2),
  }
  for name, (mesh, n, k) in meshes.items():
    c = small_config(sys.argv[1])
    c.data.seq_len = 128
    c.train.update(batch_size=16, microbatches=k)
    c.mesh.update(mesh)
    results[name] = losses(c, jax.devices()[:n], name=name if n > 1 else None)
  compositional = {}
  for name, n, k in (("1 device", 1, 1), ("2 devices, 4 microbatches", 2, 4)):
    c = tiny_compositional(sraven, attention_dropout=0.3)
    c.train.microbatches = k
    compositional[name] = losses(c, jax.devices()[:n])
  print(json.dumps({"language model": results, "sraven": compositional, "all-reduces": ALL_REDUCES}))


if __name__ == "__main__":
  main()
