"""A whole training run of the paper's own code (smonsays/hypernetwork-attention), for comparing its
final metrics with ours at the same budget.

Runs in the paper code's own venv, never in ours; imports nothing of this repository except
paper_code_steps.py beside it (the guarded copy of its run.py):

  python benchmarks/paper_code_run.py --repo=DIR --task=logic_4var_2term --model=linear_hypatt \
      --seed=0 --set=data.num_train=640000 --set=data.seq_len=32 --set=data.frac_test=0.7

`--set=FIELD=VALUE` sets a field of its config (in the field's type), as its own
`--config.FIELD=VALUE` would. The loop is its Experiment.run unchanged (its learning-rate schedule
follows data.num_train), with its evaluations every --eval_every steps and at the end, on its test
and OOD sets; its latent-code callbacks are not run. Prints one JSON line per evaluation, then a
last line with the final one.
"""

import json
import time

import paper_code_steps


class _Collect:
  """Its logger interface: gathers each evaluation's sets (logged one set per call) by step."""

  def __init__(self):
    self.evals = {}

  def log(self, step, metrics):
    if any(k.startswith(("test_", "ood_")) for k in metrics):
      self.evals.setdefault(int(step), {"step": int(step)}).update({k: float(v) for k, v in metrics.items()})


def main():
  parser = paper_code_steps.parser_for("logic_4var_2term", "linear_hypatt")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--set", action="append", default=[], help="FIELD=VALUE of its config")
  parser.add_argument("--eval_every", type=int, default=500)
  args = parser.parse_args()
  run = paper_code_steps.configured_run_module(args.repo, args.task, args.model,
                                               f"--eval_every={args.eval_every}",
                                               f"--log_every={args.eval_every}")
  import jax  # noqa: PLC0415  (after its flags are parsed, as in its run.py)

  config = run.FLAGS.config
  config.seed = args.seed
  for field_value in args.set:
    field, value = field_value.split("=", 1)
    *parents, name = field.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    node[name] = type(node[name])(value)  # the field's own type, as its flag parser would
  logger = _Collect()
  exp = run.setup(config, logger=[logger], callbacks=[])
  start = time.perf_counter()
  exp.run(exp.reset(jax.random.PRNGKey(config.seed)))
  for record in logger.evals.values():
    print(json.dumps(record))
  print(
      json.dumps({
          "code": "paper",
          "task": args.task,
          "model": args.model,
          "seed": args.seed,
          "overrides": args.set,
          "steps": config.data.num_train // config.batch_size,
          "train_and_eval_seconds": time.perf_counter() - start,
          "final": logger.evals[max(logger.evals)],
          "jax": jax.__version__
      }))


if __name__ == "__main__":
  main()
