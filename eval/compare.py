"""Compares training runs: `lm-compare DIR [DIR ...] --out=FILE.png [--table=FILE.md]`.

Reads each workdir's training log (lm/runtime/run_log.py) and config.json, prints a markdown table of the
runs' final validation metrics and throughput, and plots validation perplexity against training
tokens, training FLOPs (each run's own FLOPs per token, lm/flops.py) and wall-clock seconds. Runs
whose configs differ only in the seed are one curve: the mean with a band of ± one standard error.
When the evaluations hold the loss by position in the context (lm-evaluate, lm-train's final
evaluation), FILE_positions.png shows the last evaluation's loss per bucket of positions. Runs scored
by lm-harness get a column per task: its headline metric at the latest step scored.
"""

import json

import matplotlib
import numpy as np
from absl import app, flags
from etils import epath

from data_pipelines import storage
from eval.harness import paired as harness_paired
from lm import checkpointing, flops, stats
from lm.model import ModelConfig
from lm.runtime import cli, run_log

matplotlib.use("Agg")  # files only: no display on training hosts
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "PNG to write the perplexity plot to.")
_TABLE = flags.DEFINE_string("table", None, "Also write the markdown table to this file.")

COLUMNS = ("run", "attention", "parameters", "tokens seen", "training FLOPs", "wall-clock", "validation loss",
           "perplexity", "bits per byte", "training tokens/s")


def _records(workdir: str) -> list[dict]:
  """The training log in the order written, each record with `wall_seconds`: time spent in the run
  up to it, over all of its (re)starts; the gaps between an interruption and the next start do not
  count."""
  records, done, start, last = [], 0.0, None, None
  for record in run_log.read(workdir):
    if record["kind"] == "run" or start is None:
      done += 0.0 if start is None else last - start
      start = record["time"]
    last = record["time"]
    records.append({**record, "wall_seconds": done + last - start})
  return records


def wall_seconds(workdir: str) -> float:
  """Seconds the run has spent training and evaluating, over all of its (re)starts."""
  records = _records(workdir)
  return records[-1]["wall_seconds"] if records else 0.0


def read_run(workdir: str, split: str = "validation") -> dict:
  """The run's label, config, FLOPs per token, its evaluations in step order and its mean training
  throughput. A step logged twice (a resume repeats the steps after the last checkpoint) counts
  once, with its later value."""
  latest: dict[tuple[str, int], dict] = {}
  for record in _records(workdir):
    latest[(record["kind"], record["step"])] = record
  by_kind = lambda kind: [latest[k] for k in sorted(latest, key=lambda k: k[1]) if k[0] == kind]
  evals = by_kind(f"eval/{split}")
  if not evals:
    raise ValueError(f"{workdir} has no {split} evaluation yet; train until the first eval "
                     f"(eval.every_steps) or run `lm-evaluate --workdir={workdir}`")
  runs = by_kind("run")
  rates = [r["tokens_per_sec"] for r in by_kind("train") if "tokens_per_sec" in r]
  config_path = epath.Path(workdir) / "config.json"
  config = json.loads(config_path.read_text()) if config_path.exists() else None
  flops_per_token = None
  if config and runs:
    seq_len = runs[-1]["tokens_per_step"] // config["train"]["batch_size"]
    flops_per_token = flops.flops_per_token(ModelConfig.from_dict(config["model"]), runs[-1]["num_params"],
                                            seq_len)
  return {
      "run": epath.Path(workdir).name,
      "attention": runs[-1]["attention"] if runs else "?",
      "num_params": runs[-1]["num_params"] if runs else None,
      "evals": evals,
      "config": config,
      "flops_per_token": flops_per_token,
      "tokens_per_sec": float(np.mean(rates)) if rates else None,
      "harness": harness(workdir)
  }


def harness(workdir: str) -> dict[str, dict]:
  """The headline metric of each task lm-harness scored at the run's latest scored step ({} if none)."""
  files = sorted(epath.Path(workdir).glob("harness/step_*.json"), key=lambda p: int(p.stem.split("_")[1]))
  return harness_paired.headline(json.loads(files[-1].read_text())) if files else {}


