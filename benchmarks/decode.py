"""Decoding speed and decoding-state memory of each attention variant as the context grows.

  python benchmarks/decode.py --out=docs/results/decode_speed.md

For every context length C (prompt plus generated tokens) and batch size: a random-init model of
c4_50m's shape (float32) in decode mode over C positions, its decoding state at position C - n
(lm-sample allocates the state for the whole context at the start, so the last n tokens are the ones
the state of a context of C tokens serves), then n greedy tokens decoded one call each, as lm-sample
does. Time: per token, the min and the median over --repeats; the variants take turns within each
repeat, so a busy host slows all of them alike. Memory: bytes of the decoding state (every layer's
key/value cache or recurrent state), which is what grows with C; the parameters are the same for all.
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from lm import decode, model as model_lib

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["128", "512", "2048", "8192"], "Context lengths C (prompt + generated).")
flags.DEFINE_list("batches", ["1", "16"], "Batch sizes (samples decoded together).")
flags.DEFINE_list("variants", ["softmax", "linear", "hyla", "hyla+hyla+softmax", "linear+linear+softmax"],
                  "model.attention per variant; + joins per-layer presets (a hybrid).")
flags.DEFINE_integer("tokens", 4, "Tokens timed per measurement (the last of the context).")
flags.DEFINE_integer("repeats", 3, "Measurements per (context, batch, variant).")
# c4_50m's shape: 6 layers of width 512, 8 heads of 64, MLP 2048, 32,000-piece vocabulary.
flags.DEFINE_integer("D", 512, "Model width.")
flags.DEFINE_integer("H", 8, "Heads.")
flags.DEFINE_integer("L", 6, "Layers.")
flags.DEFINE_integer("F", 2048, "MLP width.")
flags.DEFINE_integer("V", 32_000, "Vocabulary.")
flags.DEFINE_string("out", "", "Write the markdown table here too.")


def config(variant: str) -> model_lib.ModelConfig:
  return model_lib.ModelConfig(V=FLAGS.V, D=FLAGS.D, H=FLAGS.H, L=FLAGS.L, F=FLAGS.F,
                               attention=variant.replace("+", ","))


def measure(decoder: decode.Decoder, params, rows: int) -> tuple[float, int]:
  """Seconds per token over the last FLAGS.tokens positions of the context, and the state's bytes."""
  cache = decoder.init_cache(params, rows)
  cache["index"] = jnp.asarray(decoder.length - FLAGS.tokens, jnp.int32)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(cache)) - cache["index"].nbytes
  greedy, key = decode.Sampling(temperature=0), jax.random.key(0)
  token_b = jnp.zeros((rows,), jnp.int32)
  start = time.perf_counter()
  for _ in range(FLAGS.tokens):
    token_b, cache = decoder.step(params, cache, token_b[:, None], greedy, key)
    token_b.block_until_ready()
  return (time.perf_counter() - start) / FLAGS.tokens, state_bytes


def main(argv):
  del argv
  params = {
      v: model_lib.Transformer(config(v)).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
      for v in FLAGS.variants
  }
  header = "| batch | context | " + " | ".join(
      f"{v}: ms/token (min, median), tokens/s, state MiB" for v in FLAGS.variants) + " |"
  lines = [header, "|---|---|" + "---|" * len(FLAGS.variants)]
  print(header, flush=True)
  for rows in map(int, FLAGS.batches):
    for context in map(int, FLAGS.contexts):
      decoders = {v: decode.Decoder(config(v), context) for v in FLAGS.variants}
      for v in FLAGS.variants:  # compiles, and warms up
        measure(decoders[v], params[v], rows)
      times, state = {v: [] for v in FLAGS.variants}, {}
      for _ in range(FLAGS.repeats):
        for v in FLAGS.variants:
          seconds, state[v] = measure(decoders[v], params[v], rows)
          times[v].append(seconds)
      cells = [
          f"{min(times[v]) * 1e3:.1f}, {statistics.median(times[v]) * 1e3:.1f}; "
          f"{rows / min(times[v]):.0f}; {state[v] / 2**20:.3g}" for v in FLAGS.variants
      ]
      lines.append(f"| {rows} | {context} | " + " | ".join(cells) + " |")
      print(lines[-1], flush=True)
  if FLAGS.out:
    device = jax.devices()[0]
    with open(FLAGS.out, "w") as f:
      f.write(f"# Decode benchmark\n\nIncremental decoding (lm-sample's loop: one jitted call per token), "
              f"random-init model of D={FLAGS.D}, H={FLAGS.H}, L={FLAGS.L}, F={FLAGS.F}, V={FLAGS.V}, "
              f"float32, rotary, on {device.platform} ({device.device_kind}, {jax.device_count()} "
              f"device(s)). Each cell: milliseconds per decoded token (min and median of {FLAGS.repeats} "
              f"measurements of {FLAGS.tokens} tokens each; a batch decodes one token per row per call), "
              f"tokens per second over the batch at the min, and the decoding state's size in MiB. The "
              f"context is prompt plus generated tokens; the timed tokens are its last ones. "
              f"`a+b+c`: a hybrid with one preset per layer, repeated over the layers. See "
              f"[generation.md](../guides/generation.md) for what each variant keeps.\n\n"
              f"Command: `python benchmarks/decode.py {' '.join(sys.argv[1:])}`\n\n")
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  app.run(main)
