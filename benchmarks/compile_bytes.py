"""Where a compiled TPU train step's HBM bytes go: the step's bytes by the part of the model and the
optimiser that each top-level operation comes from.

  python benchmarks/compile_bytes.py --config=configs/c4_50m.py --topology=v5e:4x4 [--config.a.b=v ...]

Compiles the step as lm-compile does and reads the optimised HLO: every operation of the entry
computation (a fusion, a copy, a collective, a custom call) reads its operands and writes its result
in HBM, so its bytes are the sizes of both. Operations are grouped by where they came from (their
op_name: the forward or backward pass of which module, the loss, the optimiser update, the non-finite
guard), layers merged. The total is checked against the compiler's own "bytes accessed" (they differ
where the compiler knows that an operation reads only part of an operand). These are the compiler's
static counts, not measurements; lm-compile's time estimate divides the compiler's count by the
chip's HBM bandwidth.

The compiler counts a loop's body once, whatever its trip count, so a step with the blocked attention
kernel (lm/attention/blocked.py: loops over query and key tiles; HYLA's kernel on TPU) holds one tile
per loop in its count. --count_blocked_tiles corrects that: it compiles the kernel alone for one chip,
forward and backward, at the length of one tile (every loop runs once, so the compiler's count is
whole) and at the run's length (the count the step holds), and adds, for every layer that runs the
kernel, the tiles' bytes that the step's count misses. The correction charges every tile as the
one-tile program runs it, operands and intermediates through HBM: an estimate of the real traffic,
not a bound.
"""

import collections
import dataclasses
import functools
import re
import sys

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

from launch.aot import compile as compile_lib, hlo_bytes
from lm import attention, model as model_lib
from lm.attention import blocked as attention_blocked
from lm.experiment import Experiment

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).")
flags.DEFINE_string("topology", "v5e:4x4", "TPU topology, as lm-compile --topology.")
flags.DEFINE_integer("top", 12, "Show this many single operations too.")
flags.DEFINE_string("hlo_out", "", "Also write the optimised HLO text here.")
flags.DEFINE_bool(
    "count_blocked_tiles", False, "Add the blocked attention kernel's tiles that the "
    "compiler's count misses and print the corrected estimate (see above).")


def where_from(op_name: str) -> str:
  """A readable origin of an operation: pass (forward/backward), module path without the layer index."""
  name = op_name.split(";")[0]
  backward = "transpose(jvp(" in name
  name = re.sub(r"^jit\([^)]*\)/", "", name)
  name = re.sub(r"(transpose\()?(jvp\()?(jit\(\w+\)/)?", "", name).replace(")", "")
  name = re.sub(r"block_\d+", "block_*", name)
  parts = [p for p in name.split("/") if p]
  if parts and parts[0] == "Transformer":
    keep = [p for p in parts[1:4] if not re.search(r"[,>]|dot_general|^(mul|add|sub|div)", p)][:2]
    return ("backward " if backward else "forward ") + "/".join(keep or ["Transformer"])
  return ("backward " if backward else "") + "/".join(parts[:2])


def entry_operations(hlo: str) -> list[tuple[str, str, int, str]]:
  """(name, opcode, bytes read and written, origin) of every operation of the entry computation."""
  ops = []
  for name, shape, opcode, operands, rest in hlo_bytes.entry_operations(hlo):
    op_name = re.search(r'op_name="([^"]*)"', rest)
    origin = where_from(op_name.group(1)) if op_name else f"({opcode}, no op_name)"
    ops.append(
        (name, opcode, sum(map(hlo_bytes.shape_bytes, operands)) + hlo_bytes.shape_bytes(shape), origin))
  return ops


@functools.cache  # layers of one preset share it
def blocked_core_bytes(knobs: attention.Knobs, shape: tuple[int, ...], dtype, causal: bool, device) -> float:
  """The compiler's bytes for the blocked kernel's forward and backward pass on q, k, v of `shape`
  [rows, T, heads, head width] with packed-document segment ids, alone on `device`."""
  on = jax.sharding.SingleDeviceSharding(device)
  qkv = jax.ShapeDtypeStruct(shape, dtype, sharding=on)
  segment_ids = jax.ShapeDtypeStruct(shape[:2], jnp.int32, sharding=on)

  def total(q, k, v, segment_ids):
    out = attention.attend(q, k, v, **dataclasses.asdict(knobs), causal=causal, segment_ids=segment_ids,
                           impl="blocked")
    return jnp.sum(out.astype(jnp.float32))

  step = jax.jit(jax.grad(total, argnums=(0, 1, 2)))
  return step.lower(qkv, qkv, qkv, segment_ids).compile().cost_analysis()["bytes accessed"]


