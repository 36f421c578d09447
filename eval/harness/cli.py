"""`lm-harness --workdir=DIR [--step=S] --tasks=wikitext,lambada_openai,piqa,... [--data_dir=D]
[--num_fewshot=0] [--limit=N] [--batch_size=B] [--output=FILE]` and `lm-harness-download --tasks=...
--out=D`.

lm-harness restores a checkpoint as lm-evaluate does (sharded over the devices present, the run's own
tokenizer) and runs lm-evaluation-harness's evaluation on it (eval/harness/model.py), offline: the tasks'
data come from --data_dir (written by lm-harness-download on a machine with network, or YAML tasks of
one's own there) and the harness's offline settings keep it from any hub. It prints the harness's table
and writes DIR/harness/step_S.json (or --output) whole: per task the harness's metrics with their
standard errors, and every item's scores by document id (for paired differences between variants,
eval/harness/paired.py). The harness runs on process 0 alone; other processes follow its steps.
"""

import json
import os
import tempfile

import jax
from absl import flags
from etils import epath

from data_pipelines import sources, storage
from eval.harness import scoring
from lm import checkpointing
from lm.experiment import Experiment
from lm.runtime import cli

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def result_path(workdir: str, step: int) -> epath.Path:
  return epath.Path(workdir) / "harness" / f"step_{step}.json"


def per_item(samples: list[dict]) -> dict[str, list]:
  """The item scores of one task's samples, in document order: doc_id and each metric's value (a
  number, or the pair that a corpus-level metric such as word perplexity aggregates). A metric of a
  filter other than the harness's default ("none") is named METRIC,FILTER."""
  by_filter = {}
  for s in samples:
    by_filter.setdefault(s.get("filter", "none"), []).append(s)
  out = {}
  for name, mine in by_filter.items():
    mine.sort(key=lambda s: s["doc_id"])
    out.setdefault("doc_id", [s["doc_id"] for s in mine])
    for m in mine[0].get("metrics", []):
      values = [s[m] for s in mine]
      out[m if name == "none" else f"{m},{name}"] = [
          list(v) if isinstance(v, (tuple, list)) else float(v) for v in values
      ]
  return out


def harness(workdir: str, tasks: list[str], *, step: int | None = None, data_dir: str | None = None,
            num_fewshot: int | None = None, limit: int | None = None, batch_size: int | None = None,
            bootstrap_iters: int = 1000) -> dict | None:
  """The harness's results for the checkpoint at `step` (default: the latest); None on processes
  other than 0, which follow process 0's steps."""
  os.environ.update(OFFLINE)
  os.environ["DISABLE_MULTIPROC"] = "1"  # its bootstrap would fork this process, JAX's threads and all
  step, config = checkpointing.saved_config(workdir, step)
  if config.task != "lm":
    raise ValueError(f"this checkpoint is of task {config.task!r}; lm-harness scores language models "
                     f"(task lm)")
  exp = Experiment(config)
  tokenizer = sources.load_tokenizer(config.data, exp.model_cfg.V)
  _, params = checkpointing.load(workdir, step, exp.abstract_sharded_state())
  scorer = scoring.Scorer(exp, params, batch_size or config.eval.batch_size)
  if jax.process_index() != 0:
    scorer.lockstep.follow(scorer)
    return None
  try:
    results, table = _evaluate(scorer, tokenizer, tasks, data_dir, num_fewshot, limit, bootstrap_iters)
  finally:
    scorer.lockstep.stop()
  return {
      "step": step,
      "attention": exp.model_cfg.attention,
      "num_params": exp.num_params,
      "tokens_seen": step * config.train.batch_size * config.data.seq_len,
      "tasks": tasks,
      "num_fewshot": num_fewshot,
      "limit": limit,
      "batch_size": scorer.rows,
      "results": results["results"],
      "n-samples": results["n-samples"],
      "versions": results["versions"],
      "items": {
          t: per_item(s) for t, s in results["samples"].items()
      },
      "table": table,
  }


