"""The attention's Pallas kernels (HYLA's, linear attention's, and softmax's splash kernels) as the TPU
compiler scheduled them, read from libtpu's LLO dumps.

The compiler's cost analysis reports no time for a Pallas kernel (a custom call). But libtpu can write
what it compiled each kernel to: a TPU core issues one VLIW bundle per cycle, and the listing says how
many bundles a grid step's program holds and which units (MXU, cross-lane XLU, vector ALUs, loads,
stores) each bundle fills. Bundles x visible grid steps (those that compute a block with a visible
key; the others run only their control code) is then the kernel's cycles as scheduled, with no stall:
DMA waits and latencies the schedule does not hide come on top.

libtpu reads its dump flags once, when it loads, so `schedule` compiles in a child process
(`python -m launch.aot.kernel_schedule SPEC`), which prints the result as JSON.
"""

import collections
import functools
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

_NUMBERS = re.compile(r"^\s*\d+(\s+\d+)+\s*$")
_INNER_LOOP = re.compile(r"^\s*0x[0-9a-f]+\s+[A-Z]*:\s*>>\s", re.M)
# The LLO passes whose listings the child dumps (libtpu's --xla_jf_dump_llo_pass_label_regex).
_FINAL_LISTINGS = "final_(bundles|hlo-static-per-bundle-utilization)"
# lm/attention/__init__.py's implementations that run Pallas kernels on TPU, and those whose kernels this times
# (not flash attention's, which softmax runs only with a position bias).
PALLAS = ("pallas_hypernetwork_keep_z", "pallas_hypernetwork", "splash", "pallas_linear", "pallas")
TIMED = PALLAS[:4]
# Those whose kernels take a device's share of the heads under a tensor axis (lm.attention.core.per_device);
# HYLA's take every head on every chip, as RMSHead and z couple them.
HEADS_SPLIT = ("splash", "pallas_linear")


def schedule(*, impl: str, knobs: dict, rows: int, seq_len: int, heads: int, head_dim: int, dtype: str,
             causal: bool, segments: bool, topology: str) -> dict:
  """The chip's device_kind, and per kernel ("forward", "backward"): bundles per grid step, visible grid
  steps, their product (cycles), the FLOPs and HBM bytes the kernel declares to XLA's cost analysis,
  each unit's slots per bundle and average use, and the most frequent operations; for the forward and
  backward pass of the kernels over [rows, seq_len, heads, head_dim] on one chip of `topology`, with
  packed documents' segment ids if `segments` (the kernels then mask by them too)."""
  if impl not in TIMED:
    raise ValueError(f"no schedule for attention implementation {impl!r}; timed: {', '.join(TIMED)}")
  return _in_child(
      dict(impl=impl, knobs=knobs, rows=rows, seq_len=seq_len, heads=heads, head_dim=head_dim, dtype=dtype,
           causal=causal, segments=segments, topology=topology))


def cross_entropy_schedule(*, tokens: int, width: int, vocab: int, dtype: str, topology: str,
                           kernels: str = "pallas") -> dict:
  """The readout cross-entropy's kernels (lm/cross_entropy.py; `kernels` "pallas" or
  "pallas_keep_logits") for one chip's `tokens` of a [width, vocab] readout, as `schedule` gives the
  attention's: per kernel ("forward", "backward"), its name, bundles per grid step, grid steps, cycles
  and the HBM bytes it declares."""
  return _in_child(
      dict(impl="cross_entropy", tokens=tokens, width=width, vocab=vocab, dtype=dtype, topology=topology,
           kernels=kernels))


