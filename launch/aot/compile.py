"""lm-compile: the real train step compiled for a TPU topology on this host, before paying for one.

  lm-compile --config=configs/c4_50m.py --topology=v5e:4x4 [--config.a.b=v ...] [--json]

Lowers and compiles the step lm-train runs (same mesh rules, sharded state, batch, donation) with
libtpu's compile-only devices for the topology, then prints per-chip memory against the chip's HBM,
FLOPs per step, the compiler's own time estimate, and an estimated step time and run time for the
config's token budget. Exit status 1 when the step does not fit in HBM, 2 for a usage error.
"""

import collections
import dataclasses
import json
import math
import re
import sys
import time

import jax
import ml_collections
from absl import app, flags
from ml_collections import config_flags

from launch.aot import hlo_bytes, kernel_schedule
from launch.aot.topology import CHIPS, GiB, UsageError, topology_devices
from lm import attention, cross_entropy, flops, sharding
from lm.attention import core as attention_core
from lm.experiment import Experiment
from lm.runtime import cli


def argument_bytes(exp: Experiment) -> int:
  """Bytes of the state and batch on one chip, from their shardings: what a step that failed to
  compile still reports (the compiler's own figure replaces it when compiling succeeds)."""
  leaves = jax.tree.leaves([exp.abstract_sharded_state(), exp.batch_spec()])
  return sum(x.dtype.itemsize * math.prod(x.sharding.shard_shape(x.shape)) for x in leaves)


def chip_rows(exp: Experiment) -> int:
  """Rows of a step on one chip: the batch split over the mesh's batch axes."""
  return exp.config.train.batch_size // math.prod(exp.mesh.shape[a] for a in sharding.BATCH)


def kernel_schedules(exp: Experiment, impls: list[str], topology: str) -> list[dict]:
  """The attention's Pallas kernels (kernel_schedule.TIMED) as the compiler scheduled them for one chip,
  once per kind of layer that runs them (`impls`: each layer's implementation on TPU): the compiler's
  cost analysis gives them no time."""
  cfg, T, rows = exp.model_cfg, exp.task.seq_len, chip_rows(exp)
  # Heads split over the tensor axis for the kernels that split them.
  tensor = exp.mesh.shape["tensor"] if attention_core.tensor_splits(cfg.H, exp.mesh) else 1
  heads = lambda impl: cfg.H // tensor if impl in kernel_schedule.HEADS_SPLIT else cfg.H
  untimed = sorted(
      {impl for impl in impls if impl in kernel_schedule.PALLAS and impl not in kernel_schedule.TIMED})
  if untimed:
    raise RuntimeError(f"no schedule for the {', '.join(untimed)} kernels")
  layers = collections.Counter(
      (impl, cfg.layer_knobs(layer)) for layer, impl in enumerate(impls) if impl in kernel_schedule.TIMED)
  schedules = []
  segments = "segment_ids" in exp.task.example()
  for (impl, knobs), n in layers.items():
    spec = dataclasses.asdict(knobs)
    schedules.append(
        dict(
            impl=impl, layers=n, knobs=spec, segments=segments,
            **kernel_schedule.schedule(impl=impl, knobs=spec, rows=rows, seq_len=T, heads=heads(impl),
                                       head_dim=cfg.K, dtype=cfg.dtype, causal=cfg.causal, segments=segments,
                                       topology=topology)))
  return schedules


def cross_entropy_schedule(exp: Experiment, topology: str) -> dict:
  """The readout cross-entropy's kernels as the compiler scheduled them for one chip's tokens of one
  microbatch, counted for every microbatch (as `layers`, which kernel_seconds reads)."""
  cfg, T, microbatches = exp.model_cfg, exp.task.seq_len, exp.config.train.microbatches
  tokens = chip_rows(exp) // microbatches * T
  kernels = cross_entropy.tpu_kernels(exp.config.train.cross_entropy_impl, tokens, cfg.V)
  return dict(
      layers=microbatches, kernels=kernels,
      **kernel_schedule.cross_entropy_schedule(tokens=tokens, width=cfg.D, vocab=cfg.V, dtype=cfg.dtype,
                                               topology=topology, kernels=kernels))


def kernel_total(schedules: list[dict], field: str) -> float:
  """A field ("cycles", "flops", "hbm_bytes") summed over the kernels of every layer that runs them."""
  return sum(s["layers"] * (s["forward"][field] + s["backward"][field]) for s in schedules)


