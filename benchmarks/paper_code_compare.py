"""The paper's own code against ours on fuzzy logic at one budget: a table (printed), a JSON and a
plot of held-out R² over seeds, from runs of benchmarks/paper_code_run.py and one of our grid summaries.

  python benchmarks/paper_code_compare.py --paper_runs=DIR --ours=docs/results/compositional_fuzzy_640k.json \
      --out=docs/results/compositional_fuzzy_640k_paper_code

DIR holds <model>_seed<seed>.log files, each paper_code_run.py's output. The two codes name the
held-out sets differently: its "test" is the held-out combinations of known terms (our "ood"), its
"ood" the combinations of unknown terms (our "unknown"). Each code draws a seed's held-out tasks with
its own generator, so the two codes are compared by their means over seeds, not seed by seed.
"""

import argparse
import json
import math
import pathlib

import matplotlib

from lm import stats

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)

# Its sequence mixers by our preset names.
MODELS = {"softmax": "transformer", "linear": "linear_transformer", "hyla": "linear_hypatt"}


def load_paper_runs(directory: pathlib.Path) -> dict[tuple[str, int], dict]:
  """Each finished run's last line, with its evaluations, keyed by (our preset, seed)."""
  runs = {}
  presets = {model: preset for preset, model in MODELS.items()}
  for log in sorted(directory.glob("*_seed*.log")):
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    if lines and lines[-1].get("code") == "paper":
      run = {**lines[-1], "evaluations": [line for line in lines if "step" in line and "code" not in line]}
      runs[(presets[run["model"]], run["seed"])] = run
  return runs


def _cell(values: list[float]) -> str:
  mean, se = stats.mean_stderr(values)
  return f"{mean:.3f}" + ("" if se is None else f" ± {se:.3f}")


def summarize(paper: dict[tuple[str, int], dict], ours: dict) -> dict:
  points = {(p["preset"], p["seed"]): p["results"] for p in ours["points"]}
  rows, pairs = [], []
  for preset in MODELS:
    seeds = sorted(s for (p, s) in paper if p == preset and (preset, s) in points)
    if not seeds:
      continue
    theirs = [paper[(preset, s)]["final"]["test_r2"] for s in seeds]
    mine = [points[(preset, s)]["ood"]["r2"] for s in seeds]
    (a, sa), (b, sb) = stats.mean_stderr(theirs), stats.mean_stderr(mine)
    rows.append({
        "preset": preset,
        "seeds": seeds,
        "paper_code_r2": theirs,
        "ours_r2": mine,
        "paper_code_unknown_terms_r2": [paper[(preset, s)]["final"]["ood_r2"] for s in seeds],
        "paper_code_seconds": [paper[(preset, s)]["train_and_eval_seconds"] for s in seeds],
        "paper_minus_ours": [a - b, math.hypot(sa, sb) if sa is not None and sb is not None else None],
    })
  for a, b in (("softmax", "linear"), ("softmax", "hyla"), ("hyla", "linear")):
    for code, key in (("paper_code", "test_r2"), ("ours", None)):
      seeds = sorted(
          s for (p, s) in paper if p == a and (b, s) in paper and (a, s) in points and (b, s) in points)
      if not seeds:
        continue
      if code == "paper_code":
        diffs = [paper[(a, s)]["final"][key] - paper[(b, s)]["final"][key] for s in seeds]
      else:
        diffs = [points[(a, s)]["ood"]["r2"] - points[(b, s)]["ood"]["r2"] for s in seeds]
      pairs.append({
          "a": a,
          "b": b,
          "code": code,
          "seeds": seeds,
          "per_seed": diffs,
          "mean_stderr": list(stats.mean_stderr(diffs))
      })
  return {"rows": rows, "paired": pairs}


def markdown(summary: dict) -> str:
  lines = [
      "| attention | paper's code: held-out R², per seed | mean ± s.e. | ours: OOD R², per seed | mean ± s.e. | "
      "paper's code − ours | paper's code: unknown-terms R², per seed | paper's code: train + eval s |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for r in summary["rows"]:
    per = lambda xs, f="{:.3f}": " / ".join(f.format(x) for x in xs)
    diff, se = r["paper_minus_ours"]
    lines.append(
        f"| {r['preset']} | {per(r['paper_code_r2'])} | {_cell(r['paper_code_r2'])} | {per(r['ours_r2'])} | "
        f"{_cell(r['ours_r2'])} | {diff:+.3f}" + ("" if se is None else f" ± {se:.3f}") +
        f" | {per(r['paper_code_unknown_terms_r2'])} | {per(r['paper_code_seconds'], '{:.0f}')} |")
  lines += ["", "| A − B | code | per seed | mean ± s.e. |", "|---|---|---|---|"]
  for p in summary["paired"]:
    mean, se = p["mean_stderr"]
    lines.append(f"| {p['a']} − {p['b']} | {p['code'].replace('_', ' ')} | "
                 f"{' / '.join(f'{x:+.3f}' for x in p['per_seed'])} | {mean:+.3f}" +
                 ("" if se is None else f" ± {se:.3f}") + " |")
  return "\n".join(lines)


def plot(paper: dict[tuple[str, int], dict], ours: dict, path: pathlib.Path):
  fig, axes = plt.subplots(1, len(MODELS), figsize=(12, 3.6), sharey=True)
  for ax, preset in zip(axes, MODELS):
    seeds = sorted(s for (p, s) in paper if p == preset)
    if seeds:
      evals = [paper[(preset, s)]["evaluations"] for s in seeds]
      # Its first evaluation follows the first step (R² far below 0); the plot starts at its second.
      steps = [e["step"] for e in evals[0]][1:]
      moments = [stats.mean_stderr([run[i]["test_r2"] for run in evals]) for i in range(1, len(steps) + 1)]
      x = [s * 128 for s in steps]
      mean = [m for m, _ in moments]
      se = [s or 0.0 for _, s in moments]
      ax.plot(x, mean, "o-", label=f"paper's code, {len(seeds)} seeds")
      ax.fill_between(x, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)], alpha=0.25)
    curve = ours["curves"].get(preset)
    if curve:
      ax.plot(curve["x"], curve["mean"], "o-", label=f"ours, {curve['seeds']} seeds")
      ax.fill_between(curve["x"], [m - s for m, s in zip(curve["mean"], curve["stderr"])],
                      [m + s for m, s in zip(curve["mean"], curve["stderr"])], alpha=0.25)
    ax.set_title(preset)
    ax.set_xlabel("training sequences")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[0].set_ylabel("held-out R² (mean ± 1 s.e. over seeds)")
  axes[0].set_ylim(-0.1, 1.0)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--paper_runs", required=True, help="directory of paper_code_run.py outputs")
  parser.add_argument("--ours", required=True, help="our grid's summary.json at the same budget")
  parser.add_argument("--out", required=True, help="path prefix: writes .json and .png")
  args = parser.parse_args()
  paper = load_paper_runs(pathlib.Path(args.paper_runs))
  ours = json.loads(pathlib.Path(args.ours).read_text())
  summary = summarize(paper, ours)
  out = pathlib.Path(args.out)
  table = markdown(summary)
  out.with_suffix(".json").write_text(
      json.dumps({
          **summary, "paper_runs": [paper[k] for k in sorted(paper)]
      }, indent=1) + "\n")
  plot(paper, ours, out.with_suffix(".png"))
  print(table)


if __name__ == "__main__":
  main()
