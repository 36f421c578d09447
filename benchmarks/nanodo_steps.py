"""Training steps/s of NanoDO (google-deepmind/nanodo) on this machine, on batches we give it.

Imports nothing of this repository's package (benchmarks/nanodo_side_by_side.py runs it and ours
alternately):

  python benchmarks/nanodo_steps.py --repo=NANODO_CHECKOUT --tokens=BATCHES.npy --steps=100

BATCHES.npy: int32 token rows [N, B, T]. The model is built by NanoDO's model factory from its
default config with the side-by-side model's sizes; the state by its `_init_train_state`; each step
is its `Trainer.do_step`, and the previous step's metrics are fetched and aggregated after the next
step is dispatched, as its training loop does (`write_train_metrics_every_steps=1`, its default,
with its default per-parameter statistics). Its loop's data pipeline (TFDS), metric writers and
checkpoints are not run: the rows come from memory.

Its nanodo/train.py imports clu's metric writers and periodic actions at the top, which import
TensorFlow; they are used only by its `train_and_evaluate`, which is not run here, so they are
given empty stand-in modules when TensorFlow is absent. Nothing else of its code changes.

Prints one JSON line: steps/s and CPU seconds per step after compilation. `--profile=DIR` also
traces 3 steps and prints each kind of XLA operation's share of them.
"""

import argparse
import json
import pathlib
import sys
import time
import types

import profiles

WARMUP_STEPS = 3


def _import_nanodo(repo: pathlib.Path):
  try:
    import tensorflow  # noqa: F401, PLC0415
  except ImportError:
    for name in ("clu.metric_writers", "clu.periodic_actions"):
      sys.modules[name] = types.ModuleType(name)
  sys.path.insert(0, str(repo))
  from nanodo import metrics, model_factory, train  # noqa: PLC0415
  from nanodo.configs import default  # noqa: PLC0415
  return default, metrics, model_factory, train


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repo", required=True, help="a checkout of google-deepmind/nanodo")
  parser.add_argument("--tokens", required=True, help="int32 rows [N, B, T] (.npy)")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--D", type=int, default=256)
  parser.add_argument("--H", type=int, default=4)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--F", type=int, default=1024)
  parser.add_argument("--V", type=int, default=8192)
  parser.add_argument("--profile", default=None)
  args = parser.parse_args()
  default, metrics_lib, model_factory, train = _import_nanodo(pathlib.Path(args.repo))
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.experimental import mesh_utils  # noqa: PLC0415

  rows_nbt = np.load(args.tokens)
  c = default.get_config()
  c.batch_size = rows_nbt.shape[1]
  c.model.update(D=args.D, H=args.H, L=rows_nbt.shape[2], N=args.layers, F=args.F, dtype="float32")
  c.opt.num_train_steps = 10_000
  mesh = jax.sharding.Mesh(mesh_utils.create_device_mesh((jax.device_count(),)), ("data",))
  model, get_loss_fn = model_factory.get_model_and_loss(c, args.V)
  shardings, state = train._init_train_state(c, model, rng=jax.random.PRNGKey(c.seed), mesh=mesh)  # pylint: disable=protected-access
  trainer = train.Trainer(c=c, state=state, mesh=mesh, shardings=shardings, get_loss_fn=get_loss_fn)

  def steps(first: int, count: int, pending: dict | None) -> dict:
    for step in range(first, first + count):
      new = trainer.do_step(step, rows_nbt[step % len(rows_nbt)])
      if pending is not None:  # its loop: the previous step's metrics, after dispatching this one
        loss = metrics_lib.aggregate_microbatch_metrics([trainer.get_metrics(step - 1,
                                                                             pending)])["train_loss"]
        if not np.isfinite(loss):
          raise FloatingPointError(f"non-finite loss at step {step - 1}")
      pending = new
    return pending

  pending = steps(0, WARMUP_STEPS, None)
  jax.block_until_ready(pending)
  start, cpu = time.perf_counter(), time.process_time()
  pending = steps(WARMUP_STEPS, args.steps, pending)
  loss = float(trainer.get_metrics(WARMUP_STEPS + args.steps, pending)["train_loss"])
  seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
  if args.profile:
    with jax.profiler.trace(args.profile, create_perfetto_trace=True):
      jax.block_until_ready(steps(WARMUP_STEPS + args.steps, 3, pending))
    profiles.print_shares(args.profile)
  print(
      json.dumps({
          "code": "nanodo",
          "steps_per_s": args.steps / seconds,
          "cpu_s_per_step": cpu / args.steps,
          "loss": loss,
          "jax": jax.__version__
      }))


if __name__ == "__main__":
  main()