def kernel_seconds(schedules: list[dict], chip) -> float:
  """The kernels' time: each the longer of its schedule and the HBM traffic it declares (Pallas fetches
  the next grid step's blocks while a step computes)."""
  return sum(s["layers"] * max(s[k]["cycles"] / chip.clock_hz, s[k]["hbm_bytes"] / chip.hbm_bytes_per_second)
             for s in schedules
             for k in ("forward", "backward"))


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_DECLARED = {
    field: re.compile(rf'"cost_estimate":{{[^}}]*"{field}":"(\d+)"') for field in ("flops", "bytes_accessed")
}


def per_operation(hlo: str, scheduled: set[str], peak: float, chip) -> dict:
  """The step's time as its operations run on the chip's one core, one after another, read from the
  compiled HLO: XLA's own operations at the cycles the TPU compiler's cost model gives each (their
  backend config's estimated_cycles), and the Pallas kernels that no schedule times (those named
  in none of `scheduled`; e.g. the cross-entropy's) at the longer of their declared FLOPs at the chip's
  peak and declared bytes at its bandwidth, a floor. Kernels that declare nothing are listed."""
  xla_cycles, declared, unpriced = 0, 0.0, []
  for line in hlo.splitlines():
    if (cycles := _CYCLES.search(line)):
      xla_cycles += int(cycles.group(1))
    elif 'custom_call_target="tpu_custom_call"' in line:
      name = line.split("=", 1)[0].strip().lstrip("%")
      if any(name.startswith(kernel) for kernel in scheduled):
        continue
      cost = {field: pattern.search(line) for field, pattern in _DECLARED.items()}
      if not all(cost.values()):
        unpriced.append(name)
        continue
      declared += max(
          int(cost["flops"].group(1)) / peak,
          int(cost["bytes_accessed"].group(1)) / chip.hbm_bytes_per_second)
  return dict(xla_op_seconds=xla_cycles / chip.clock_hz, declared_kernel_seconds=declared,
              unpriced_kernels=sorted(unpriced))


def report(config: ml_collections.ConfigDict, topology: str) -> dict:
  """Compiles the train step of `config` for `topology`; every number is per chip and per step."""
  devices = topology_devices(topology)
  chip = CHIPS[devices[0].device_kind]
  peak = flops.peak_flops(devices[:1])
  try:
    exp = Experiment(config, devices=devices)
  except ValueError as e:
    raise UsageError(str(e)) from e
  seq_len, rows = exp.task.seq_len, config.train.batch_size
  tokens_per_step = rows * seq_len
  out = {
      "topology":
          topology,
      "chips":
          len(devices),
      "hosts":
          len({d.process_index for d in devices}),
      "device_kind":
          devices[0].device_kind,
      "mesh":
          dict(exp.mesh.shape),
      "attention":
          exp.model_cfg.attention,
      "attention_impls":  # each layer's, on TPU
          [exp.model_cfg.layer_impl(layer, seq_len, "tpu") for layer in range(exp.model_cfg.L)],
      "num_params":
          exp.num_params,
      "batch_rows":
          rows,
      "seq_len":
          seq_len,
      "microbatches":
          config.train.microbatches,
      "compiler_options":
          exp.train_compiler_options or {},
      "steps":
          config.train.steps,
      "tokens":
          config.train.steps * tokens_per_step,
      "hbm_bytes":
          chip.hbm_bytes,
      "model_flops":
          flops.flops_per_token(exp.model_cfg, exp.num_params, seq_len, exp.task.readout_last) *
          tokens_per_step / len(devices),
  }
  start = time.perf_counter()
  try:
    compiled = exp.lower_train_step().compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    # The compiler stops at the first buffer assignment that overflows: only its message remains.
    return {
        **out, "fits": False,
        "compiler_message": str(e).strip(),
        "argument_bytes": argument_bytes(exp),
        "compile_seconds": time.perf_counter() - start
    }
  out["compile_seconds"] = time.perf_counter() - start
  memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
  out.update(argument_bytes=memory.argument_size_in_bytes,
             output_bytes=memory.output_size_in_bytes - memory.alias_size_in_bytes,
             temp_bytes=memory.temp_size_in_bytes, code_bytes=memory.generated_code_size_in_bytes,
             total_bytes=memory.peak_memory_in_bytes, fits=memory.peak_memory_in_bytes <= chip.hbm_bytes,
             compiler_flops=cost["flops"], compiler_bytes=cost["bytes accessed"],
             optimal_seconds=cost["optimal_seconds"])
  out.update(peak_flops=peak, hbm_bytes_per_second=chip.hbm_bytes_per_second)
  try:
    schedules, untimed = kernel_schedules(exp, out["attention_impls"], topology), ""
  except RuntimeError as e:  # e.g. a libtpu whose dumps this reader does not know: the rest still holds
    schedules, untimed = [], str(e).strip().splitlines()[-1]
  totals = {f"kernel_{field}": kernel_total(schedules, field) for field in ("cycles", "flops", "hbm_bytes")}
  out.update(kernel_schedules=schedules, **totals, kernels_untimed=untimed, clock_hz=chip.clock_hz)
  # The compiler's FLOPs and bytes include what the kernels declare (their cost estimates); those are
  # timed with the kernels instead, which run beside the rest of the step, not overlapped with it.
  compute, memory_time = roofline(out, out["compiler_bytes"] - out["kernel_hbm_bytes"])
  compute -= out["kernel_flops"] / peak
  bound = "compute" if compute >= memory_time else "HBM bandwidth"
  out["kernel_seconds"] = kernel_seconds(schedules, chip)
  out.update(
      roofline_step_seconds=max(compute, memory_time) + out["kernel_seconds"],
      bound=bound + " + attention kernels" * bool(schedules) + " (attention kernels untimed)" * bool(untimed))
  out["roofline_hours"] = out["roofline_step_seconds"] * config.train.steps / 3600
  # The estimate: a chip's one core runs the step's operations one after another, each at its own time.
  hlo = compiled.as_text()
  ce, out["cross_entropy_untimed"] = [], ""
  if cross_entropy.FORWARD in hlo:
    try:
      ce = [cross_entropy_schedule(exp, topology)]
    except RuntimeError as e:  # then priced by what they declare, below
      out["cross_entropy_untimed"] = str(e).strip().splitlines()[-1]
  out["cross_entropy_schedule"] = ce[0] if ce else None
  out["cross_entropy_seconds"] = kernel_seconds(ce, chip)
  scheduled = {s[k]["kernel"] for s in schedules + ce for k in ("forward", "backward")}
  out.update(per_operation(hlo, scheduled, peak, chip), hbm_traffic_bytes=hlo_bytes.hbm_bytes(hlo))
  out["estimated_step_seconds"] = (out["xla_op_seconds"] + out["kernel_seconds"] +
                                   out["cross_entropy_seconds"] + out["declared_kernel_seconds"])
  out["estimated_hours"] = out["estimated_step_seconds"] * config.train.steps / 3600
  return out


