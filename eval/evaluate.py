"""Evaluates a checkpoint: `lm-evaluate --workdir=DIR [--step=S] [--split=validation]`.

Restores the parameters sharded over the devices present (the saved config's Experiment says how),
runs the task's deterministic evaluation pipeline, prints the metrics as JSON and then writes them
to DIR/eval/step_S.json (whole: a reader never sees part of it). A workdir that cannot be written
(read-only, full) still gets the metrics printed; the command then fails naming the file and why. For language models these include `loss_by_position`: the token-weighted loss
(with its standard error and token count) of the targets at input positions 0, 1, 2-3, 4-7, ... of
their document's context window.
"""

import json

import jax
from absl import flags
from etils import epath

from data_pipelines import storage
from lm import checkpointing
from lm.experiment import Experiment
from lm.runtime import cli

ATTENTION_IMPL = "attention_impl"
ATTENTION_IMPL_HELP = ("Attention kernel to read the run with (model.attention_impl: auto, reference, "
                       "...); default: the run's. Kernels compute the same function.")


def result_path(workdir: str, step: int) -> epath.Path:
  return epath.Path(workdir) / "eval" / f"step_{step}.json"


def evaluate(workdir: str, step: int | None = None, split: str = "validation",
             attention_impl: str | None = None) -> dict:
  """Metrics of the checkpoint at `step` (default: the latest) on `split`; `attention_impl` (a
  kernel, which computes the same function) replaces the run's model.attention_impl."""
  step, config = checkpointing.saved_config(workdir, step)
  exp = experiment_here(config, attention_impl)
  sets = exp.eval_sets()
  if split not in sets:
    raise ValueError(f"task {config.task!r} has no evaluation set {split!r}; choose one of: "
                     f"{', '.join(sets)}")
  _, params = checkpointing.load(workdir, step, exp.abstract_sharded_state())
  return {
      "step": step,
      "split": split,
      "attention": exp.model_cfg.attention,
      "num_params": exp.num_params,
      "tokens_seen": step * config.train.batch_size * exp.task.seq_len,
      **exp.evaluate(params, sets[split]())
  }


def experiment_here(config, attention_impl: str | None) -> Experiment:
  """The saved run's Experiment on this host's devices, with its kernel replaced by `attention_impl`
  if given (lm-evaluate, lm-sample --attention_impl); a kernel that does not run here is one line."""
  if attention_impl:
    config.model.attention_impl = attention_impl
  exp = Experiment(config)
  exp.check_kernels_run_here("--attention_impl")
  return exp


def write(workdir: str, result: dict) -> None:
  """Writes `evaluate`'s result whole to result_path (process 0 only)."""
  if jax.process_index() == 0:
    storage.write_text(result_path(workdir, result["step"]), json.dumps(result, indent=1) + "\n")


def main(argv):
  del argv
  workdir = flags.FLAGS.workdir
  try:
    result = evaluate(workdir, flags.FLAGS.step, flags.FLAGS.split, flags.FLAGS.attention_impl)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"lm-evaluate: {e}") from e
  print(json.dumps(result, indent=1), flush=True)  # first: a failed write below loses nothing
  try:
    write(workdir, result)
  except OSError as e:
    raise SystemExit(f"lm-evaluate: the metrics are printed above but were not saved: "
                     f"{storage.write_refused(e) or e}") from e


def run():
  flags.DEFINE_string("workdir", None, "A training run's directory (lm-train --workdir).")
  flags.DEFINE_integer("step", None, "Checkpoint step to evaluate; default: the latest.")
  flags.DEFINE_string("split", "validation", "Evaluation set of the task.")
  flags.DEFINE_string(ATTENTION_IMPL, None, ATTENTION_IMPL_HELP)
  flags.mark_flags_as_required(["workdir"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
