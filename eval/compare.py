"""Compares training runs: `lm-compare DIR [DIR ...] --out=FILE.png [--table=FILE.md]`.

Reads each workdir's metrics.jsonl (lm/metrics.py), prints a markdown table of the runs' final
validation metrics and throughput, and plots validation perplexity against training tokens.
"""

import json

import matplotlib
import numpy as np
from absl import app, flags
from etils import epath

from lm import cli

matplotlib.use("Agg")  # files only: no display on training hosts
import matplotlib.pyplot as plt  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "PNG to write the perplexity plot to.")
_TABLE = flags.DEFINE_string("table", None, "Also write the markdown table to this file.")

COLUMNS = ("run", "attention", "parameters", "tokens seen", "validation loss", "perplexity",
           "bits per byte", "training tokens/s")


def read_run(workdir: str, split: str = "validation") -> dict:
  """The run's label, its evaluations in step order and its mean training throughput. A step logged
  twice (a resume repeats the steps after the last checkpoint) counts once, with its later value."""
  path = epath.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    raise ValueError(f"{workdir} has no metrics.jsonl: it is not a training workdir (lm-train "
                     f"--workdir={workdir} creates one)")
  latest: dict[tuple[str, int], dict] = {}
  for line in path.read_text().splitlines():
    record = json.loads(line)
    latest[(record["kind"], record["step"])] = record
  by_kind = lambda kind: [latest[k] for k in sorted(latest, key=lambda k: k[1]) if k[0] == kind]
  evals = by_kind(f"eval/{split}")
  if not evals:
    raise ValueError(f"{workdir} has no {split} evaluation yet; train until the first eval "
                     f"(eval.every_steps) or run `lm-eval --workdir={workdir}`")
  runs = by_kind("run")
  rates = [r["tokens_per_sec"] for r in by_kind("train") if "tokens_per_sec" in r]
  return {"run": epath.Path(workdir).name, "attention": runs[-1]["attention"] if runs else "?",
          "num_params": runs[-1]["num_params"] if runs else None, "evals": evals,
          "tokens_per_sec": float(np.mean(rates)) if rates else None}


def table(runs: list[dict]) -> str:
  """Markdown: one row per run, its last evaluation."""
  fmt = lambda x, spec: "n/a" if x is None else format(x, spec)
  rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in runs:
    last = r["evals"][-1]
    cells = (r["run"], r["attention"], fmt(r["num_params"], ","), fmt(last["tokens_seen"], ","),
             fmt(last["loss"], ".4f"), fmt(last["perplexity"], ".2f"), fmt(last.get("bits_per_byte"), ".3f"),
             fmt(r["tokens_per_sec"], ",.0f"))
    rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows) + "\n"


def plot(runs: list[dict], out: str, split: str = "validation") -> None:
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for r in runs:
    ax.plot([e["tokens_seen"] for e in r["evals"]], [e["perplexity"] for e in r["evals"]],
            marker="o", label=f"{r['run']} ({r['attention']})")
  ax.set(xlabel="training tokens", ylabel=f"{split} perplexity", yscale="log")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)


def compare(workdirs: list[str], out: str, table_path: str | None = None,
            split: str = "validation") -> str:
  """Reads every run (all problems reported at once), writes the plot (and table); returns the table."""
  runs, problems = [], []
  for w in workdirs:
    try:
      runs.append(read_run(w, split))
    except ValueError as e:
      problems.append(str(e))
  if problems:
    raise ValueError("\n".join(problems))
  text = table(runs)
  plot(runs, out, split)
  if table_path:
    epath.Path(table_path).write_text(text)
  return text


def main(argv):
  if len(argv) < 2:
    raise app.UsageError("give one or more training workdirs: lm-compare DIR [DIR ...] --out=FILE.png")
  try:
    print(compare(argv[1:], _OUT.value, _TABLE.value), end="")
  except ValueError as e:
    raise SystemExit(f"lm-compare: {e}") from e
  print(f"plot: {_OUT.value}")


def run():
  flags.mark_flags_as_required(["out"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
