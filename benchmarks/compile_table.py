"""lm-compile's numbers for the paper's C4 run, per attention variant and context length.

  python benchmarks/compile_table.py --topology=v5e:4x4 --out=docs/results/compile_v5e.md

Compiles the full configs/c4_50m.py train step for the topology (as `lm-compile` does) for every
attention in --attentions at every context in --contexts. The token budget stays 130B: at context T
the batch is 256 x 512 / T rows and the step count follows. Memory and FLOPs are the compiler's;
step and run times are estimates from them (docs/reference/compile.md), not measurements.
"""

import importlib.metadata
import time

import jax
from absl import app, flags

from configs import c4_50m
from launch.aot import compile as compile_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("topology", "v5e:4x4", "TPU topology, as lm-compile --topology.")
flags.DEFINE_list(
    "attentions", ["softmax", "linear", "hyla", "hyla+hyla+softmax"],
    "Attention presets; + joins a hybrid's per-layer presets (model.attention=hyla,hyla,softmax).")
flags.DEFINE_list("contexts", ["512", "1024"], "Sequence lengths.")
flags.DEFINE_string("out", "", "Write the markdown table here too, keeping whatever the file holds below "
                    "its table.")

TOKENS_PER_STEP = 256 * 512  # the paper's batch at context 512


def config_for(attention: str, seq_len: int):
  c = c4_50m.get_config()
  rows = TOKENS_PER_STEP // seq_len
  c.model.update(attention=attention.replace("+", ","), max_len=max(c.model.max_len, seq_len))
  c.data.seq_len = seq_len
  c.train.update(batch_size=rows, steps=int(c4_50m.TOKENS // (rows * seq_len)))
  return c


def row(r: dict) -> str:
  gib = compile_lib.GiB
  if not r["fits"]:
    return (f"| {r['attention']} | {r['seq_len']} | {r['batch_rows']} | does not fit: "
            f"{r['compiler_message']} | | | | | | {r['compile_seconds']:.0f} |")
  return (
      f"| {r['attention']} | {r['seq_len']} | {r['batch_rows']} | "
      f"{r['total_bytes'] / gib:.2f} GiB ({r['argument_bytes'] / gib:.2f} + "
      f"{r['temp_bytes'] / gib:.2f}) | {r['compiler_flops'] / 1e12:.2f} / "
      f"{r['model_flops'] / 1e12:.2f} | {r['compiler_bytes'] / 1e9:.1f} / {r['hbm_traffic_bytes'] / 1e9:.1f} | "
      f"{r['estimated_step_seconds'] * 1e3:.1f} ms | {r['estimated_hours']:.1f} h | "
      f"{r['roofline_step_seconds'] * 1e3:.1f} ms, {r['roofline_hours']:.1f} h ({r['bound']}) | "
      f"{r['compile_seconds']:.0f} |")


def _below_the_table(path: str) -> str:
  """What an earlier --out file holds after its table (the analysis written beside the numbers)."""
  try:
    lines = open(path).read().splitlines(keepends=True)
  except FileNotFoundError:
    return ""
  start = next((i for i, line in enumerate(lines) if line.startswith("| attention |")), len(lines))
  end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
  return "".join(lines[end:])


def main(argv):
  del argv
  header = (
      "| attention | context | rows per step | memory per chip: total (arguments + temporaries) "
      "| TFLOPs per chip and step: compiler / model | GB per chip and step: compiler's count / through HBM "
      "| estimated step time | estimated time for 130B tokens "
      "| roofline: step, 130B tokens (bound) | compile s |\n"
      "|---|---|---|---|---|---|---|---|---|---|")
  print(header, flush=True)
  rows, start = [], time.perf_counter()
  for seq_len in map(int, FLAGS.contexts):
    for attention in FLAGS.attentions:
      r = compile_lib.report(config_for(attention, seq_len), FLAGS.topology)
      rows.append(row(r))
      print(rows[-1], flush=True)
  if FLAGS.out:
    chips = f"{r['chips']} chips of {r['device_kind']} with {r['hbm_bytes'] / compile_lib.GiB:.0f} GiB HBM each"
    below = _below_the_table(FLAGS.out)
    with open(FLAGS.out, "w") as f:
      f.write(f"# lm-compile on {FLAGS.topology}: configs/c4_50m.py by attention and context\n\n"
              f"The full c4_50m train step ({r['num_params']:,} parameters, bfloat16 compute, float32 "
              f"state, mesh {r['mesh']}) compiled ahead of time for {FLAGS.topology}, {chips}, on a "
              f"CPU host with libtpu {importlib.metadata.version('libtpu')} and jax {jax.__version__}, "
              f"{TOKENS_PER_STEP:,} tokens per step at every context (130B tokens in "
              f"{r['steps']:,} steps). Memory and FLOPs are the compiler's, per chip; the model's FLOPs "
              "are 6 per parameter and token plus the attention core (lm/flops.py). **Step and run "
              "times are estimates, not measurements**: the step's operations one after another, as a "
              "chip's one core runs them, XLA's at the compiler's estimate of each and the Pallas "
              "kernels (the attention's and the cross-entropy's) as the TPU compiler scheduled them, "
              "collectives left out; the roofline, max(FLOPs / peak, the compiler's bytes / bandwidth) "
              "of the rest plus the attention's kernels, is shown beside it. "
              "docs/reference/compile.md says how far to trust "
              f"them. Made in {time.perf_counter() - start:.0f} s by\n\n"
              f"    python benchmarks/compile_table.py --topology={FLAGS.topology} "
              f"--attentions={','.join(FLAGS.attentions)} --contexts={','.join(FLAGS.contexts)} "
              f"--out={FLAGS.out}\n\n{header}\n" + "\n".join(rows) + "\n" + below)


if __name__ == "__main__":
  app.run(main)