def _in_child(spec: dict) -> dict:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, "-m", "launch.aot.kernel_schedule",
                           json.dumps(spec)], cwd=root, capture_output=True, text=True, env={
                               **os.environ, "JAX_PLATFORMS": "cpu"
                           })
  if result.returncode:
    raise RuntimeError(f"compiling the {spec['impl']} kernels for {spec['topology']} failed:\n"
                       f"{result.stderr[-3000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def _last(pattern: str) -> str:
  files = sorted(glob.glob(pattern))
  if not files:
    raise FileNotFoundError(f"libtpu wrote no {pattern!r}; this libtpu may name its dumps differently")
  return files[-1]


def bundles(dump: str, kernel: str, loop_trips: int | None = None) -> int:
  """The bundles a grid step of the kernel runs. The listing holds the body of a loop inside the
  step (at loop depth 2, marked `>>`) once; it counts loop_trips times. A kernel that is not said to
  loop (None) and does raises, rather than be counted short."""
  text = open(_last(f"{dump}/*{kernel}*schedule-analysis_final_bundles.txt")).read()
  total = int(re.search(r"total scheduled bundles:\s+(\d+)", text).group(1))
  body = len(_INNER_LOOP.findall(open(_last(f"{dump}/*{kernel}*-final_bundles.txt")).read()))
  if body and loop_trips is None:
    raise ValueError(f"{kernel}'s grid step holds a loop ({body} bundles at loop depth 2) whose trips "
                     "the schedule is not told; name them in launch/aot/kernel_schedule.py")
  return total + ((loop_trips or 1) - 1) * body


def units(dump: str, kernel: str) -> dict[str, dict[str, float]]:
  """Per unit: slots per bundle and slots used per bundle, averaged over the kernel's program."""
  lines = open(_last(f"{dump}/*{kernel}*final_hlo-static-per-bundle-utilization.txt")).read().splitlines()
  header = lines.index("== CAPACTIY:")  # sic
  names = lines[header + 1].replace(",", " ").split()
  capacity = [int(x) for x in lines[header + 2].split()]
  used = [[int(x) for x in line.split()] for line in lines[header + 3:] if _NUMBERS.match(line)]
  return {
      name: dict(slots=capacity[i], used=sum(r[i] for r in used) / len(used)) for i, name in enumerate(names)
  }


def operations(dump: str, kernel: str) -> dict[str, int]:
  """How often each operation occurs in the kernel's program, the most frequent first."""
  text = open(_last(f"{dump}/*{kernel}*final_bundles.txt")).read()
  return dict(collections.Counter(re.findall(r"= ([a-z][a-z0-9_.]+)", text)).most_common())


def _kernels(spec: dict, itemsize: int):
  """For the attention implementation spec["impl"]: its kernels' names (forward, backward), the FLOPs
  and HBM bytes each declares to XLA's cost analysis (none for the library's splash kernels), and its
  programs: (label, attend function, the grid steps that run it, its kernels' names, the trips of a
  loop inside each kernel's grid step). HYLA's causal kernels run one program on tiles below the
  diagonal and another on the diagonal: each is built and counted alone, for the steps that run it, as
  a kernel holding both would count both for every step. HYLA's backward kernel loops over heads
  (lm.attention.hypernetwork.head_loop_trips)."""
  from lm import attention
  from lm.attention import core as attention_core, hypernetwork as hyper, linear, softmax

  rows, T, H, causal = spec["rows"], spec["seq_len"], spec["heads"], spec["causal"]
  no_loop = (None, None)
  if spec["impl"] == "splash":
    names = (softmax.SPLASH_FORWARD, softmax.SPLASH_BACKWARD)
    attend = functools.partial(softmax.attend_splash, causal=causal)
    return names, {}, [("all", attend, rows * H * softmax.splash_visible_blocks(T, causal), names, no_loop)]
  if spec["impl"] == "pallas_linear":
    names = (linear.FORWARD, linear.BACKWARD)
    attend = functools.partial(linear.attend_pallas_linear, causal=causal)
    declared = linear.kernel_costs(causal, (rows, H, T, spec["head_dim"]), itemsize)
    return names, declared, [("all", attend, rows * H * linear.visible_tiles(T, causal), names, no_loop)]
  knobs = attention_core.Knobs(**spec["knobs"])
  keep_z = attention.keeps_z(spec["impl"])
  attend = functools.partial(hyper.attend_pallas_hypernetwork, knobs=knobs, causal=causal, keep_z=keep_z)
  declared = hyper.kernel_costs(knobs, causal, (rows, H, T, spec["head_dim"]), itemsize, keep_z)
  names = (hyper.FORWARD, hyper.BACKWARD)
  trips = (None, hyper.head_loop_trips(H))
  return names, declared, [(only or "all", functools.partial(attend, only=only), rows * steps,
                            tuple(hyper.program_name(n, only)
                                  for n in names), trips)
                           for only, steps in hyper.tile_programs(T, causal)]


def _compile_and_read(spec: dict) -> dict:
  with tempfile.TemporaryDirectory() as dump:
    # Only the final listings, which `bundles`, `units` and `operations` read: by default libtpu writes
    # the LLO after every pass, hundreds of MB for HYLA's kernels, and writing them is slow.
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") +
                                      f" --xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true"
                                      f" --xla_jf_dump_llo_pass_label_regex={_FINAL_LISTINGS}")
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from launch.aot import topology

    chip = topology.topology_devices(spec["topology"])[0]
    on_chip = SingleDeviceSharding(chip)
    if spec["impl"] == "cross_entropy":
      return {"device_kind": chip.device_kind, **_cross_entropy(spec, on_chip, dump)}
    x = jax.ShapeDtypeStruct((spec["rows"], spec["seq_len"], spec["heads"], spec["head_dim"]),
                             jnp.dtype(spec["dtype"]), sharding=on_chip)
    seg = jax.ShapeDtypeStruct((spec["rows"], spec["seq_len"]), jnp.int32, sharding=on_chip)
    names, declared, programs = _kernels(spec, x.dtype.itemsize)

    def loss(q, k, v, segment_ids):  # uses the outputs, so the forward kernels stay
      outs = [
          attend(q, k, v, segment_ids=segment_ids if spec["segments"] else None)
          for _, attend, _, _, _ in programs
      ]
      return sum(jnp.square(out.astype(jnp.float32)).sum() for out in outs)

    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, x, x, seg).compile()
    out = {"device_kind": chip.device_kind}
    for i, (name, kernel) in enumerate(zip(("forward", "backward"), names)):
      parts = [
          dict(tiles=label, kernel=kernels[i], bundles_per_step=bundles(dump, kernels[i], trips[i]),
               steps=steps, units=units(dump, kernels[i])) for label, _, steps, kernels, trips in programs
      ]
      cycles, steps = sum(p["bundles_per_step"] * p["steps"] for p in parts), sum(p["steps"] for p in parts)
      cost = declared.get(kernel)
      # A grid step's bundles: the one program's, or the programs' average over the steps; units and
      # operations: the first program's (HYLA's whole tiles').
      out[name] = dict(kernel=kernel, bundles_per_step=round(cycles / steps), visible_steps=steps,
                       cycles=cycles, programs=parts, flops=cost.flops if cost else 0,
                       hbm_bytes=cost.bytes_accessed if cost else 0, units=parts[0]["units"],
                       operations=operations(dump, parts[0]["kernel"]))
    return out


