"""The TPU hypernetwork kernels' vector-unit work per training step, counted from their programs.

  python benchmarks/hypernetwork_kernel.py [--rows=16 --seq_len=512 --heads=8 --head_dim=64 --layers=6]

The compiler reports no time for a Pallas kernel, and the kernels (lm/attention_hypernetwork.py) run
the value network's products on the vector unit, which its FLOP count at the MXU's peak does not
describe. This traces one chip's forward and backward pass through the kernels (the defaults are
configs/c4_50m.py on v5e:4x4: 16 rows of 512 tokens per chip, 8 heads of 64, 6 layers), walks each
kernel's program and counts, for the body that runs on every visible tile, the float32 element
operations of its element-wise operations and reductions (matrix products go to the MXU and are
counted apart; broadcasts, reshapes and slices are not counted). Multiplied by the visible tiles of
the grid, that is the vector unit's work per step; divided by the vector unit's rate it is a time.
The rate is an assumption, not a measurement: --vector_ops_per_cycle (default 2,048: 8 sublanes x
128 lanes x 2 ALUs, the layout Google published for earlier TPU generations) at --clock_hz (1.5 GHz:
v5e's 197 TFLOP/s over its four 128 x 128 MXUs). Prints JSON.
"""

import json
import math

import jax
import jax.numpy as jnp
from absl import app, flags

from lm import attention, attention_hypernetwork as kernels

flags.DEFINE_integer("rows", 16, "batch rows per chip")
flags.DEFINE_integer("seq_len", 512, "tokens per row")
flags.DEFINE_integer("heads", 8, "attention heads")
flags.DEFINE_integer("head_dim", 64, "dimensions per head")
flags.DEFINE_integer("layers", 6, "layers running the kernels")
flags.DEFINE_string("preset", "hyla", "attention preset")
flags.DEFINE_float("vector_ops_per_cycle", 2048, "float32 element operations per cycle (assumed)")
flags.DEFINE_float("clock_hz", 1.5e9, "the chip's clock (assumed)")
FLAGS = flags.FLAGS

# Reshapes, broadcasts and slices move data; iota and comparisons of positions form the mask once per
# tile on [BQ, BK], which is counted like any element-wise operation.
NOT_COUNTED = {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "slice", "dynamic_slice", "concatenate", "get",
    "swap", "program_id", "num_programs", "convert_element_type", "dot_general", "cond", "pjit", "jit",
    "custom_jvp_call", "iota", "transpose"
}
REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min"}


def _count(jaxpr) -> tuple[int, int]:
  """(vector element operations, MXU multiply-adds) of a jaxpr, into nested calls; of a cond, its
  largest branch."""
  vector = mxu = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "cond":
      vector_b, mxu_b = max(_count(branch.jaxpr) for branch in eqn.params["branches"])
      vector, mxu = vector + vector_b, mxu + mxu_b
    elif "jaxpr" in eqn.params and name not in ("pallas_call",):
      inner = eqn.params["jaxpr"]
      vector_b, mxu_b = _count(getattr(inner, "jaxpr", inner))
      vector, mxu = vector + vector_b, mxu + mxu_b
    elif name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      mxu += math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[a] for a in lhs_contract)
    elif name in REDUCTIONS:
      vector += math.prod(eqn.invars[0].aval.shape)
    elif name not in NOT_COUNTED:
      vector += sum(math.prod(v.aval.shape) for v in eqn.outvars)
  return vector, mxu


def _kernels(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", None)
      if inner is not None and hasattr(getattr(inner, "jaxpr", inner), "eqns"):
        yield from _kernels(getattr(inner, "jaxpr", inner))


def main(_):
  B, T, H, d = FLAGS.rows, FLAGS.seq_len, FLAGS.heads, FLAGS.head_dim
  knobs = attention.Knobs(**attention.preset(FLAGS.preset))
  x = jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16)
  loss = lambda q, k, v: kernels.attend_pallas_hypernetwork(q, k, v, knobs=knobs).astype(jnp.float32).sum()
  program = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x).jaxpr
  rate = FLAGS.vector_ops_per_cycle * FLAGS.clock_hz
  rows, total = [], 0.0
  for eqn in _kernels(program):
    vector, mxu = _count(eqn.params["jaxpr"])
    grid = eqn.params["grid_mapping"].grid
    keys_outer = eqn.params["name"].endswith("dkdv")
    visible = B * kernels.visible_tiles(T, causal=True, keys_outer=keys_outer)
    seconds = FLAGS.layers * visible * vector / rate
    total += seconds
    rows.append(
        dict(kernel=eqn.params["name"], grid=list(grid), visible_tiles=visible, vector_ops_per_tile=vector,
             mxu_multiply_adds_per_tile=mxu, vector_ops_per_step=FLAGS.layers * visible * vector,
             vector_ms_per_step=1e3 * seconds))
  print(json.dumps(dict(rows=rows, vector_ops_per_second=rate, vector_ms_per_step=1e3 * total), indent=1))


if __name__ == "__main__":
  app.run(main)
