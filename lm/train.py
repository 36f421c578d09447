"""Training loop: `train_and_evaluate(config, workdir)`, and the command
`lm-train --config=configs/X.py --workdir=DIR [--config.a.b=v ...]` around it.

Resumes from the latest complete checkpoint in DIR; on SIGTERM finishes the step, saves, exits 0.
"""

import logging
import numbers
import signal
import time

import jax
import ml_collections
import numpy as np
from absl import flags, logging as absl_logging
from etils import epath
from jax.experimental import multihost_utils
from ml_collections import config_flags

from data_pipelines import pipeline, storage
from lm import checkpointing, experiment, flops
from lm.experiment import Experiment
from lm.runtime import cli, compilation_cache, goodput, metrics, ownership, wandb_log, watchdog


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
        for j in range(index * per_process, (index + 1) * per_process)
    })

  def next(self) -> dict[str, np.ndarray]:
    parts = [next(it) for it in self.shards.iterators.values()]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class StopRequests:
  """Signals that ask for a save and an exit at the end of the current step: SIGTERM (what
  schedulers and TPU maintenance send) and, in a single-process run, SIGINT (Ctrl-C; a second one
  interrupts at once). With several processes JAX's preemption service agrees on the step at which
  all of them stop for SIGTERM, and Ctrl-C interrupts each process at once. The previous handlers
  come back with `restore()`."""

  def __init__(self):
    self.signal = None
    self.previous = {}
    if jax.process_count() == 1:
      for signum in (signal.SIGTERM, signal.SIGINT):
        self.previous[signum] = signal.signal(signum, self._request)

  def _request(self, signum, frame):
    del frame
    self.signal = signum
    if signum == signal.SIGINT:  # no print here: it could land inside a print of the loop
      signal.signal(signal.SIGINT, signal.default_int_handler)

  def reached(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signal is not None

  def restore(self) -> None:
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)


def _setup(config: ml_collections.ConfigDict, workdir: epath.Path):
  """Everything that can fail because of the config, the data or the workdir, before training."""
  if workdir.exists() and not workdir.is_dir():
    raise ValueError(f"--workdir={workdir} is a file; give a directory (it is created if missing)")
  exp = Experiment(config)
  exp.check_kernels_run_here()
  data = HostData(exp)
  ckpt = checkpointing.Checkpointer(workdir, config.checkpoint)
  latest = ckpt.latest_step()
  if latest is not None and latest > config.train.steps:
    if problem := checkpointing.not_a_checkpoint(workdir, latest):  # not a run's later step at all
      raise ValueError(problem)
    # Resuming would evaluate the later parameters and label them with the earlier step.
    raise ValueError(f"{workdir} holds a checkpoint at step {latest}, past train.steps="
                     f"{config.train.steps}; set --config.train.steps={latest} or more to go on "
                     f"training, evaluate it with `lm-evaluate --workdir={workdir} --step={latest}`, "
                     f"or use a new --workdir")
  return exp, data, ckpt


