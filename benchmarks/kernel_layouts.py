"""Why HYLA's kernels leave the value network's per-key products on the vector unit: one tile's z
(128 queries x 128 keys x 64 of d, from 8 heads' weights and values) computed each way, and the
transposes between the layouts, as the compiler schedules them for one v5e chip.

    python benchmarks/kernel_layouts.py

z[q, k, :] = Σ_h a_h[q, k] v_h[k, :] contracts over heads with each key's own values: on the MXU it is a
product batched over keys, and comes out key-major; the kernels' per-query products (the output
Σ_k a_h φ(z), backward the cotangents through it) need it query-major. Each case is a Pallas kernel of
one step, compiled with libtpu's dumps and read like launch/aot/kernel_schedule.py does (bundles of the
program, one a cycle; the fullest units). Estimates from the compiler's schedule, not measurements.
"""

import os
import tempfile

DUMP = tempfile.mkdtemp(prefix="kernel_layouts_")
# libtpu reads its flags once, when jax first loads it.
os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") +
                                  f" --xla_jf_dump_to={DUMP} --xla_jf_dump_llo_text=true")

import shutil  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from launch.aot import kernel_schedule, topology  # noqa: E402
from lm.attention import hypernetwork as attention_hypernetwork  # noqa: E402

flags.DEFINE_string("topology", "v5e:2x2", "TPU topology; the kernels are compiled for its first chip.")

Q = K = 128
H, D = 8, 64
F32, BF16 = jnp.float32, jnp.bfloat16

# The kernels' own helpers: the heads' sum from the first term, and products batched over the leading
# axis on the MXU (over queries in the kernels, over keys here).
_sum, _batched = attention_hypernetwork._sum_terms, attention_hypernetwork._per_query


def z_whole_tile(a_ref, v_ref, o_ref):  # a [H, Q, K], vᵀ [H, D, K] -> z [Q, D, K]
  a, vt = a_ref[...], v_ref[...].astype(F32)
  o_ref[...] = _sum([a[h][:, None, :] * vt[h][None] for h in range(H)]).astype(o_ref.dtype)


def z_per_query_broadcast(a_ref, v_ref, o_ref):
  a, vt = a_ref[...], v_ref[...].astype(F32)
  o_ref[...] = jnp.stack([_sum([a[h, q][None] * vt[h] for h in range(H)]) for q in range(Q)
                         ]).astype(o_ref.dtype)


def z_per_query_rows(a_ref, v_ref, o_ref):  # the kernels' own: each row of a loaded from VMEM alone
  o_ref[...] = attention_hypernetwork._z(a_ref, v_ref[...].astype(F32)).astype(o_ref.dtype)


def z_mxu_kdq(a_ref, v_ref, o_ref):  # a [K, H, Q], v [K, H, D] -> z [K, D, Q]
  o_ref[...] = _batched(v_ref[...], a_ref[...].astype(BF16), 1, 1).astype(o_ref.dtype)


def z_mxu_kqd(a_ref, v_ref, o_ref):  # -> z [K, Q, D]
  o_ref[...] = _batched(a_ref[...].astype(BF16), v_ref[...], 1, 1).astype(o_ref.dtype)


def transpose_3d(x_ref, o_ref):  # [K, D, Q] -> [Q, D, K]
  o_ref[...] = jnp.transpose(x_ref[...], (2, 1, 0))


def transpose_through_d(x_ref, o_ref):  # [K, D, Q] -> [D, K, Q] -> [D, Q, K] -> [Q, D, K]
  o_ref[...] = jnp.swapaxes(jnp.swapaxes(jnp.swapaxes(x_ref[...], 0, 1), 1, 2), 0, 1)


def transpose_2d(x_ref, o_ref):  # [K, D·Q] -> [D·Q, K]
  o_ref[...] = x_ref[...].T


CASES = [
    ("z on the vector unit, [Q, d, K] (keys on lanes), the whole tile per head", z_whole_tile,
     [((H, Q, K), F32), ((H, D, K), BF16)], ((Q, D, K), BF16)),
    ("z on the vector unit, [Q, d, K], one query at a time, a's rows broadcast from registers",
     z_per_query_broadcast, [((H, Q, K), F32), ((H, D, K), BF16)], ((Q, D, K), BF16)),
    ("the same, a's rows loaded from VMEM one at a time, replicated over sublanes (the kernels now)",
     z_per_query_rows, [((H, Q, K), F32), ((H, D, K), BF16)], ((Q, D, K), BF16)),
    ("z on the MXU batched over keys, out [K, d, Q]", z_mxu_kdq, [((K, H, Q), F32),
                                                                  ((K, H, D), BF16)], ((K, D, Q), BF16)),
    ("z on the MXU batched over keys, out [K, Q, d]", z_mxu_kqd, [((K, H, Q), F32),
                                                                  ((K, H, D), BF16)], ((K, Q, D), BF16)),
    ("transpose [K, d, Q] -> [Q, d, K], bfloat16", transpose_3d, [((K, D, Q), BF16)], ((Q, D, K), BF16)),
    ("the same through [d, K, Q] and [d, Q, K]", transpose_through_d, [((K, D, Q), BF16)], ((Q, D, K), BF16)),
    ("transpose [K, d·Q] -> [d·Q, K] (2-D; not the layout needed)", transpose_2d, [((K, D * Q), BF16)],
     ((D * Q, K), BF16)),
]


def main(argv):
  del argv
  chip = SingleDeviceSharding(topology.topology_devices(flags.FLAGS.topology)[0])
  print(f"One tile's z and its transposes, compiled for one chip of {flags.FLAGS.topology} (the compiler's "
        "schedule: bundles, one a cycle, no stalls; estimates)")
  print("| case | bundles | fullest units (slots used per bundle / slots) |")
  print("|---|---|---|")
  try:
    for i, (what, body, ins, out) in enumerate(CASES):
      name = f"layout_case_{i}"
      call = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(*out), name=name,
                            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 * 2**20))
      jax.jit(call).lower(*(jax.ShapeDtypeStruct(s, t, sharding=chip) for s, t in ins)).compile()
      units = kernel_schedule.units(DUMP, name)
      busy = sorted(units.items(), key=lambda u: -u[1]["used"] / u[1]["slots"])[:3]
      print(
          f"| {what} | {kernel_schedule.bundles(DUMP, name):,} | " +
          ", ".join(f"{u} {v['used']:.2f}/{v['slots']}" for u, v in busy) + " |", flush=True)
  finally:
    shutil.rmtree(DUMP, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
