"""One grid's learning curves set beside another's at a different budget, from their summary.json files.

  python benchmarks/budget_curves.py --summary=runs/fuzzy_full/summary.json:"6.4M sequences" \
    --summary=docs/results/compositional_fuzzy_640k_parametrisation.json@paper_code_parametrisation:"640k" \
    --plot=docs/results/fuzzy_logic_full_curves.png

Each `--summary` is PATH[@KEY][:LABEL]: a grid's summary.json (lm-grid writes it), KEY picking one
summary out of a JSON that holds several. The headline metric (the one the curves hold) is drawn
against instances seen on a log axis, mean ± one standard error over seeds, one colour per variant and
one line style per budget, so where the shorter budget stops on the longer one's curve shows.
"""

import json

import matplotlib
import numpy as np
from absl import app, flags

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)

from eval import grid_summary  # noqa: E402

FLAGS = flags.FLAGS
STYLES = ("-", "--", ":", "-.")


def read(spec: str) -> tuple[dict, str]:
  """A summary and its label from PATH[@KEY][:LABEL]."""
  path, _, label = spec.partition(":")
  path, _, key = path.partition("@")
  summary = json.loads(open(path).read())
  summary = summary[key] if key else summary
  if "curves" not in summary or not summary["curves"]:
    raise ValueError(
        f"{spec}: no learning curves (a summary.json written by lm-grid of a compositional task)")
  return summary, label or path


def plot(summaries: list[tuple[dict, str]], out: str) -> None:
  task = summaries[0][0]["task"]
  metric, split, _ = grid_summary.METRICS[task][0]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  colours = {}
  for (summary, label), style in zip(summaries, STYLES):
    for variant, c in summary["curves"].items():
      x, y, se = (np.asarray(c[k], dtype=float) for k in ("x", "mean", "stderr"))
      colour = colours.setdefault(variant, f"C{len(colours)}")
      ax.plot(x, y, style, color=colour, marker="o", markersize=2.5,
              label=f"{variant}, {label} ({c['seeds']} seed{'s' * (c['seeds'] > 1)})")
      if c["seeds"] > 1:
        ax.fill_between(x, y - se, y + se, color=colour, alpha=0.15, linewidth=0)
  ax.set(xscale="log", xlabel="training instances seen", ylabel=f"{metric} (mean ± 1 s.e. over seeds)",
         title=f"{task}: {metric} ({split} split) against instances seen")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out, dpi=110)


def main(argv):
  del argv
  plot([read(s) for s in FLAGS.summary], FLAGS.plot)
  print(f"wrote {FLAGS.plot}")


if __name__ == "__main__":
  flags.DEFINE_multi_string("summary", None, "PATH[@KEY][:LABEL] of a grid's summary.json; repeat.")
  flags.DEFINE_string("plot", None, "The PNG to write.")
  flags.mark_flags_as_required(["summary", "plot"])
  app.run(main)