def _restore(exp: Experiment, data: HostData, ckpt: checkpointing.Checkpointer, workdir: epath.Path):
  """(step, state) of the newest checkpoint, or (None, None) without one. A damaged step stops the
  run with a message, or with checkpoint.skip_damaged is set aside with a warning for the one
  before it."""
  config = exp.config
  while (step := ckpt.latest_step()) is not None:
    try:
      checkpointing.check_compatible(ckpt.saved_config(step), config.to_dict())
      return step, ckpt.restore(step, exp.abstract_sharded_state(), data.shards)
    except checkpointing.DamagedCheckpointError as e:
      if not config.checkpoint.skip_damaged:
        raise ValueError(f"{e}. To resume from the newest checkpoint before it, add "
                         f"--config.checkpoint.skip_damaged=true (damaged steps move to "
                         f"{workdir}/damaged_checkpoints; nothing is deleted)") from e
      print(f"warning: {e}; moved it to {ckpt.set_aside(step)}", flush=True)
  if (workdir / "damaged_checkpoints").exists():
    # The data iterators may hold a damaged step's positions: never start over from those.
    raise ValueError(f"no intact checkpoint is left in {ckpt.directory}; use a new --workdir")
  return None, None


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes) to config.train.steps and returns the final evaluation metrics.

  Mistakes in the config, the data or the workdir raise ValueError or FileNotFoundError, before
  anything is trained, with a message that names the fix."""
  workdir = epath.Path(workdir)
  with compilation_cache.enabled(config.compilation_cache, workdir):
    return _train_and_evaluate(config, workdir)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: epath.Path) -> dict:
  clock = goodput.Clock()
  exp, data, ckpt = _setup(config, workdir)
  is_main = jax.process_index() == 0
  seq_len, steps = exp.task.seq_len, config.train.steps
  tokens_per_step = config.train.batch_size * seq_len
  flops_per_token = flops.flops_per_token(exp.model_cfg, exp.num_params, seq_len, exp.task.readout_last)
  procs, devices = jax.process_count(), jax.device_count()
  print(
      f"model: {exp.model_cfg.attention} attention, {exp.num_params:,} parameters; "
      f"{procs} process{'es' * (procs > 1)}, {devices} device{'s' * (devices > 1)}, "
      f"mesh {dict(exp.mesh.shape)}", flush=True)

  clock.enter("restoring")
  start = time.perf_counter()
  latest, state = _restore(exp, data, ckpt, workdir)
  if latest is None:
    state = exp.init_state()
  else:
    print(f"resumed from the checkpoint at step {latest} ({time.perf_counter() - start:.1f}s)", flush=True)
  if is_main:  # after the checks of _restore: a refused config never replaces the run's own
    storage.write_text(workdir / "config.json", config.to_json(indent=1))
  first = int(jax.device_get(state.step))
  eval_sets = exp.eval_sets()
  writer = metrics.Writer(workdir, enabled=is_main)
  if is_main and config.metrics.wandb_project:
    writer = wandb_log.Tee(writer, config.metrics, workdir, config.to_dict())
  # What lm-compare labels the run with; written on every (re)start, so the log alone describes it.
  writer.write(first, "run", {
      "attention": exp.model_cfg.attention,
      "num_params": exp.num_params,
      "tokens_per_step": tokens_per_step
  })
  # A CPU's "peak" is a matmul measured now, which a step can beat: the column is named for what it is.
  label = "of measured matmul" if jax.devices()[0].platform == "cpu" else "MFU"
  progress = metrics.Progress(steps, tokens_per_step, first, flops_per_token, flops.peak_flops(jax.devices()),
                              label)
  requests = StopRequests()
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
      shown = ", ".join(
          f"{k} {v:.4g}" for k, v in result.items() if k != "tokens_seen" and isinstance(v, numbers.Real))
      print(f"eval {name} at step {step}: {shown} ({time.perf_counter() - start:.1f}s)", flush=True)
      results[name] = result
    clock.enter("training")
    return results

  def read(unread: list[tuple[int, dict]], keep: int) -> list[tuple[int, dict]]:
    """Reads, checks and logs the metrics of the unread steps but the newest `keep`; returns those."""
    for step, stats in unread[:len(unread) - keep]:
      stats = {k: float(v) for k, v in jax.device_get(stats).items()}
      watchdog.step_done()
      if step == first + 1:
        progress.mark(step)  # throughput is timed from here: the first step compiles
      if not stats.pop("finite"):
        message = (f"non-finite loss {stats['loss']} or gradient norm {stats['grad_norm']} at step "
                   f"{step}; the update was not applied")
        if config.train.on_nonfinite == "stop":
          raise FloatingPointError(f"{message}; stopping. Lower train.lr or set "
                                   f"train.on_nonfinite=skip")
        print(f"warning: {message} (train.on_nonfinite=skip)", flush=True)
        writer.write(step, "skipped", stats)
      if step % config.train.log_every_steps == 0 or step == steps:
        stats.update(progress.report(step, stats["loss"]))
        writer.write(step, "train", {**stats, "tokens_seen": step * tokens_per_step})
        writer.write(step, "goodput", clock.totals())
    return unread[len(unread) - keep:]

  unread = []  # (step, stats) of dispatched steps whose metrics are still on the device
  stop = False
  try:
    for step in range(first + 1, steps + 1):
      state, stats = exp.train_step(state, exp.global_batch(data.next()))
      unread.append((step, stats))
      stop = requests.reached(step)
      save = stop or step == steps or step % config.checkpoint.every_steps == 0
      # The one place metrics are read: one step late, so the host has dispatched the next step
      # before it waits for this one; all of them before a save, so a checkpoint holds checked steps.
      unread = read(unread, keep=0 if save else 1)
      if save:
        clock.enter("checkpointing")
        start = time.perf_counter()
        ckpt.save(step, state, data.shards, config, force=True)
        writer.write(step, "checkpoint", {"seconds_blocked": time.perf_counter() - start})
        clock.enter("training")
      if stop:
        break
      if step % config.eval.every_steps == 0 and step < steps:
        run_eval(step)
    if not stop:
      final = run_eval(steps, exp.eval_sets(final=True))
  except BaseException as e:
    e.add_note(_close_after_failure(ckpt, writer, workdir, e))  # main() puts it in its one line
    raise
  finally:
    requests.restore()
    clock.close()
  clock.enter("checkpointing")
  try:
    ckpt.close()  # waits for the save in flight: the final one (or the stop's) can fail here too
  except BaseException as e:
    e.add_note(_close_after_failure(ckpt, writer, workdir, e, save_failed=True))
    raise
  writer.write(step if stop else steps, "goodput", clock.totals())
  writer.close()
  if stop:
    interrupted = requests.signal == signal.SIGINT
    print(
        f"{'interrupted' if interrupted else 'preempted'}: saved the checkpoint at step {step}; "
        f"exiting", flush=True)
    raise SystemExit(130 if interrupted else 0)  # 130: what a shell reports after Ctrl-C
  main_set = next(iter(final.values()))
  if "perplexity" in main_set:
    baseline = main_set.get("unigram_perplexity")
    print(
        f"final validation perplexity {main_set['perplexity']:.2f}" +
        (f" (unigram baseline {baseline:.2f})" if baseline else ""), flush=True)
  return final


def _close_after_failure(ckpt: checkpointing.Checkpointer, writer: metrics.Writer, workdir: epath.Path,
                         failure: BaseException, save_failed: bool = False) -> str:
  """Finishes the save in flight (so the checkpoint named here exists) or discards what it left, and
  the log; returns what was saved and where a rerun of the same command resumes. save_failed: the
  failure is the save in flight's own (raised by ckpt.close), so only what it left is discarded."""
  failed = []
  cause = (storage.write_refused(failure) or "").split(":")[0]
  closes = {"the checkpoint being saved": ckpt.close, "the run log's last records": writer.close}
  if save_failed:
    del closes["the checkpoint being saved"]
  for what, close in closes.items():
    try:
      close()
    except Exception as e:  # the storage that failed the run may fail these too (orbax keeps no part)
      refused = storage.write_refused(e)
      if refused and refused.split(":")[0] == cause:  # the line names that cause and its fix already
        failed.append(f"{what} could not be written either")
      else:
        failed.append(f"{what} could not be written ({refused or str(e).splitlines()[0]})")
  ckpt.discard_unfinished()
  return "; ".join(failed + [_saved(workdir)])


