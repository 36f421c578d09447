"""What the TPU compiler's cost analysis counts as bytes, on a program small enough to read whole.

  python benchmarks/bytes_probe.py [--topology=v5e:2x2] [--tokens=8192]

Compiles an MLP's two products, x [tokens, 512] @ w1 [512, 2048], GELU, @ w2 [2048, 512] in bfloat16,
for one chip of the topology, and prints the compiler's bytes accessed beside the bytes that go
through HBM (launch/aot/hlo_bytes.py: an operand or result whose layout names on-chip memory is left out),
where each array lives, the compiler's optimal time and the sum of its operations' estimated cycles
(what lm-compile's step time adds up). docs/reference/compile.md reads the output.
"""

import sys

import jax
import jax.numpy as jnp
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("topology", "v5e:2x2", "TPU topology, as lm-compile --topology.")
flags.DEFINE_integer("tokens", 8192, "Rows of x.")


def main(argv):
  del argv
  from launch.aot import compile as compile_lib, hlo_bytes
  from launch.aot.topology import CHIPS
  from lm import flops

  devices = compile_lib.topology_devices(FLAGS.topology)
  on = jax.sharding.SingleDeviceSharding(devices[0])
  shapes = [(FLAGS.tokens, 512), (512, 2048), (2048, 512)]
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=on) for s in shapes]
  compiled = jax.jit(lambda x, w1, w2: jax.nn.gelu(x @ w1) @ w2).lower(*args).compile()
  hlo, cost = compiled.as_text(), compiled.cost_analysis()
  chip = CHIPS[devices[0].device_kind]
  ops = compile_lib.per_operation(hlo, set(), flops.peak_flops(devices[:1]), chip)
  print(f"{FLAGS.topology}, x [{FLAGS.tokens}, 512] @ w1 [512, 2048], GELU, @ w2 [2048, 512], bfloat16:")
  print(f"  bytes accessed, the compiler's count: {cost['bytes accessed'] / 2**20:.1f} MiB")
  print(f"  bytes through HBM (on-chip memory left out): {hlo_bytes.hbm_bytes(hlo) / 2**20:.1f} MiB")
  for name, shape, opcode, _, _ in hlo_bytes.entry_operations(hlo):
    if opcode.endswith("-start"):  # its result aliases the source; the -done's is the copy
      continue
    where = "on chip" if hlo_bytes.shape_bytes(shape, hbm_only=True) == 0 else "in HBM"
    print(f"    {opcode:10s} {name:14s} result {hlo_bytes.shape_bytes(shape) / 2**20:6.1f} MiB {where}")
  print(f"  the compiler's optimal time: {cost['optimal_seconds'] * 1e6:.0f} us; its operations' estimated "
        f"cycles add up to {ops['xla_op_seconds'] * 1e6:.0f} us")


if __name__ == "__main__":
  sys.path.insert(0, __file__.rsplit("/", 2)[0])
  app.run(main)
