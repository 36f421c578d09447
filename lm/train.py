"""Training loop: `lm-train --config=configs/X.py --workdir=DIR [--config.a.b=v ...]`.

Resumes from the latest complete checkpoint in DIR; on SIGTERM finishes the step, saves, exits 0.
"""

import numbers
import signal
import time

import jax
import ml_collections
import numpy as np
from absl import flags, logging
from etils import epath
from jax.experimental import multihost_utils
from ml_collections import config_flags

from data_pipelines import pipeline
from lm import checkpointing, cli, compilation_cache, flops, goodput, metrics, wandb_log, watchdog
from lm.experiment import Experiment

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics and checkpoints.")
_JAX_DISTRIBUTED = flags.DEFINE_bool(
    "jax_distributed", False, "Call jax.distributed.initialize() with no arguments (TPU VM slices, "
    "where the environment describes the job).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")


class HostData:
  """This process's logical data shards and their host-local batch.

  The global batch is split into `data.shards` logical shards (default: one per process), each with
  its own pipeline over its own slice of the source; a process owns a contiguous range of them.
  With a fixed shard count the global batch, and so the whole run, is the same on any number of
  processes, and a checkpoint resumes on any process count that divides it.
  """

  def __init__(self, exp: Experiment):
    config, count, index = exp.config, jax.process_count(), jax.process_index()
    shards = config.data.shards or count
    if shards % count or config.train.batch_size % shards:
      raise ValueError(f"data.shards={shards} must be a multiple of the {count} processes and divide "
                       f"train.batch_size={config.train.batch_size}")
    per_process = shards // count
    rows = config.train.batch_size // shards
    self.shards = checkpointing.DataShards({
        j: exp.task.train_iterator(pipeline.Shard(j, shards), rows)
        for j in range(index * per_process, (index + 1) * per_process)})

  def next(self) -> dict[str, np.ndarray]:
    parts = [next(it) for it in self.shards.iterators.values()]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class Preemption:
  """SIGTERM (what schedulers and TPU maintenance send) asks for a save and a clean exit. With
  several processes JAX's preemption service agrees on the step at which all of them stop."""

  def __init__(self):
    self.requested = False
    if jax.process_count() == 1:
      signal.signal(signal.SIGTERM, self._request)

  def _request(self, signum, frame):
    del signum, frame
    self.requested = True

  def reached(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.requested


def _setup(config: ml_collections.ConfigDict, workdir: epath.Path):
  """Everything that can fail because of the config, the data or the workdir, before training."""
  exp = Experiment(config)
  data = HostData(exp)
  ckpt = checkpointing.Checkpointer(workdir, config.checkpoint)
  latest = ckpt.latest_step()
  if latest is not None:
    checkpointing.check_compatible(ckpt.saved_config(latest), config.to_dict())
  return exp, data, ckpt, latest


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes) to config.train.steps and returns the final evaluation metrics."""
  workdir = epath.Path(workdir)
  clock = goodput.Clock()
  compilation_cache.enable(config.compilation_cache, workdir)
  try:
    exp, data, ckpt, latest = _setup(config, workdir)
  except (ValueError, FileNotFoundError) as e:
    # Mistakes in the config, the data or the workdir: the message names the fix.
    raise SystemExit(f"lm-train: {e}") from e
  is_main = jax.process_index() == 0
  if is_main:
    (workdir / "config.json").write_text(config.to_json(indent=1))
  seq_len, steps = exp.task.seq_len, config.train.steps
  tokens_per_step = config.train.batch_size * seq_len
  flops_per_token = flops.flops_per_token(exp.model_cfg, exp.num_params, seq_len)
  procs, devices = jax.process_count(), jax.device_count()
  print(f"model: {exp.model_cfg.attention} attention, {exp.num_params:,} parameters; "
        f"{procs} process{'es' * (procs > 1)}, {devices} device{'s' * (devices > 1)}, "
        f"mesh {dict(exp.mesh.shape)}", flush=True)

  clock.enter("restoring")
  if latest is None:
    state = exp.init_state()
  else:
    start = time.perf_counter()
    state = ckpt.restore(latest, exp.abstract_sharded_state(), data.shards)
    print(f"resumed from the checkpoint at step {latest} ({time.perf_counter() - start:.1f}s)", flush=True)
  first = int(jax.device_get(state.step))
  eval_sets = exp.eval_sets()
  writer = metrics.Writer(workdir, enabled=is_main)
  if is_main and config.metrics.wandb_project:
    writer = wandb_log.Tee(writer, config.metrics, workdir, config.to_dict())
  # What lm-compare labels the run with; written on every (re)start, so the log alone describes it.
  writer.write(first, "run", {"attention": exp.model_cfg.attention, "num_params": exp.num_params,
                              "tokens_per_step": tokens_per_step})
  progress = metrics.Progress(steps, tokens_per_step, first, flops_per_token,
                              flops.peak_flops(jax.devices()))
  preemption = Preemption()
  clock.enter("training")

  def run_eval(step: int, sets=eval_sets) -> dict:
    watchdog.compiling(f"evaluation at step {step}")
    clock.enter("evaluating")
    results = {}
    for name, batches in sets.items():
      start = time.perf_counter()
      result = {**exp.evaluate(state.params, batches()), "tokens_seen": step * tokens_per_step}
      writer.write(step, f"eval/{name}", result)
      # Numbers only: the loss by position is in the log, too long for the line.
      shown = ", ".join(f"{k} {v:.4g}" for k, v in result.items()
                        if k != "tokens_seen" and isinstance(v, numbers.Real))
      print(f"eval {name} at step {step}: {shown} ({time.perf_counter() - start:.1f}s)", flush=True)
      results[name] = result
    clock.enter("training")
    return results

  def check(step: int, stats: dict) -> dict:
    stats = {k: float(v) for k, v in jax.device_get(stats).items()}
    watchdog.step_done()
    if not stats.pop("finite"):
      message = (f"non-finite loss {stats['loss']} or gradient norm {stats['grad_norm']} at step "
                 f"{step}; the update was not applied")
      if config.train.on_nonfinite == "stop":
        raise FloatingPointError(f"{message}. Stopping; the latest checkpoint is at step "
                                 f"{ckpt.latest_step()}. Lower train.lr or set train.on_nonfinite=skip")
      print(f"warning: {message} (train.on_nonfinite=skip)", flush=True)
      writer.write(step, "skipped", stats)
    return stats

  def report(step: int, stats: dict) -> None:
    stats.update(progress.report(step, stats["loss"]))
    writer.write(step, "train", {**stats, "tokens_seen": step * tokens_per_step})
    writer.write(step, "goodput", clock.totals())

  pending = None  # (step, stats) of the previous step, read after the next one is dispatched
  for step in range(first + 1, steps + 1):
    state, stats = exp.train_step(state, exp.global_batch(data.next()))
    if pending is not None:
      done_step, done_stats = pending[0], check(*pending)
      if done_step % config.train.log_every_steps == 0:
        report(done_step, done_stats)
    pending = (step, stats)
    if step == first + 1:
      jax.block_until_ready(stats)
      progress.mark(step)
    stop = preemption.reached(step)
    if stop or step == steps or step % config.checkpoint.every_steps == 0:
      # Saving reads this step's state, which the next step would donate: check it first.
      stats = check(*pending)
      if step % config.train.log_every_steps == 0 or step == steps:
        report(step, stats)
      pending = None
      clock.enter("checkpointing")
      start = time.perf_counter()
      ckpt.save(step, state, data.shards, config, force=True)
      writer.write(step, "checkpoint", {"seconds_blocked": time.perf_counter() - start})
      clock.enter("training")
    if stop:
      clock.enter("checkpointing")
      ckpt.wait()
      writer.write(step, "goodput", clock.totals())
      print(f"preempted: saved the checkpoint at step {step}; exiting", flush=True)
      ckpt.close()
      raise SystemExit(0)
    if step % config.eval.every_steps == 0 and step < steps:
      run_eval(step)
  if pending is not None:
    report(pending[0], check(*pending))
  final = run_eval(steps, exp.eval_sets(final=True))
  clock.enter("checkpointing")
  ckpt.wait()
  writer.write(steps, "goodput", clock.totals())
  clock.close()
  ckpt.close()
  main_set = next(iter(final.values()))
  if "perplexity" in main_set:
    baseline = main_set.get("unigram_perplexity")
    print(f"final validation perplexity {main_set['perplexity']:.2f}"
          + (f" (unigram baseline {baseline:.2f})" if baseline else ""), flush=True)
  return final


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    # Libraries (orbax, jax) log every save and compile at INFO; the progress line says enough.
    logging.set_verbosity(logging.WARNING)
  watchdog.start(_CONFIG.value.watchdog)  # First: joining the other processes can hang too.
  if _JAX_DISTRIBUTED.value:
    jax.distributed.initialize()
  elif _COORDINATOR.value:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  train_and_evaluate(_CONFIG.value, _WORKDIR.value)


def run():
  flags.mark_flags_as_required(["config", "workdir"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