def _saved(workdir: str | epath.Path) -> str:
  """The newest checkpoint on disk now, and that a rerun of the same command resumes from it."""
  latest = checkpointing.latest_step(workdir)
  if latest is None:
    return "no checkpoint was saved"
  return f"the latest checkpoint is at step {latest}; the same command resumes from it"


def _silence_refused_writes(record: logging.LogRecord) -> bool:
  """orbax (and asyncio under it) logs a failed asynchronous save from each of its threads, with
  tracebacks: hundreds of lines that bury the cause, which main() reports in one line."""
  return not (record.exc_info and storage.write_refused(record.exc_info[1]))


def _out_of_memory(e: BaseException) -> str | None:
  """One line for the devices running out of memory (XLA's RESOURCE_EXHAUSTED), naming the knobs."""
  if not (isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)):
    return None
  return (f"out of device memory ({str(e).splitlines()[0][:200]}); raise train.microbatches, lower "
          f"train.batch_size or data.seq_len, use a smaller model or set model.remat=block (lm-compile "
          f"--topology=... prints the memory a chip needs before a run)")


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  try:  # before the watchdog reads its durations and the lock creates the workdir
    experiment.check_counts(FLAGS.config)
  except ValueError as e:
    raise SystemExit(f"lm-train: {e}") from None
  watchdog.start(FLAGS.config.watchdog)  # First: joining the other processes can hang too.
  cli.join_distributed()
  absl_logging.get_absl_handler().addFilter(_silence_refused_writes)
  try:
    with ownership.hold(FLAGS.workdir, FLAGS.lease_seconds):
      train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except Exception as e:  # pylint: disable=broad-except
    # A full disk: orbax raises it as whatever it caught. A workdir refused at the start is named already.
    refused = None if isinstance(e, ownership.WorkdirError) else (storage.write_refused(e) or
                                                                  _out_of_memory(e))
    if not refused and not isinstance(e, (ValueError, OSError, FloatingPointError, ownership.WorkdirError)):
      raise
    # The last note is what _close_after_failure saw saved (grain adds notes of its own before it).
    notes = getattr(e, "__notes__", [])[-1:]
    saved = _saved(FLAGS.workdir) if refused else None
    if saved and not (notes and notes[-1].endswith(saved)):
      notes = [saved]  # refused before training (the lock, config.json): no note of _close_after_failure
    raise SystemExit("; ".join([f"lm-train: {refused or e}", *notes])) from e


def run():
  config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).")
  flags.DEFINE_string("workdir", None, "Directory for metrics and checkpoints.")
  flags.DEFINE_float(
      "lease_seconds", 60, "On gs://, how long a job that died keeps the workdir "
      "(lm/runtime/ownership.py); local workdirs are released at once.")
  cli.define_distributed_flags()
  flags.mark_flags_as_required(["config", "workdir"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
