"""What this CPU's matrix products reach through XLA, by operand dtype and library fusion.

  python benchmarks/cpu_products.py [--shapes=4608x128x384,576x128x64] [--fusions=default,dot]

For each [M, K] x [K, N] product: GFLOP/s in float32, with bfloat16 operands and a bfloat16 result,
and with bfloat16 operands and a float32 result (model.matmul_dtype="bfloat16"), each compiled with
the config's cpu_library_fusion value given (`default`: "", XLA's own choice). Best of 5 rounds of 20 calls.
Which form reaches a CPU's bfloat16 units (AMX, AVX-512 BF16) depends on the jaxlib and the fusion,
so this is measured, not assumed (docs/results/compositional_throughput.md).
"""

import json
import time

import jax
import jax.numpy as jnp
import workers
from absl import app, flags

from lm import xla_options
from lm.runtime import cli

_SHAPES = flags.DEFINE_list("shapes", ["4608x128x384", "576x128x64", "2048x2048x2048"], "MxKxN products.")
_FUSIONS = flags.DEFINE_list("fusions", ["default", "dot"],
                             "cpu_library_fusion values; `default`: \"\", XLA's own choice.")

FORMS = {
    "float32": (jnp.float32, None),
    "bfloat16": (jnp.bfloat16, None),
    "bfloat16 -> float32": (jnp.bfloat16, jnp.float32)
}


def gflops(m: int, k: int, n: int, operands, result, fusion: str) -> float:
  a, b = jnp.ones((m, k), operands), jnp.ones((k, n), operands)
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=result),
              compiler_options=xla_options.cpu_compiler_options("" if fusion == "default" else fusion, "cpu"))
  f(a, b).block_until_ready()
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(20):
      out = f(a, b)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - start) / 20)
  return 2 * m * k * n / best / 1e9


def main(_):
  cli.choose_platform()  # the CPU, without probing libtpu (installed with the tpu extra)
  print(workers.machine(), f"jax {jax.__version__}", workers.uptime(), sep="\n")
  rows = []
  print("| product | cpu_library_fusion | " + " | ".join(f"{f} GFLOP/s" for f in FORMS) + " |")
  print("|---|---|" + "---|" * len(FORMS))
  for shape in _SHAPES.value:
    m, k, n = (int(x) for x in shape.split("x"))
    for fusion in _FUSIONS.value:
      row = {"shape": shape, "fusion": fusion, "jax": jax.__version__}
      row.update({form: gflops(m, k, n, *dtypes, fusion) for form, dtypes in FORMS.items()})
      rows.append(row)
      print(f"| [{m}, {k}] x [{k}, {n}] | {fusion} | " + " | ".join(f"{row[f]:.0f}" for f in FORMS) + " |")
  print(workers.uptime())
  print(json.dumps(rows))


if __name__ == "__main__":
  app.run(main)
