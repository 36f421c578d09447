"""SRAVEN training throughput, ours against the paper's own code, on this machine.

  flock /tmp/bench.lock python benchmarks/compositional_throughput.py \
    --paper_python=PAPER_VENV/bin/python --paper_repo=PAPER_CHECKOUT [--presets=softmax,linear,hyla] \
    [--dtypes=float32,bfloat16,float32/bfloat16] [--microbatches=1,8] [--cpu_devices=1,2] [--steps=100] [--repeats=3]

Both train configs/sraven.py's model (4 layers, width 1, batch 128, attention dropout 0.1) with
their own data generators, after compilation. Each measurement is a fresh process; for every preset
the paper's code and ours (each dtype, and each train.microbatches and cpu_devices value if given) alternate,
`repeats` times. Printed: steps/s (best and median
of the repeats), CPU seconds per step (all threads; robust to other load on a shared machine) and
the ratio of ours to the paper's, with the CPU model and `uptime` before and after. The paper's side runs
benchmarks/paper_code_steps.py in its own venv (jax 0.4.38, flax 0.10.2; see that file).

`--worker` measures ours once in this process (what the driver runs); with `--profile=DIR` it also
traces 3 steps with jax.profiler and prints each kind of XLA operation's share of the step (fusions
by kind, numbered instances summed) and the 8 longest operations; `--task=fuzzy_logic` measures
configs/fuzzy_logic.py instead (ours only: the paper's side here runs SRAVEN).
"""

import importlib
import json
import os
import statistics
import sys
import time

import profiles
import workers
from absl import app, flags

_PRESETS = flags.DEFINE_list("presets", ["softmax", "linear", "hyla"], "Our attention presets.")
_DTYPES = flags.DEFINE_list(
    "dtypes", ["float32"], "Our compute dtypes (parameters stay float32); COMPUTE/MATMUL sets "
    "model.matmul_dtype too (float32/bfloat16: bfloat16 operands in the dense products only).")
_STEPS = flags.DEFINE_integer("steps", 100, "Timed steps per measurement.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternating repeats per preset.")
_PAPER_PYTHON = flags.DEFINE_string("paper_python", None, "Python of the paper code's venv.")
_PAPER_REPO = flags.DEFINE_string("paper_repo", None, "Checkout of smonsays/hypernetwork-attention.")
_WORKER = flags.DEFINE_bool("worker", False, "Measure ours once (--presets and --dtypes: one each).")
_PROFILE = flags.DEFINE_string("profile", None, "With --worker: trace 3 steps into this directory.")
_MICROBATCHES = flags.DEFINE_list("microbatches", [], "Our train.microbatches values, each measured "
                                  "(default: the config's).")
_CPU_DEVICES = flags.DEFINE_list("cpu_devices", [], "Our cpu_devices values, each measured (default: "
                                 "the config's).")
_TASK = flags.DEFINE_enum("task", "sraven", ["sraven", "fuzzy_logic"],
                          "With --worker: our config (the paper's side runs SRAVEN only).")
_XLA_DEFAULT = flags.DEFINE_bool(
    "xla_default_fusion", False, "Measure ours with XLA's default CPU fusion (cpu_library_fusion=\"\") too, "
    "each dtype; with --worker: only that way.")

PAPER_MODEL = {"softmax": "transformer", "linear": "linear_transformer", "hyla": "linear_hypatt"}
WARMUP_STEPS = 5