def count_blocked_tiles(exp: Experiment, devices) -> None:
  r = compile_lib.report(FLAGS.config, FLAGS.topology)
  cfg, T = exp.model_cfg, r["seq_len"]
  mesh = r["mesh"]
  shape = (r["batch_rows"] // (mesh["data"] * mesh["fsdp"]), T, cfg.H // mesh["tensor"], cfg.K)
  block = min(attention_blocked.BLOCK, T)
  n = T // block
  tiles = n * (n + 1) // 2 if cfg.causal else n * n
  missed, layers = 0.0, 0
  for layer in range(cfg.L):
    knobs = cfg.layer_knobs(layer)
    if cfg.layer_impl(layer, T, "tpu") != "blocked":
      continue
    args = (cfg.causal, devices[0])
    tile = blocked_core_bytes(knobs, (*shape[:1], block, *shape[2:]), model_lib.DTYPES[cfg.dtype], *args)
    counted = blocked_core_bytes(knobs, shape, model_lib.DTYPES[cfg.dtype], *args)
    print(
        f"layer {layer} ({knobs.normalization}, {knobs.value_network}): one tile {tile / 1e6:.1f} MB x "
        f"{tiles} tiles = {tiles * tile / 1e9:.2f} GB; the loops' count at length {T}: {counted / 1e9:.2f} GB"
    )
    missed += tiles * tile - counted
    layers += 1
  step_bytes = r["compiler_bytes"] + missed
  seconds = max(compile_lib.roofline(r, step_bytes))
  print(f"{FLAGS.topology}, attention {r['attention']}: {layers} of {cfg.L} layers run the blocked kernel; "
        f"the step's count {r['compiler_bytes'] / 1e9:.2f} GB, with every tile {step_bytes / 1e9:.2f} GB per "
        f"chip and step; estimate {seconds * 1e3:.1f} ms per step, {seconds * r['steps'] / 3600:.1f} h for "
        f"{r['tokens'] / 1e9:.0f}B tokens (the roofline was {r['roofline_hours']:.1f} h)")


def main(argv):
  del argv
  devices = compile_lib.topology_devices(FLAGS.topology)
  exp = Experiment(FLAGS.config, devices=devices)
  if FLAGS.count_blocked_tiles:
    count_blocked_tiles(exp, devices)
    return
  compiled = exp.lower_train_step().compile()
  hlo = compiled.as_text()
  if FLAGS.hlo_out:
    with open(FLAGS.hlo_out, "w") as f:
      f.write(hlo)
  ops = entry_operations(hlo)
  total = sum(b for _, _, b, _ in ops)
  reported = compiled.cost_analysis()["bytes accessed"]
  print(f"{FLAGS.topology}, attention {exp.model_cfg.attention}: {len(ops)} operations, "
        f"{total / 1e9:.2f} GB read+written by this count, {reported / 1e9:.2f} GB by the compiler's; "
        f"{hlo_bytes.hbm_bytes(hlo) / 1e9:.2f} GB of HBM traffic (what lives in on-chip memory left out)")
  groups = collections.Counter()
  for _, _, b, origin in ops:
    groups[origin] += b
  print("\n| from | GB per chip and step | share |\n|---|---|---|")
  for origin, b in groups.most_common():
    if b / total >= 0.005:
      print(f"| {origin} | {b / 1e9:.2f} | {b / total:.1%} |")
  print("\nlargest single operations:")
  for name, opcode, b, origin in sorted(ops, key=lambda o: -o[2])[:FLAGS.top]:
    print(f"  {b / 1e9:6.3f} GB  {opcode:12s} {name}  ({origin})")


if __name__ == "__main__":
  sys.path.insert(0, __file__.rsplit("/", 2)[0])
  app.run(main)