def table(runs: list[dict]) -> str:
  """Markdown: one row per run, its last evaluation."""
  fmt = lambda x, spec: "n/a" if x is None else format(x, spec)
  tasks = {t: h["metric"] for r in runs for t, h in r.get("harness", {}).items()}
  columns = COLUMNS + tuple(f"{t} {m}" for t, m in tasks.items())
  rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in runs:
    last = r["evals"][-1]
    train_flops = r["flops_per_token"] and r["flops_per_token"] * last["tokens_seen"]
    cells = (r["run"], r["attention"], fmt(r["num_params"], ","), fmt(last["tokens_seen"], ","),
             fmt(train_flops, ".3g"), fmt(last["wall_seconds"], ",.0f") + " s", fmt(last["loss"], ".4f"),
             fmt(last["perplexity"], ".2f"), fmt(last.get("bits_per_byte"),
                                                 ".3f"), fmt(r["tokens_per_sec"], ",.0f"))
    cells += tuple(fmt(r.get("harness", {}).get(t, {}).get("value"), ".4f") for t in tasks)
    rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows) + "\n"


def seed_groups(runs: list[dict]) -> dict[str, list[dict]]:
  """Runs whose configs differ in the seed only, under a label naming what sets them apart."""
  keys = []
  for r in runs:
    config = dict(r["config"] or {"run": r["run"]})
    config.pop("seed", None)
    keys.append(json.dumps(config, sort_keys=True))
  distinct = [json.loads(k) for k, r in dict(zip(keys, runs)).items() if r["config"]]
  varying = sorted({k for a in distinct for b in distinct for k, _, _ in checkpointing.differences(a, b)} -
                   {"model.attention", "run"})
  groups = {}
  for r, key in zip(runs, keys):
    config = json.loads(key)
    shown = [f"{k}={_get(config, k)}" for k in varying]
    label = ", ".join([r["attention"]] + shown) if r["config"] else f"{r['run']} ({r['attention']})"
    groups.setdefault(label, []).append(r)
  return groups


def _get(config: dict, dotted: str):
  for part in dotted.split("."):
    config = config.get(part, {}) if isinstance(config, dict) else None
  return config


def _band(runs: list[dict], x_of, y_of) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """x, mean y and its standard error at the steps every run evaluated (x averaged over runs)."""
  steps = sorted(set.intersection(*({e["step"] for e in r["evals"]} for r in runs)))
  xs, ys, ses = [], [], []
  for step in steps:
    points = [(x_of(r, e), y_of(e)) for r in runs for e in r["evals"] if e["step"] == step]
    mean, se = stats.mean_stderr([p[1] for p in points])
    xs.append(np.mean([p[0] for p in points]))
    ys.append(mean)
    ses.append(se or 0.0)
  return np.asarray(xs), np.asarray(ys), np.asarray(ses)


AXES = (("training tokens", lambda r, e: e["tokens_seen"]), ("training FLOPs", lambda r, e: e["tokens_seen"] *
                                                             (r["flops_per_token"] or np.nan)),
        ("wall-clock seconds", lambda r, e: e["wall_seconds"]))
# The compositional tasks count instances (sequences), not tokens.
INSTANCE_AXES = (("training instances", lambda r, e: e["step"] * r["config"]["train"]["batch_size"]),
                 ("wall-clock seconds", lambda r, e: e["wall_seconds"]))


def curves(runs: list[dict], key: str, x_of=AXES[0][1]) -> dict[str, dict[str, list[float]]]:
  """Per group of seeds: x, the mean of evaluation metric `key` and its standard error over seeds."""
  out = {}
  for label, mine in seed_groups(runs).items():
    x, y, se = _band(mine, x_of, lambda e: e[key])
    out[label] = {"x": x.tolist(), "mean": y.tolist(), "stderr": se.tolist(), "seeds": len(mine)}
  return out


