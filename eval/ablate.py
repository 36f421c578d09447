"""The attention ablation grid on a compositional task: presets x seeds at one budget.

`lm-ablate --config=configs/sraven.py --workdir=DIR --presets=softmax,linear,hyla --seeds=0,1
[--config.train.instances=N ...]`

Trains (or resumes: finished runs are only re-evaluated) DIR/<preset>/seed<seed> with lm-train's
loop, runs the latent-code analysis of eval/latent.py on each, and writes DIR/results.md,
DIR/results.json and DIR/results.png: mean ± standard error over seeds of the final OOD accuracy
(SRAVEN) or R² (fuzzy logic), the in-distribution test metric, and the final layer's OOD
rule / term decoding accuracy.
"""

import json
import math

import matplotlib
import numpy as np
from absl import flags, logging
from etils import epath

from eval import latent
from lm import attention, cli, train

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)

# --config (a compositional task config with its --config.* overrides) and --workdir (the grid's
# directory, one subdirectory per run) are lm.train's flags, defined when it is imported.
_PRESETS = flags.DEFINE_list("presets", ["softmax", "linear", "hyla"], "Attention presets (lm.attention.PRESETS).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1"], "Seeds; each changes the initialisation and the data stream.")
_LATENT_EXAMPLES = flags.DEFINE_integer("latent_examples", 1024, "Instances per split for the latent probe.")

# Per task: (metric key, its name in the table) of the final evaluation.
HEADLINE = {"sraven": ("accuracy", "accuracy"), "fuzzy_logic": ("r2", "R²")}


def mean_stderr(values: list[float]) -> tuple[float, float]:
  """Mean and standard error of the mean (sample standard deviation / sqrt(n); 0 for one value)."""
  v = np.asarray(values, np.float64)
  return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0


def summarize(runs: list[dict], metric: str) -> dict[str, dict]:
  """runs: {preset, seed, test, ood, decoding} -> per preset mean and standard error of each."""
  table = {}
  for preset in dict.fromkeys(r["preset"] for r in runs):
    mine = [r for r in runs if r["preset"] == preset]
    table[preset] = {"seeds": [r["seed"] for r in mine]}
    for column in ("ood", "test", "decoding"):
      table[preset][column] = mean_stderr([r[column] for r in mine])
  return table


def markdown(table: dict[str, dict], task: str, metric_name: str, budget: str) -> str:
  lines = [f"{task}, {budget}; mean ± standard error over seeds", "",
           f"| attention | seeds | OOD {metric_name} | in-distribution test {metric_name} | "
           "final-layer OOD decoding accuracy |", "|---|---|---|---|---|"]
  for preset, row in table.items():
    cells = " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in (row["ood"], row["test"], row["decoding"]))
    lines.append(f"| {preset} | {', '.join(map(str, row['seeds']))} | {cells} |")
  return "\n".join(lines) + "\n"


def bar_plot(table: dict[str, dict], metric_name: str, title: str, path: epath.Path) -> None:
  names = list(table)
  fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(names), 3.5))
  ax.bar(names, [table[n]["ood"][0] for n in names], yerr=[table[n]["ood"][1] for n in names],
         capsize=4, color="tab:blue")
  ax.set(ylabel=f"OOD {metric_name}", title=title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def ablate(config, workdir: str, presets: list[str], seeds: list[int], latent_examples: int) -> dict:
  if config.task not in HEADLINE:
    raise SystemExit(f"lm-ablate: task {config.task!r} has no OOD metric; use configs/sraven.py or "
                     "configs/fuzzy_logic.py")
  unknown = [p for p in presets if p not in attention.PRESETS]
  if unknown:
    raise SystemExit(f"lm-ablate: unknown preset(s) {', '.join(unknown)}; choose from: "
                     f"{', '.join(attention.PRESETS)}")
  key, metric_name = HEADLINE[config.task]
  root, runs = epath.Path(workdir), []
  for seed in seeds:
    for preset in presets:
      c = config.copy_and_resolve_references()
      c.model.attention, c.seed = preset, seed
      run_dir = root / preset / f"seed{seed}"
      print(f"== {preset}, seed {seed}: {run_dir}", flush=True)
      final = train.train_and_evaluate(c, str(run_dir))
      probe = latent.analyse(str(run_dir), examples=latent_examples)
      runs.append({"preset": preset, "seed": seed, "ood": final["ood"][key], "test": final["test"][key],
                   "decoding": probe["ood_decoding_accuracy_per_layer"][-1], "final": final,
                   "latent": probe})
  table = summarize(runs, key)
  budget = (f"{config.train.steps} steps x batch {config.train.batch_size} "
            f"({config.train.steps * config.train.batch_size:,} instances)")
  (root / "results.md").write_text(markdown(table, config.task, metric_name, budget))
  (root / "results.json").write_text(json.dumps(
      {"task": config.task, "budget": budget, "table": table, "runs": runs}, indent=1))
  bar_plot(table, metric_name, f"{config.task}, {budget}", root / "results.png")
  return table


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  ablate(flags.FLAGS.config, flags.FLAGS.workdir, _PRESETS.value, [int(s) for s in _SEEDS.value],
         _LATENT_EXAMPLES.value)
  print((epath.Path(flags.FLAGS.workdir) / "results.md").read_text())


def run():
  flags.mark_flags_as_required(["config", "workdir"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
