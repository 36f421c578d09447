"""The compiler's own schedule of the attention's Pallas TPU kernels (HYLA's, or with --impl=splash
softmax's), as a table: bundles per grid step and the units that fill them (launch/aot/kernel_schedule.py
reads them from libtpu's LLO dumps).

    python benchmarks/kernel_schedule.py [--impl=splash --preset=softmax] [--rows=16 --seq_len=512
        --heads=8 --head_dim=64] [--json=FILE]

Defaults: one v5e chip's share of configs/c4_50m.py (256 rows over 16 chips, 512 tokens, 8 heads of 64,
bfloat16). The time is bundles x visible grid steps at the chip's clock (lm-compile's table of chips),
with no stall: an estimate from the compiler's schedule, not a measurement. What lm-compile adds to a
step for each layer's kernels.
"""

import json

from absl import app, flags

from launch.aot import kernel_schedule, topology
from lm import attention

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 16, "Rows (sequences) on the chip.")
flags.DEFINE_integer("seq_len", 512, "Tokens per row.")
flags.DEFINE_integer("heads", 8, "Attention heads.")
flags.DEFINE_integer("head_dim", 64, "Width of a head.")
flags.DEFINE_enum(
    "impl", "pallas_hypernetwork_keep_z", kernel_schedule.TIMED, "The attention implementation whose "
    "kernels to compile: HYLA's (pallas_hypernetwork_keep_z, what auto takes at 512 tokens, or "
    "pallas_hypernetwork, which recomputes z) or softmax's splash kernels (splash).")
flags.DEFINE_string(
    "preset", "hyla", "An attention preset the kernels run (hyla, hyla_no_rms_head, ...; "
    "softmax for splash).")
flags.DEFINE_bool("causal", True, "Causal attention.")
flags.DEFINE_bool("segments", True, "Packed documents' segment ids (as configs/c4_50m.py's batches carry).")
flags.DEFINE_string("dtype", "bfloat16", "q, k, v dtype.")
flags.DEFINE_string("topology", "v5e:4x4", "TPU topology; the kernels are compiled for its first chip.")
flags.DEFINE_string("json", "", "Also write the result here.")


def main(argv):
  del argv
  r = kernel_schedule.schedule(impl=FLAGS.impl, knobs=attention.preset(FLAGS.preset), rows=FLAGS.rows,
                               seq_len=FLAGS.seq_len, heads=FLAGS.heads, head_dim=FLAGS.head_dim,
                               dtype=FLAGS.dtype, causal=FLAGS.causal, segments=FLAGS.segments,
                               topology=FLAGS.topology)
  clock_ghz = topology.CHIPS[r["device_kind"]].clock_hz / 1e9
  print(
      f"{FLAGS.preset}'s {FLAGS.impl} kernels compiled for one chip of {FLAGS.topology}: "
      f"{FLAGS.rows} rows x {FLAGS.seq_len} tokens, {FLAGS.heads} heads of {FLAGS.head_dim}, {FLAGS.dtype}, causal={FLAGS.causal}, "
      f"segments={FLAGS.segments}")
  print("| kernel | bundles per grid step | visible grid steps | ms per layer (estimate: bundles x steps at "
        f"{clock_ghz} GHz, no stalls) | fullest units (slots used per bundle / slots) |")
  print("|---|---|---|---|---|")
  total = 0.0
  busy = lambda units: ", ".join(f"{u} {v['used']:.2f}/{v['slots']}" for u, v in sorted(
      units.items(), key=lambda u: -u[1]["used"] / u[1]["slots"])[:3])
  for name in ("forward", "backward"):
    k = r[name]
    ms = k["cycles"] / (clock_ghz * 1e6)
    total += ms
    programs = k["programs"]
    print(f"| {name} | {k['bundles_per_step']:,} | {k['visible_steps']:,} | {ms:.2f} | " +
          (busy(k["units"]) if len(programs) == 1 else "(the programs' average)") + " |")
    for p in programs if len(programs) > 1 else ():  # built and counted alone (launch/aot/kernel_schedule.py)
      print(f"| {name}, tiles {p['tiles']} | {p['bundles_per_step']:,} | {p['steps']:,} | "
            f"{p['bundles_per_step'] * p['steps'] / (clock_ghz * 1e6):.2f} | {busy(p['units'])} |")
  print(f"both kernels: {total:.2f} ms per layer")
  for name in ("forward", "backward"):
    print(f"{name}, most frequent operations: " +
          ", ".join(f"{op} {n}" for op, n in list(r[name]["operations"].items())[:12]))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(
          dict(
              settings={
                  f: FLAGS[f].value for f in ("impl", "rows", "seq_len", "heads", "head_dim", "preset",
                                              "causal", "dtype", "topology")
              }, **r), f, indent=1)


if __name__ == "__main__":
  app.run(main)