def plot(runs: list[dict], out: str, split: str = "validation", key: str = "perplexity", axes=AXES) -> None:
  """`key` of the `split` evaluations against each of `axes`, one line (± one s.e. band) per group."""
  fig, panels = plt.subplots(1, len(axes), figsize=(5 * len(axes), 4.2), sharey=True, squeeze=False)
  several = False
  for ax, (xlabel, x_of) in zip(panels[0], axes):
    for label, c in curves(runs, key, x_of).items():
      several |= c["seeds"] > 1
      x, y, se = (np.asarray(c[k]) for k in ("x", "mean", "stderr"))
      seeds = f", {c['seeds']} seeds" if c["seeds"] > 1 else ""
      line, = ax.plot(x, y, marker="o", markersize=3, label=label + seeds)
      if c["seeds"] > 1:
        ax.fill_between(x, y - se, y + se, color=line.get_color(), alpha=0.25, linewidth=0)
    ax.set(xlabel=xlabel, yscale="log" if key == "perplexity" else "linear")
    ax.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))  # 200k, not 200000 run into its neighbours
    ax.grid(True, which="both", alpha=0.3)
  panels[0][0].set_ylabel(f"{split} {key}" + (" (mean ± 1 s.e. over seeds)" if several else ""))
  panels[0][0].legend(fontsize=8)
  save_figure(fig, out)


def save_figure(fig, out: str | epath.Path) -> None:
  """Writes fig whole to out (local or gs://) in the format its suffix names, and closes it."""
  fig.tight_layout()
  with storage.written_whole(out) as local:  # out may be gs://, which matplotlib cannot write
    fig.savefig(local, dpi=120, format=epath.Path(out).suffix.lstrip(".") or "png")
  plt.close(fig)


def positions_path(out: str) -> epath.Path:
  path = epath.Path(out)
  return path.with_name(f"{path.stem}_positions{path.suffix}")


def plot_positions(runs: list[dict], out: str) -> bool:
  """Loss by bucket of positions in the context at each run's last evaluation; False if the
  evaluations do not hold it."""
  if not all("loss_by_position" in r["evals"][-1] for r in runs):
    return False
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for label, mine in seed_groups(runs).items():
    by_position = [r["evals"][-1]["loss_by_position"] for r in mine]
    first = by_position[0]["first_position"]
    cells = [stats.mean_stderr([b["loss"][i] for b in by_position]) for i in range(len(first))]
    y = np.asarray([m for m, _ in cells])
    line, = ax.plot(range(len(first)), y, marker="o", label=label)
    if len(mine) > 1:
      se = np.asarray([s for _, s in cells])
      ax.fill_between(range(len(first)), y - se, y + se, color=line.get_color(), alpha=0.25, linewidth=0)
  ticks = [f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in zip(first, first[1:] + [2 * first[-1]])]
  ax.set_xticks(range(len(first)), ticks, rotation=30)
  ax.set(xlabel="position of the input token in its document window", ylabel="validation loss (nats)")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  save_figure(fig, positions_path(out))
  return True


def compare(workdirs: list[str], out: str, table_path: str | None = None, split: str = "validation") -> str:
  """Reads every run (all problems reported at once), writes the plots (and table); returns the table."""
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
  plot_positions(runs, out)
  if table_path:
    storage.write_text(table_path, text)
  return text


def main(argv):
  if len(argv) < 2:
    raise app.UsageError("give one or more training workdirs: lm-compare DIR [DIR ...] --out=FILE.png")
  try:
    print(compare(argv[1:], _OUT.value, _TABLE.value), end="")
  except ValueError as e:
    raise SystemExit(f"lm-compare: {e}") from e
  except OSError as e:  # --out or --table where nothing can be written
    raise SystemExit(f"lm-compare: {storage.write_refused(e) or e}") from e
  print(f"plot: {_OUT.value}" +
        (f" and {positions_path(_OUT.value)}" if positions_path(_OUT.value).exists() else ""))


def run():
  flags.mark_flags_as_required(["out"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
