"""Training throughput of our trainer against NanoDO's, same model, same batches, on this machine.

  flock /tmp/bench.lock python benchmarks/nanodo_side_by_side.py --nanodo_repo=NANODO_CHECKOUT \
    [--steps=100] [--repeats=3] [--out=docs/nanodo_side_by_side.md]

The model of both: vocabulary 8,192, width 256, 4 heads, 4 layers, MLP 1,024, learned positions,
tied embeddings, float32, context 256, batch 16 (NanoDO's architecture: pre-LayerNorm without biases,
GELU MLP). The batches are ours: the embedded corpus through our pipeline (its tokenizer for
V=8,192); NanoDO gets the same token rows from memory (benchmarks/nanodo_steps.py, which needs
NanoDO's dependencies: clu, grain, tensorflow-datasets; TensorFlow is not needed).

Each measurement is a fresh process; the two alternate, `repeats` times. Ours is measured twice:
`lm-train`'s own loop (lm.train.train_and_evaluate: our data pipeline, host-to-device assembly,
the step, the metrics read one step late, the non-finite check, the log; the time between its first
and last progress report, from its metrics log) and the step loop alone on batches from memory,
like NanoDO's side. Printed: steps/s (best, median), CPU seconds per step (all threads), each ratio
to NanoDO's best, and `uptime` before and after (other load on the machine).

`--worker=loop|steps` measures ours once; `--profile=DIR` traces 3 steps of the step loop and
prints where their time goes (benchmarks/profiles.py).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import profiles
from absl import app, flags

_NANODO_REPO = flags.DEFINE_string("nanodo_repo", None, "A checkout of google-deepmind/nanodo.")
_NANODO_PYTHON = flags.DEFINE_string("nanodo_python", sys.executable,
                                     "Python with NanoDO's dependencies (default: this one).")
_STEPS = flags.DEFINE_integer("steps", 100, "Timed steps per measurement.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternating repeats.")
_OUT = flags.DEFINE_string("out", "", "Write the markdown table here too.")
_WORKER = flags.DEFINE_enum("worker", None, ["loop", "steps"], "Measure ours once, this way.")
_TOKENS = flags.DEFINE_string("tokens", "", "With --worker: also save the token rows here (.npy).")
_PROFILE = flags.DEFINE_string("profile", None, "With --worker=steps: trace 3 steps into this directory.")

WARMUP_STEPS = 3
SIZES = dict(V=8192, D=256, H=4, L=4, F=1024)


def config(steps: int):
  from configs import base  # noqa: PLC0415  (workers only)

  c = base.get_config()
  c.model.update(**SIZES, positions="learned", max_len=256, tied_embeddings=True, dtype="float32")
  c.data.seq_len = 256
  c.train.update(steps=steps, batch_size=16, warmup_steps=10, log_every_steps=steps)
  # Nothing in between: one save and one evaluation after the last step, outside the timed span.
  c.eval.update(every_steps=steps, batch_size=16)
  c.checkpoint.update(every_steps=steps, use_async=False)
  c.compilation_cache = "none"
  return c


def measure_loop(steps: int) -> dict:
  """lm-train's loop: steps/s between its first report (after step 1, which compiles) and the last."""
  from lm import run_log, train  # noqa: PLC0415

  with tempfile.TemporaryDirectory() as workdir:
    cpu = time.process_time()
    train.train_and_evaluate(config(steps + 1), workdir)
    cpu = time.process_time() - cpu
    record = [r for r in run_log.read(workdir) if r["kind"] == "train"][-1]
  return {
      "code": "ours (lm-train loop)",
      "steps_per_s": 1 / record["step_time"],
      "cpu_s_per_step": None,
      "loss": record["loss"]
  }