def measure_ours(preset: str, dtype: str, steps: int) -> dict:
  """Our training loop's work per step: the next host batch, its transfer, the train step."""
  import jax  # noqa: PLC0415  (workers only: the driver never initialises jax)

  from lm.experiment import Experiment  # noqa: PLC0415
  from lm.runtime import cli  # noqa: PLC0415
  from lm.train import HostData  # noqa: PLC0415

  c = importlib.import_module(f"configs.{_TASK.value}").get_config()
  compute, _, matmul = dtype.partition("/")
  c.model.update(attention=preset, dtype=compute, matmul_dtype=matmul)
  if _MICROBATCHES.value:
    c.train.microbatches = int(_MICROBATCHES.value[0])
  if _CPU_DEVICES.value:
    c.cpu_devices = int(_CPU_DEVICES.value[0])
  if _XLA_DEFAULT.value:
    c.cpu_library_fusion = ""
  c = c.copy_and_resolve_references()
  cli.use_cpu_devices(c.cpu_devices)
  exp = Experiment(c)
  data = HostData(exp)
  state = exp.init_state()
  for _ in range(WARMUP_STEPS):
    state, stats = exp.train_step(state, exp.global_batch(data.next()))
  jax.block_until_ready(stats)
  start, cpu = time.perf_counter(), time.process_time()
  for _ in range(steps):
    state, stats = exp.train_step(state, exp.global_batch(data.next()))
  jax.block_until_ready(stats)
  seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
  if _PROFILE.value:
    with jax.profiler.trace(_PROFILE.value, create_perfetto_trace=True):
      for _ in range(3):
        state, stats = exp.train_step(state, exp.global_batch(data.next()))
      jax.block_until_ready(stats)
    profiles.print_shares(_PROFILE.value)
  return {
      "code": "ours",
      "preset": preset,
      "dtype": dtype + (", XLA's default CPU fusion" if _XLA_DEFAULT.value else ""),
      "task": _TASK.value,
      "microbatches": c.train.microbatches,
      "devices": jax.device_count(),
      "steps_per_s": steps / seconds,
      "cpu_s_per_step": cpu / steps,
      "loss": float(stats["loss"]),
      "jax": jax.__version__
  }


def drive() -> None:
  if not (_PAPER_PYTHON.value and _PAPER_REPO.value):
    raise SystemExit("give --paper_python and --paper_repo (see benchmarks/paper_code_steps.py)")
  here = os.path.dirname(os.path.abspath(__file__))
  print(f"machine: {workers.machine()}\nbefore: {workers.uptime()}", flush=True)
  rows = []
  for preset in _PRESETS.value:
    micro = [[]] if not _MICROBATCHES.value else [[f"--microbatches={k}"] for k in _MICROBATCHES.value]
    devices = [[]] if not _CPU_DEVICES.value else [[f"--cpu_devices={n}"] for n in _CPU_DEVICES.value]
    fusions = [[], ["--xla_default_fusion"]] if _XLA_DEFAULT.value else [[]]
    ours = [(d, m + n + f) for d in _DTYPES.value for f in fusions for m in micro for n in devices]
    label = lambda d, extra: " ".join(
        [d, *(e.lstrip("-").replace("xla_default_fusion", "XLA default fusion") for e in extra)])
    results = {"paper": []} | {label(d, extra): [] for d, extra in ours}
    for _ in range(_REPEATS.value):
      results["paper"].append(
          workers.run_json([
              _PAPER_PYTHON.value,
              os.path.join(here, "paper_code_steps.py"), f"--repo={_PAPER_REPO.value}",
              f"--model={PAPER_MODEL[preset]}", f"--steps={_STEPS.value}"
          ]))
      for (dtype, extra), runs in zip(ours, list(results.values())[1:]):
        runs.append(
            workers.run_json([
                sys.executable,
                os.path.abspath(__file__), "--worker", f"--presets={preset}", f"--dtypes={dtype}",
                f"--steps={_STEPS.value}", *extra
            ]))
    paper = max(r["steps_per_s"] for r in results["paper"])
    for name, runs in results.items():
      rates = [r["steps_per_s"] for r in runs]
      row = {
          "preset": preset,
          "code": "paper" if name == "paper" else f"ours {name}",
          "best_steps_per_s": max(rates),
          "median_steps_per_s": statistics.median(rates),
          "min_cpu_s_per_step": min(r["cpu_s_per_step"] for r in runs),
          "ratio_best_to_paper_best": max(rates) / paper
      }
      rows.append(row)
      print(json.dumps(row), flush=True)
  print(f"after: {workers.uptime()}", flush=True)
  print("| attention | code | steps/s best | median | CPU s/step (min) | x paper (best) |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['preset']} | {r['code']} | {r['best_steps_per_s']:.2f} | {r['median_steps_per_s']:.2f} | "
          f"{r['min_cpu_s_per_step']:.3f} | {r['ratio_best_to_paper_best']:.2f} |")


def main(argv):
  del argv
  if _TASK.value != "sraven" and not _WORKER.value:
    raise SystemExit("--task=fuzzy_logic measures ours only: give --worker")
  if _WORKER.value:
    print(json.dumps(measure_ours(_PRESETS.value[0], _DTYPES.value[0], _STEPS.value)))
  else:
    drive()


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(main)
