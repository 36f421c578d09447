"""Training throughput of our trainer against NanoDO's, same model, same batches, on this machine.

  flock /tmp/bench.lock python benchmarks/nanodo_side_by_side.py --nanodo_repo=NANODO_CHECKOUT \
    [--steps=100] [--repeats=3] [--out=docs/results/nanodo_throughput.md]

The model of both: vocabulary 8,192, width 256, 4 heads, 4 layers, MLP 1,024, learned positions,
tied embeddings, float32, context 256, batch 16 (NanoDO's architecture: pre-LayerNorm without biases,
GELU MLP). The batches are ours: the embedded corpus through our pipeline (its tokenizer for
V=8,192); NanoDO gets the same token rows from memory (benchmarks/nanodo_steps.py, which needs
NanoDO's dependencies: clu, grain, tensorflow-datasets; TensorFlow is not needed).

Each measurement is a fresh process; all of them alternate, `repeats` times. Ours is measured
twice: `lm-train`'s own loop (lm.train.train_and_evaluate: our data pipeline, host-to-device
assembly, the step, the metrics read one step late, the non-finite check, the log; the time between
its first and last progress report, from its metrics log) and the step loop alone on batches from
memory, like NanoDO's side. Two more rows say where the difference comes from: our step loop with
XLA's default CPU fusion (`cpu_library_fusion=""`), and NanoDO with the same XLA option as ours
(`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce`). Printed: steps/s (best,
median), CPU seconds per step (all threads), each ratio to NanoDO's best as it ships, the CPU
model, and `uptime` before and after (other load on the machine).

`--worker=loop|steps` measures ours once; `--profile=DIR` traces 3 steps of the step loop and
prints where their time goes (benchmarks/profiles.py).
"""

import json
import os
import statistics
import sys
import tempfile
import time

import profiles
import workers
from absl import app, flags

_NANODO_REPO = flags.DEFINE_string("nanodo_repo", None, "A checkout of google-deepmind/nanodo.")
_NANODO_PYTHON = flags.DEFINE_string("nanodo_python", sys.executable,
                                     "Python with NanoDO's dependencies (default: this one).")
_STEPS = flags.DEFINE_integer("steps", 100, "Timed steps per measurement.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternating repeats.")
_OUT = flags.DEFINE_string("out", "", "Write the markdown table here too.")
_WORKER = flags.DEFINE_enum("worker", None, ["loop", "steps", "matmuls"], "Measure ours once, this way.")
_TOKENS = flags.DEFINE_string("tokens", "", "With --worker: also save the token rows here (.npy).")
_PROFILE = flags.DEFINE_string("profile", None, "With --worker=steps: trace 3 steps into this directory.")
_FUSION = flags.DEFINE_string("cpu_library_fusion", None, "With --worker: this config.cpu_library_fusion.")
_CROSS_ENTROPY = flags.DEFINE_string("cross_entropy_impl", None,
                                     "With --worker: this train.cross_entropy_impl.")

# What our CPU default (configs/base.py cpu_library_fusion) sets, as an XLA flag for NanoDO's process.
OUR_XLA_FLAG = "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce"

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
  if _FUSION.value is not None:
    c.cpu_library_fusion = _FUSION.value
  if _CROSS_ENTROPY.value is not None:
    c.train.cross_entropy_impl = _CROSS_ENTROPY.value
  return c


def measure_loop(steps: int) -> dict:
  """lm-train's loop: steps/s between its first report (after step 1, which compiles) and the last."""
  from lm import train
  from lm.runtime import run_log  # noqa: PLC0415

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