def _evaluate(scorer, tokenizer, tasks, data_dir, num_fewshot, limit, bootstrap_iters):
  import lm_eval
  from lm_eval.tasks import TaskManager
  from lm_eval.utils import make_table

  from eval.harness import model, tasks as tasks_lib
  with tempfile.TemporaryDirectory(prefix="lm-harness-") as tmp:
    include = tasks_lib.local_tasks(tasks, data_dir, tmp) if data_dir else None
    manager = TaskManager(include_path=[str(p) for p in include] if include else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
      raise ValueError(f"no task {', '.join(map(repr, unknown))} in lm-evaluation-harness"
                       f"{' or in ' + data_dir if data_dir else ''}; check --tasks")
    results = lm_eval.simple_evaluate(model=model.HarnessLM(scorer, tokenizer), tasks=tasks,
                                      num_fewshot=num_fewshot, limit=limit, batch_size=scorer.rows,
                                      task_manager=manager, log_samples=True, bootstrap_iters=bootstrap_iters,
                                      torch_random_seed=None)
  return results, make_table(results)


def write(path: str | epath.Path, result: dict) -> None:
  if jax.process_index() == 0:
    storage.write_text(path, json.dumps(result, indent=1) + "\n")


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cli.join_distributed()
  try:
    result = harness(FLAGS.workdir, FLAGS.tasks, step=FLAGS.step, data_dir=FLAGS.data_dir,
                     num_fewshot=FLAGS.num_fewshot, limit=FLAGS.limit, batch_size=FLAGS.batch_size,
                     bootstrap_iters=FLAGS.bootstrap_iters)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"lm-harness: {e}") from e
  if result is None:
    return
  print(result["table"], flush=True)
  path = FLAGS.output or result_path(FLAGS.workdir, result["step"])
  try:
    write(path, result)
  except OSError as e:
    raise SystemExit(f"lm-harness: the table is printed above but the results were not saved: "
                     f"{storage.write_refused(e) or e}") from e
  print(f"lm-harness: {path}")


def run():
  flags.DEFINE_string("workdir", None, "A training run's directory (lm-train --workdir).")
  flags.DEFINE_integer("step", None, "Checkpoint step to score; default: the latest.")
  flags.DEFINE_list(
      "tasks", None, "Harness tasks, e.g. wikitext,lambada_openai,piqa,hellaswag,winogrande,"
      "arc_easy,arc_challenge.")
  flags.DEFINE_string(
      "data_dir", None, "The tasks' local data (lm-harness-download --out), and any YAML "
      "tasks of your own; without it only the Hugging Face cache is read.")
  flags.DEFINE_integer("num_fewshot", None, "Examples in each prompt; default: the task's (zero-shot for "
                       "the standard set).")
  flags.DEFINE_integer("limit", None, "Score only the first N items of each task (say so when reporting).")
  flags.DEFINE_integer("batch_size", None, "Rows of the trained context per scoring step; default: "
                       "the run's eval.batch_size.")
  flags.DEFINE_integer(
      "bootstrap_iters", 1000, "Bootstrap draws for the standard errors of corpus-level "
      "metrics (perplexities); 0: none.")
  flags.DEFINE_string("output", None, "JSON file for the results; default: WORKDIR/harness/step_S.json.")
  # Several hosts (as lm-train): process 0 runs the harness, the others follow its steps.
  cli.define_distributed_flags()
  flags.mark_flags_as_required(["workdir", "tasks"])
  cli.run(main, __name__)


def download_main(argv):
  del argv
  from eval.harness import tasks
  try:
    for manifest in tasks.download(flags.FLAGS.tasks, flags.FLAGS.out):
      print(f"lm-harness-download: {manifest.parent}: {json.loads(manifest.read_text())['rows']}")
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"lm-harness-download: {e}") from e


def run_download():
  flags.DEFINE_list(
      "tasks", ",".join(
          ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")),
      "Harness tasks whose data to download.")
  flags.DEFINE_string("out", None, "Directory to write the data into (lm-harness --data_dir).")
  flags.mark_flags_as_required(["out"])
  cli.run(download_main, __name__)


if __name__ == "__main__":
  run()
