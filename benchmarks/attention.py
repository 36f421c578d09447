"""Forward+backward time and peak memory of each attention preset and implementation, as
ratios to softmax attention through jax.nn.dot_product_attention measured in the same run.

  python benchmarks/attention.py --seq_lens=256,1024,4096 --out=docs/results/attention_speed.md

Time: the fastest of --repeats calls of a jitted gradient of sum(out) w.r.t. q, k, v (the minimum, as
other processes on a shared host only ever add time). Memory: the compiled program's peak footprint from
compiled.memory_analysis(): inputs (q, k, v) + outputs (their gradients) + scratch. Inputs and outputs are
the same for every implementation; scratch is where [b, h, t, t] or [b, t, t, d] tensors would live.
"""

import sys
import time

import jax
from absl import app, flags

from lm import attention

FLAGS = flags.FLAGS
flags.DEFINE_list("seq_lens", ["256", "512", "1024", "2048", "4096", "8192"], "Sequence lengths.")
flags.DEFINE_integer("batch", 1, "Batch size.")
flags.DEFINE_integer("heads", 8, "Heads (the c4_50m config: 8 of width 64).")
flags.DEFINE_integer("head_dim", 64, "Head width.")
flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (after one warm-up call).")
flags.DEFINE_integer(
    "reference_max_len", 1024, "Longest sequence to run impl reference at (its "
    "HYLA tensor is batch x seq² x head_dim floats).")
flags.DEFINE_string("out", "", "Write the markdown table here too.")

# (preset, impl); the first is the baseline every ratio divides by.
RUNS = (("softmax", "dot_product"), ("softmax", "auto"), ("softmax", "blocked"), ("linear", "auto"),
        ("linear", "blocked"), ("hyla", "auto"), ("softmax", "reference"), ("linear", "reference"),
        ("hyla", "reference"))


def measure(preset: str, impl: str, seq_len: int) -> tuple[float, int]:
  """Seconds per forward+backward call and the compiled program's peak bytes."""
  shape = (FLAGS.batch, seq_len, FLAGS.heads, FLAGS.head_dim)
  q, k, v = (jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(0), 3))
  loss = lambda q, k, v: attention.attend(q, k, v, **attention.preset(preset), impl=impl).sum()
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
  jax.block_until_ready(compiled(q, k, v))
  times = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v))
    times.append(time.perf_counter() - start)
  m = compiled.memory_analysis()
  return min(times), (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes -
                      m.alias_size_in_bytes)


def _ratio(r: float) -> str:
  return f"{r:.2f}x" if r >= 0.1 else f"{r:.3f}x"


def auto_impl(preset: str) -> str:
  """What impl auto runs for `preset` on this platform at the benchmarked lengths."""
  platform = jax.default_backend() if jax.default_backend() in attention.PLATFORMS else "gpu"
  knobs = attention.Knobs(**attention.preset(preset))
  runs = []  # [impl, first length, last length]
  for t in map(int, FLAGS.seq_lens):
    impl = attention.choose_impl(knobs, attention.Call(t, t, True, False, False))[platform]
    if runs and runs[-1][0] == impl:
      runs[-1][2] = t
    else:
      runs.append([impl, t, t])
  if len(runs) == 1:
    return runs[0][0]
  return ", ".join(f"{impl} from {first} to {last} tokens" for impl, first, last in runs)


def main(argv):
  del argv
  runs = list(RUNS)
  header = ("| seq | softmax dot_product: ms, MiB | " +
            " | ".join(f"{p} {i}: time, mem" for p, i in runs[1:]) + " | hyla auto / softmax auto |")
  lines = [header, "|" + "---|" * (len(runs) + 2)]
  print(header, flush=True)
  for seq_len in map(int, FLAGS.seq_lens):
    results = {}
    for preset, impl in runs:
      if impl == "reference" and seq_len > FLAGS.reference_max_len:
        continue
      results[preset, impl] = measure(preset, impl, seq_len)
    base_s, base_bytes = results[runs[0]]
    cells = [f"{base_s * 1e3:.1f} ms, {base_bytes / 2**20:.1f} MiB"]
    for run in runs[1:]:
      if run in results:
        s, b = results[run]
        cells.append(f"{_ratio(s / base_s)}, {_ratio(b / max(base_bytes, 1))}")
      else:
        cells.append("—")
    (hyla_s, hyla_b), (soft_s, soft_b) = results["hyla", "auto"], results["softmax", "auto"]
    cells.append(f"{_ratio(hyla_s / soft_s)}, {_ratio(hyla_b / soft_b)}")
    lines.append(f"| {seq_len} | " + " | ".join(cells) + " |")
    print(lines[-1], flush=True)
  if FLAGS.out:
    device = jax.devices()[0]
    with open(FLAGS.out, "w") as f:
      f.write(f"# Attention benchmark\n\nForward+backward of the attention core alone (gradient of sum(out) "
              f"w.r.t. q, k, v), batch {FLAGS.batch}, {FLAGS.heads} heads of width {FLAGS.head_dim}, "
              f"float32, causal, on {device.platform} ({device.device_kind}, {jax.device_count()} "
              f"device(s)). Each cell: time and peak memory (inputs + outputs + scratch) as ratios to "
              f"softmax attention through jax.nn.dot_product_attention (impl dot_product) at the same "
              f"length, measured in the same run (the last column: HYLA over softmax, both impl auto); "
              f"`—`: not run. `auto` is what the model uses by default on this platform: "
              f"{', '.join(f'{p} → {auto_impl(p)}' for p in ('softmax', 'linear', 'hyla'))}.\n\n"
              f"Command: `python benchmarks/attention.py {' '.join(sys.argv[1:])}`\n\n")
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  app.run(main)