def roofline(r: dict, step_bytes: float) -> tuple[float, float]:
  """A report's step time bounds in seconds, (compute, HBM traffic), for `step_bytes` per chip."""
  # The compiler counts a Pallas kernel's FLOPs only as its cost estimate declares them (splash declares
  # none); the model count never misses the attention.
  return max(r["compiler_flops"], r["model_flops"]) / r["peak_flops"], step_bytes / r["hbm_bytes_per_second"]


def _gib(x: float) -> str:
  return f"{x / GiB:.2f} GiB"


def format_report(r: dict) -> str:
  lines = [
      f"{r['attention']} attention, {r['num_params']:,} parameters, {r['batch_rows']} rows x "
      f"{r['seq_len']} tokens per step; {r['topology']}: {r['chips']} chips ({r['device_kind']}) on "
      f"{r['hosts']} host{'s' * (r['hosts'] > 1)}, mesh {r['mesh']}; compiler ran "
      f"{r['compile_seconds']:.0f} s", "memory per chip:"
  ]
  if "compiler_message" in r:
    fix = ("shard the state: mesh.shard_state_over_data (on a mesh of data alone), mesh.fsdp (width) or "
           "mesh.tensor (heads, MLP, vocabulary)" if r["argument_bytes"] > r["hbm_bytes"] /
           2 else "lower train.batch_size, raise train.microbatches, or set model.remat=block")
    if all(map(attention.keeps_z, r["attention_impls"])):  # one impl serves every layer
      fix += ("; or have HYLA's kernels recompute z instead of keeping it (memory that grows with the "
              "square of the length): model.attention_impl=pallas_hypernetwork")
    return "\n".join(lines + [
        f"  arguments (state and batch)  {_gib(r['argument_bytes'])}",
        f"  DOES NOT FIT in {_gib(r['hbm_bytes'])} of HBM; the compiler says: {r['compiler_message']}",
        f"  To fit: {fix}."
    ])
  kernel_ms = 1e3 * r["kernel_seconds"]
  optimal = (f"{r['optimal_seconds'] * 1e3:.1f} ms" if r["optimal_seconds"] > 0 else
             f"unusable ({r['optimal_seconds']:.3f} s: negative when the cost model cannot time "
             "some operation of the step)")
  lines += [
      f"  arguments (state and batch)  {_gib(r['argument_bytes'])}",
      f"  outputs not aliased to them  {_gib(r['output_bytes'])}",
      f"  temporaries                  {_gib(r['temp_bytes'])}",
      f"  generated code               {_gib(r['code_bytes'])}",
      f"  total (compiler's peak)      {_gib(r['total_bytes'])} of {_gib(r['hbm_bytes'])} HBM: " +
      ("fits" if r["fits"] else "DOES NOT FIT"), "per chip and step:",
      f"  FLOPs, compiler              {r['compiler_flops']:.3e}",
      f"  FLOPs, model (6N+attention)  {r['model_flops']:.3e}",
      f"  bytes accessed, compiler     {r['compiler_bytes']:.3e} (operands and results, wherever they live)",
      f"  bytes through HBM            {r['hbm_traffic_bytes']:.3e} (on-chip memory left out)",
      f"  compiler's optimal time      {optimal}",
      "estimates, not measurements (docs/reference/compile.md says how far to trust them):",
      f"  step time   {r['estimated_step_seconds'] * 1e3:.1f} ms: the operations one after another, XLA's "
      f"{r['xla_op_seconds'] * 1e3:.1f} ms by the compiler's estimate of each" +
      (f", the attention's Pallas kernels {kernel_ms:.1f} ms (each the longer of the compiler's schedule, "
       f"{r['kernel_cycles']:.3e} bundles in all at {r['clock_hz'] / 1e9:.2f} GHz with no stalls, and the HBM "
       f"traffic it declares, {r['kernel_hbm_bytes'] / 1e9:.2f} GB in all)" if kernel_ms else "") +
      f", the cross-entropy's {r['cross_entropy_seconds'] * 1e3:.1f} ms the same way, other Pallas kernels "
      f"{r['declared_kernel_seconds'] * 1e3:.1f} ms by their declared FLOPs and bytes (a floor); collectives "
      "left out" + (f"; no time for {', '.join(r['unpriced_kernels'])}" if r["unpriced_kernels"] else "") +
      (f"; the cross-entropy's kernels by what they declare: {r['cross_entropy_untimed']}"
       if r["cross_entropy_untimed"] else ""),
      f"  run time    {r['estimated_hours']:.1f} h for {r['steps']:,} steps ({r['tokens'] / 1e9:.1f}B tokens)",
      f"  roofline    {r['roofline_step_seconds'] * 1e3:.1f} ms, {r['roofline_hours']:.1f} h: max(FLOPs / "
      f"{r['peak_flops'] / 1e12:.0f} TFLOP/s, bytes / {r['hbm_bytes_per_second'] / 1e9:.0f} GB/s) of the rest"
      + (" + the attention's kernels" if kernel_ms else "") + f"; bound: {r['bound']} (the compiler's bytes "
      "include operands in on-chip memory, and the step's operations do not overlap: not a bound)"
  ]
  if r["kernels_untimed"]:
    lines.append(f"  the attention's Pallas kernels are not in the step time: {r['kernels_untimed']}")
  if r["microbatches"] > 1:  # XLA's cost analysis counts a loop's body once, whatever its trip count.
    lines.append(f"  the compiler's FLOPs, bytes and per-operation times cover 1 of the {r['microbatches']} "
                 "microbatches")
  if "xla_disable_hlo_passes" in r["compiler_options"]:
    lines.append(f"  compiled without {r['compiler_options']['xla_disable_hlo_passes']}: this libtpu "
                 "miscompiles the microbatch loop's gradient sum with it (docs/reference/faults.md); "
                 "gradients are summed across chips once per microbatch")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected argument {argv[1]!r}; flags are --config, --topology, --json")
  try:
    r = report(flags.FLAGS.config, flags.FLAGS.topology)
  except UsageError as e:
    print(f"lm-compile: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(r, indent=1) if flags.FLAGS.json else format_report(r), flush=True)
  sys.exit(0 if r["fits"] else 1)


def run():
  config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).")
  flags.DEFINE_string(
      "topology", "v5e:4x4", "TPU topology CHIP:AxB[xC], e.g. v5e:4x4 (the 16 "
      "chips of v5litepod-16), v5p:2x2x2, v6e:2x2.")
  flags.DEFINE_bool("json", False, "Print the report as one JSON object.")
  flags.mark_flags_as_required(["config"])
  cli.run(main, __name__, config_storage=False)  # compiles only: reads no data, writes nowhere


if __name__ == "__main__":
  run()