def _cross_entropy(spec: dict, on_chip, dump: str) -> dict:
  import jax
  import jax.numpy as jnp

  from lm import cross_entropy

  N, D, V = spec["tokens"], spec["width"], spec["vocab"]
  x = jax.ShapeDtypeStruct((1, N, D), jnp.dtype(spec["dtype"]), sharding=on_chip)
  w = jax.ShapeDtypeStruct((D, V), x.dtype, sharding=on_chip)
  targets = jax.ShapeDtypeStruct((1, N), jnp.int32, sharding=on_chip)
  keep = spec["kernels"] == "pallas_keep_logits"
  loss = lambda x, w, targets: cross_entropy.readout_nll(x, w, 1.0, targets, impl=spec["kernels"]).sum()
  jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w, targets).compile()
  declared = cross_entropy.kernel_costs(N, D, V, x.dtype.itemsize, keep)
  out = {}
  for kind, (name, steps) in zip(("forward", "backward"),
                                 cross_entropy.grid_steps(N, D, V, x.dtype.itemsize, keep).items()):
    per_step = bundles(dump, name)
    out[kind] = dict(kernel=name, bundles_per_step=per_step, visible_steps=steps, cycles=per_step * steps,
                     hbm_bytes=declared[name].bytes_accessed, units=units(dump, name))
  return out


if __name__ == "__main__":
  print(json.dumps(_compile_and_read(json.loads(sys.argv[1]))))