def measure_matmuls(steps: int) -> dict:
  """The step's matrix products alone, forward and backward, at the model's shapes: no layer norm,
  GELU, softmax, loss or optimiser. What a trainer would reach if everything else were free."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  V, D, H, L, F = (SIZES[k] for k in "VDHLF")
  B, T, K = 16, 256, D // H
  shapes = {"qkv": (D, 3 * D), "out": (D, D), "up": (D, F), "down": (F, D), "embed": (D, V)}
  keys = iter(jax.random.split(jax.random.key(0), 2 * L * len(shapes)))
  params = [{n: jax.random.normal(next(keys), s) * s[0]**-0.5 for n, s in shapes.items()} for _ in range(L)]
  x_nd = jax.random.normal(next(keys), (B * T, D))

  def products(params, x_nd):
    total = 0.0
    for p in params:
      q, k, v = jnp.split(x_nd @ p["qkv"], 3, axis=-1)
      q, k, v = (y.reshape(B, T, H, K) for y in (q, k, v))
      s_bhqk = jnp.einsum("bqhk,bshk->bhqs", q, k)
      a_nd = jnp.einsum("bhqs,bshk->bqhk", s_bhqk, v).reshape(B * T, D)
      x_nd = x_nd + a_nd @ p["out"] * 1e-3
      x_nd = x_nd + (x_nd @ p["up"]) @ p["down"] * 1e-3
      total = total + (x_nd @ p["embed"]).sum() if p is params[-1] else total
    return total

  step = jax.jit(jax.value_and_grad(products))
  jax.block_until_ready(step(params, x_nd))
  start, cpu = time.perf_counter(), time.process_time()
  for _ in range(steps):
    out = step(params, x_nd)
  jax.block_until_ready(out)
  seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
  return {
      "code": "matrix products alone",
      "steps_per_s": steps / seconds,
      "cpu_s_per_step": cpu / steps,
      "loss": None,
      "jax": jax.__version__
  }


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
  # label → (command, extra XLA flags); the first row writes the token rows NanoDO reads.
  rows = {
      "ours (step loop)": (ours + ["--worker=steps", f"--tokens={tokens}"], ""),
      "NanoDO": (nanodo, ""),
      "ours (lm-train loop)": (ours + ["--worker=loop"], ""),
      "ours (step loop), XLA's default CPU fusion": (ours + ["--worker=steps", "--cpu_library_fusion="], ""),
      "ours (step loop), the plain cross-entropy (`xla`)":
          (ours + ["--worker=steps", "--cross_entropy_impl=xla"], ""),
      "NanoDO with our XLA CPU option": (nanodo, OUR_XLA_FLAG),
      "the step's matrix products alone (with our XLA CPU option)":
          (ours + ["--worker=matmuls"], OUR_XLA_FLAG),
  }
  print(f"machine: {workers.machine()}\nbefore: {workers.uptime()}", flush=True)
  results = {label: [] for label in rows}
  for _ in range(_REPEATS.value):
    for label, (cmd, xla_flags) in rows.items():
      results[label].append(workers.run_json(cmd, xla_flags))
      print(json.dumps({"row": label, **results[label][-1]}), flush=True)
  print(f"after: {workers.uptime()}", flush=True)
  best_nanodo = max(r["steps_per_s"] for r in results["NanoDO"])
  lines = [
      "| trainer | steps/s best | median | tokens/s best | CPU s/step (min) | x NanoDO (best) |",
      "|---|---|---|---|---|---|"
  ]
  for label, runs in results.items():
    rates = [r["steps_per_s"] for r in runs]
    cpus = [r["cpu_s_per_step"] for r in runs if r["cpu_s_per_step"] is not None]
    lines.append(f"| {label} | {max(rates):.3f} | {statistics.median(rates):.3f} | "
                 f"{max(rates) * 16 * 256:,.0f} | {f'{min(cpus):.2f}' if cpus else 'n/a'} | "
                 f"{max(rates) / best_nanodo:.2f} |")
  print("\n".join(lines))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write("\n".join(lines) + "\n")


def main(argv):
  del argv
  if _WORKER.value:
    measure = {"loop": measure_loop, "steps": measure_steps, "matmuls": measure_matmuls}[_WORKER.value]
    print(json.dumps(measure(_STEPS.value)))
  else:
    drive()


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(main)
