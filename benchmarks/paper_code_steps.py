"""Training steps/s of the paper's own code (smonsays/hypernetwork-attention) on this machine.

Runs in its own venv, never in ours (benchmarks/compositional_throughput.py sets both up and
alternates the two); imports nothing of this repository:

  python benchmarks/paper_code_steps.py --repo=DIR --model=transformer --steps=200

DIR is a checkout of the paper's repository. Its run.py imports two modules that only its
WikiText runs use (tensorflow, hyla.data.wiki); this script loads a copy of run.py, written next to
the original as run_guarded.py, in which those two imports are guarded by try/except. Nothing else
of its code changes. The loop is its Experiment.run's: train_step on its own data loader, metrics
fetched only at the end, so the device queue is never drained between steps (as with its
log_every=1000). Prints one JSON line: steps/s after compilation.
"""

import argparse
import json
import pathlib
import sys
import time

GUARDED = {
    "import tensorflow as tf\n":
        "try:\n    import tensorflow as tf\nexcept ImportError:\n    tf = None\n",
    "from hyla.data.wiki import create_wikitext_datasets\n":
        "try:\n    from hyla.data.wiki import create_wikitext_datasets\nexcept ImportError:\n    pass\n",
}


def guarded_run_module(repo: pathlib.Path):
  source = (repo / "run.py").read_text()
  for old, new in GUARDED.items():
    if old not in source:
      raise SystemExit(f"{repo}/run.py no longer has {old.strip()!r}; update GUARDED in {__file__}")
    source = source.replace(old, new)
  (repo / "run_guarded.py").write_text(source)
  sys.path.insert(0, str(repo))
  import run_guarded  # noqa: PLC0415  (only importable once the copy exists)
  return run_guarded


def configured_run_module(repo: str, task: str, model: str, *flags: str):
  """The guarded run.py with its flags parsed: its config for `task` (a logic_* or raven_* name) and
  sequence mixer `model`, and any other of its flags."""
  run = guarded_run_module(pathlib.Path(repo))
  config_file = "logic.py" if task.startswith("logic") else "raven.py"
  run.FLAGS([f"{repo}/run.py", f"--config={repo}/configs/{config_file}:{task};{model}", *flags])
  return run


def parser_for(task: str, model: str) -> argparse.ArgumentParser:
  """The flags naming the paper's code and what it runs (--repo, --task, --model), these the defaults."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--repo", required=True, help="a checkout of smonsays/hypernetwork-attention")
  parser.add_argument("--task", default=task, help="its config's task: a logic_* or raven_* name")
  parser.add_argument("--model", default=model,
                      help="its sequence mixer: transformer, linear_transformer, linear_hypatt")
  return parser


def main():
  parser = parser_for("raven_3x3_4features", "transformer")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--warmup_steps", type=int, default=5, help="untimed steps (compilation)")
  args = parser.parse_args()
  run = configured_run_module(args.repo, args.task, args.model, "--logger=standard")
  import jax  # noqa: PLC0415  (after its flags are parsed, as in its run.py)

  config = run.FLAGS.config
  # Its schedule needs more steps than twice the warmup; only the first ones are taken.
  steps = max(args.warmup_steps + args.steps, 2 * config.warmup_steps + 1)
  config.data.num_train = config.batch_size * steps
  exp = run.setup(config, logger=[], callbacks=[])
  state = exp.reset(jax.random.PRNGKey(config.seed))
  batches = iter(exp.train_loader)
  for _ in range(args.warmup_steps):
    state, metrics = exp.train_step(state, next(batches))
  jax.block_until_ready(metrics)
  start, cpu = time.perf_counter(), time.process_time()
  for _ in range(args.steps):
    state, metrics = exp.train_step(state, next(batches))
  jax.block_until_ready(metrics)
  seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
  print(
      json.dumps({
          "code": "paper",
          "model": args.model,
          "steps": args.steps,
          "steps_per_s": args.steps / seconds,
          "cpu_s_per_step": cpu / args.steps,
          "loss": float(metrics["loss"]),
          "jax": jax.__version__
      }))


if __name__ == "__main__":
  main()