def measure_steps(steps: int) -> dict:
  """The step loop alone: batches from memory, each step dispatched before the previous step's
  metrics are read and checked, as lm-train does."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from lm.experiment import Experiment  # noqa: PLC0415
  from lm.train import HostData  # noqa: PLC0415

  exp = Experiment(config(steps))
  data = HostData(exp)
  batches = [data.next() for _ in range(8)]
  if _TOKENS.value:
    np.save(_TOKENS.value, np.stack([b["inputs"] for b in batches]).astype(np.int32))
  state = exp.init_state()

  def run(count, unread):
    nonlocal state
    for i in range(count):
      state, stats = exp.train_step(state, exp.global_batch(batches[i % len(batches)]))
      if unread is not None and not jax.device_get(unread)["finite"]:
        raise FloatingPointError("non-finite step")
      unread = stats
    return unread

  unread = run(WARMUP_STEPS, None)
  jax.block_until_ready(unread)
  start, cpu = time.perf_counter(), time.process_time()
  unread = run(steps, unread)
  loss = float(unread["loss"])
  seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
  if _PROFILE.value:
    with jax.profiler.trace(_PROFILE.value, create_perfetto_trace=True):
      jax.block_until_ready(run(3, unread))
    profiles.print_shares(_PROFILE.value)
  return {
      "code": "ours (step loop)",
      "steps_per_s": steps / seconds,
      "cpu_s_per_step": cpu / steps,
      "loss": loss,
      "jax": jax.__version__
  }


def _run(cmd: list[str]) -> dict:
  # CPU only: libtpu (installed with the tpu extra) would otherwise be probed.
  out = subprocess.run(cmd, capture_output=True, text=True, check=False, env={
      **os.environ, "JAX_PLATFORMS": "cpu"
  })
  if out.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def drive() -> None:
  if not _NANODO_REPO.value:
    raise SystemExit("give --nanodo_repo=DIR, a checkout of google-deepmind/nanodo")
  here = os.path.abspath(__file__)
  ours = [sys.executable, here, f"--steps={_STEPS.value}"]
  tokens = os.path.join(tempfile.mkdtemp(), "tokens.npy")
  nanodo = [
      _NANODO_PYTHON.value,
      os.path.join(os.path.dirname(here), "nanodo_steps.py"), f"--repo={_NANODO_REPO.value}",
      f"--tokens={tokens}", f"--steps={_STEPS.value}"
  ]
  print(f"before: {_uptime()}", flush=True)
  results = {"nanodo": [], "steps": [], "loop": []}
  results["steps"].append(_run(ours + ["--worker=steps", f"--tokens={tokens}"]))
  for i in range(_REPEATS.value):
    results["nanodo"].append(_run(nanodo))
    results["loop"].append(_run(ours + ["--worker=loop"]))
    if i:  # the first step-loop measurement wrote the tokens
      results["steps"].append(_run(ours + ["--worker=steps"]))
    for runs in results.values():
      if runs:
        print(json.dumps(runs[-1]), flush=True)
  print(f"after: {_uptime()}", flush=True)
  best_nanodo = max(r["steps_per_s"] for r in results["nanodo"])
  lines = [
      "| trainer | steps/s best | median | tokens/s best | CPU s/step (min) | x NanoDO (best) |",
      "|---|---|---|---|---|---|"
  ]
  for runs in results.values():
    rates = [r["steps_per_s"] for r in runs]
    cpus = [r["cpu_s_per_step"] for r in runs if r["cpu_s_per_step"] is not None]
    lines.append(f"| {runs[0]['code']} | {max(rates):.3f} | {statistics.median(rates):.3f} | "
                 f"{max(rates) * 16 * 256:,.0f} | {f'{min(cpus):.2f}' if cpus else 'n/a'} | "
                 f"{max(rates) / best_nanodo:.2f} |")
  print("\n".join(lines))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write("\n".join(lines) + "\n")


def main(argv):
  del argv
  if _WORKER.value:
    measure = measure_loop if _WORKER.value == "loop" else measure_steps
    print(json.dumps(measure(_STEPS.value)))
  else:
    drive()


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(main)
