"""The grid's summary: per variant the best config value, mean ± standard error over seeds, paired
differences between variants, a sensitivity plot and the curves of the best points.

Hyperparameters are chosen on an in-distribution held-out loss (validation loss; the compositional
tasks' test-split loss), never on the OOD metric they are compared by.
"""

import json

import matplotlib
import scipy.stats
from etils import epath

from data_pipelines import storage
from eval import compare
from eval.harness import paired as harness_paired
from lm import attention, stats

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)

# Per task: the columns reported, as (label, evaluation set, key); the first one is the headline.
METRICS = {
    "lm": [("validation loss", "validation", "loss"), ("perplexity", "validation", "perplexity"),
           ("bits per byte", "validation", "bits_per_byte")],
    "sraven": [("OOD accuracy", "ood", "accuracy"), ("test accuracy", "test", "accuracy"),
               ("final-layer OOD rule decoding", "latent", "decoding"), ("test loss", "test", "loss")],
    "fuzzy_logic": [("OOD R²", "ood", "r2"), ("test R²", "test", "r2"), ("unknown-terms R²", "unknown", "r2"),
                    ("final-layer OOD term decoding", "latent", "decoding"),
                    ("term-bit R² (paper code's protocol)", "latent", "paper_code.term_bits_r2"),
                    ("test MSE", "test", "mse")],
    "mqar": [("query accuracy", "test", "accuracy"), ("test loss", "test", "loss")],
}
# What the best config value minimises.
SELECT = {
    "lm": ("validation", "loss"),
    "sraven": ("test", "loss"),
    "fuzzy_logic": ("test", "mse"),
    "mqar": ("test", "loss")
}


def load_points(root: epath.Path) -> list[dict]:
  """Every finished point in root at the step its workdir's config trains to."""
  points = []
  for path in sorted(root.glob("*/point.json")):
    point = json.loads(path.read_text())
    steps = json.loads((path.parent / "config.json").read_text())["train"]["steps"]
    if point["step"] == steps:
      points.append(point)
  return points


def kept_points(paths: list[str], task: str, config_file: str, axes: list[str],
                names: set[str]) -> list[dict]:
  """The finished points of kept summary.json files (other grids of the same config, e.g. seeds run
  on another machine whose workdirs are gone), to be counted beside a root's own. names: the root's
  points; a point may come from one place only."""
  points = []
  for path in paths:
    kept = json.loads(epath.Path(path).read_text())
    # The config file by name: a path spelled from another directory is the same config.
    for field, mine, same in (("task", task, kept["task"] == task),
                              ("config_file", config_file,
                               epath.Path(kept["config_file"]).name == epath.Path(config_file).name),
                              ("axes", axes, kept["axes"] == axes)):
      if not same:
        raise ValueError(f"kept summary {path} has {field} {kept[field]!r} where this grid has {mine!r}; "
                         f"keep only summaries of the same config and axes")
    for p in kept["points"]:
      if p["name"] in names:
        raise ValueError(f"point {p['name']} is both in {path} and elsewhere (this root or another kept "
                         f"summary); keep each point once")
      names.add(p["name"])
      points.append(p)
  return points


def _value(point: dict, where: str, key: str) -> float:
  """A result of one evaluation set; a dotted key reaches into a nested record (the latent probe's)."""
  value = point["results"][where]
  for part in key.split("."):
    value = value[part]
  return value


def _digits(label: str) -> int:
  return 2 if "perplexity" in label else 4


def _cell(mean: float, se: float | None, label: str) -> str:
  return f"{mean:.{_digits(label)}f}" + ("" if se is None else f" ± {se:.{_digits(label)}f}")


def _per_seed(row: dict, label: str) -> str:
  return " / ".join(f"{v:.{_digits(label)}f}" for v in row["per_seed"][label])


# Joins the layers' presets of a hybrid variant in --presets, point names and the summary
# ("hyla+softmax": model.attention="hyla,softmax"): --presets is itself a comma-separated list.
HYBRID = "+"


def layer_presets(variant: str) -> list[str]:
  """The presets a grid variant names: one, or a hybrid's pattern of layers."""
  return variant.split(HYBRID)


def _order(preset: str, values: dict[str, str]) -> tuple:
  """Presets in lm.attention's order (hybrids after their first layer's preset, by their layers), then
  values by number where they are numbers."""
  number = lambda v: (0, float(v), "") if _is_number(v) else (1, 0.0, v)
  return ([list(attention.PRESETS).index(p) for p in layer_presets(preset)],
          [number(v) for v in values.values()])


def _is_number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def group(points: list[dict], task: str) -> list[dict]:
  """One row per (preset, config values): the seeds and mean ± s.e. of every metric."""
  rows = {}
  for p in points:
    rows.setdefault((p["preset"], json.dumps(p["values"])), []).append(p)
  out = []
  for (preset, values), mine in rows.items():
    mine.sort(key=lambda p: p["seed"])
    row = {
        "preset": preset,
        "values": json.loads(values),
        "seeds": [p["seed"] for p in mine],
        "points": [p["name"] for p in mine],
        "select": stats.mean_stderr([_value(p, *SELECT[task]) for p in mine]),
        "per_seed": {}
    }
    for label, where, key in METRICS[task]:
      row["per_seed"][label] = [_value(p, where, key) for p in mine]
      row[label] = stats.mean_stderr(row["per_seed"][label])
    out.append(row)
  return sorted(out, key=lambda r: _order(r["preset"], r["values"]))


def best(rows: list[dict], tune: list[str] | None = None) -> dict[str, dict]:
  """Per preset, its row with the lowest mean selection loss over the tuned axes (None: every axis).
  The other axes are compared, not tuned: each of their values has its own best row, labelled
  "preset (field=value, ...)" and holding those values as "fixed"."""
  chosen, tried = {}, {}
  for row in rows:
    fixed = {k: v for k, v in row["values"].items() if tune is not None and k not in tune}
    label = row["preset"] + (" (" + ", ".join(f"{k}={v}" for k, v in fixed.items()) + ")" if fixed else "")
    tried.setdefault(label, []).append(row["values"])
    if label not in chosen or row["select"][0] < chosen[label]["select"][0]:
      chosen[label] = dict(row, fixed=fixed)
  for label, r in chosen.items():
    r["at_edge"] = _at_edge(r, tried[label])
  return chosen


def _at_edge(chosen: dict, tried: list[dict[str, str]]) -> dict[str, str]:
  """{axis: "largest" or "smallest"} for each numeric tuned axis whose chosen value ends the range
  tried (the values of the rows under the chosen one's label): the range does not bracket the best,
  which may lie beyond it."""
  out = {}
  for axis, value in chosen["values"].items():
    values = [v[axis] for v in tried]
    if axis in chosen["fixed"] or not all(map(_is_number, values)):
      continue
    numbers = [float(v) for v in values]
    if len(set(numbers)) > 1 and float(value) in (min(numbers), max(numbers)):
      out[axis] = "largest" if float(value) == max(numbers) else "smallest"
  return out


def paired(chosen: dict[str, dict], points: list[dict], task: str) -> list[dict]:
  """For every pair of presets at their best values (and the same compared values): per seed both
  ran, the difference of each metric (same seed, so the same initialisation stream and data order);
  mean ± s.e. over seeds."""
  by_name = {p["name"]: p for p in points}
  out, presets = [], list(chosen)
  for i, a in enumerate(presets):
    for b in presets[i + 1:]:
      if chosen[a]["fixed"] != chosen[b]["fixed"]:
        continue
      runs_a = {by_name[n]["seed"]: by_name[n] for n in chosen[a]["points"]}
      runs_b = {by_name[n]["seed"]: by_name[n] for n in chosen[b]["points"]}
      seeds = sorted(set(runs_a) & set(runs_b))
      if not seeds:
        continue
      row = {"a": a, "b": b, "seeds": seeds, "per_seed": {}}
      for label, where, key in METRICS[task]:
        row["per_seed"][label] = [
            _value(runs_a[s], where, key) - _value(runs_b[s], where, key) for s in seeds
        ]
        row[label] = stats.mean_stderr(row["per_seed"][label])
      out.append(row)
  return out


def _resolved(mean: float, se: float | None, seeds: int) -> str:
  """Whether the 95% t-interval of a paired mean over `seeds` excludes 0: with the 2-5 seeds a grid
  affords, Student's t quantile (12.7 at 1 degree of freedom, 4.3 at 2, 3.2 at 3) not 2."""
  if se is None:
    return "one seed: no error bar"
  needed = scipy.stats.t.ppf(0.975, seeds - 1)
  ratio = abs(mean) / se if se > 0 else (float("inf") if mean else 0.0)  # identical seeds: se 0
  return f"{'yes' if ratio > needed else 'no'} ({ratio:.1f} s.e.; 95% needs {needed:.1f})"


def markdown(task: str, config_file: str, tune: list[str], rows: list[dict], chosen: dict, pairs: list[dict],
             plots: list[str]) -> str:
  labels = [m[0] for m in METRICS[task]]
  fmt_values = lambda v: ", ".join(f"{k}={x}" for k, x in v.items()) or "(config as given)"
  lines = [
      f"# Grid summary: {task}, {config_file}", "",
      "Mean ± standard error over seeds (a single seed has no error bar). The best value per "
      f"variant minimises the mean {' '.join(SELECT[task])}.", "", "## Every grid point", "",
      f"| attention | values | seeds | {labels[0]} | {labels[0]}, per seed | " + " | ".join(labels[1:]) +
      " |", "|---|---|---|" + "---|" * (len(labels) + 1)
  ]
  for r in rows:
    lines.append(
        f"| {r['preset']} | {fmt_values(r['values'])} | {', '.join(map(str, r['seeds']))} | " +
        " | ".join([_cell(*r[labels[0]], labels[0]), _per_seed(r, labels[0])] +
                   [_cell(*r[l], l) for l in labels[1:]]) + " |")
  lines += [
      "", f"## Each variant at its best {', '.join(tune) or 'config'}", "",
      "| attention | best | seeds | " + " | ".join(labels) + " |", "|---|---|---|" + "---|" * len(labels)
  ]
  for preset, r in chosen.items():
    lines.append(f"| {preset} | {fmt_values(r['values'])} | {', '.join(map(str, r['seeds']))} | " +
                 " | ".join(_cell(*r[l], l) for l in labels) + " |")
  edges = [
      f"{preset}: {axis}={r['values'][axis]} ({side})" for preset, r in chosen.items()
      for axis, side in r["at_edge"].items()
  ]
  if edges:
    lines += ["", "At the end of the range tried, so the best may lie beyond it: " + "; ".join(edges) + "."]
  if pairs:
    lines += [
        "", "## Paired differences (A − B, same seeds, each at its best value)", "",
        f"| A − B | seeds | Δ {labels[0]} | Δ {labels[0]}, per seed | Δ {labels[0]} resolved (95% t-interval "
        "over seeds excludes 0) | " + " | ".join(f"Δ {l}" for l in labels[1:]) + " |",
        "|---|---|" + "---|" * (len(labels) + 2)
    ]
    for p in pairs:
      lines.append(f"| {p['a']} − {p['b']} | {', '.join(map(str, p['seeds']))} | " + " | ".join([
          _cell(*p[labels[0]], labels[0]),
          _per_seed(p, labels[0]),
          _resolved(*p[labels[0]], len(p['seeds']))
      ] + [_cell(*p[l], l) for l in labels[1:]]) + " |")
  lines += [""] + [f"![{name}]({name})" for name in plots]
  return "\n".join(lines) + "\n"


def sensitivity_plot(rows: list[dict], axis: str, task: str, path: epath.Path) -> bool:
  """The selection loss against a numeric axis, one line per preset (and other axes' values)."""
  try:
    xs = {r["values"][axis]: float(r["values"][axis]) for r in rows}
  except ValueError:
    return False
  lines = {}
  for r in rows:
    others = ", ".join(f"{k}={v}" for k, v in r["values"].items() if k != axis)
    lines.setdefault(r["preset"] + (f" ({others})" if others else ""), []).append(r)
  fig, ax = plt.subplots(figsize=(6, 4))
  for label, mine in lines.items():
    mine.sort(key=lambda r: xs[r["values"][axis]])
    se = [r["select"][1] or 0.0 for r in mine]
    ax.errorbar([xs[r["values"][axis]] for r in mine], [r["select"][0] for r in mine], yerr=se, marker="o",
                capsize=3, label=label)
  positive = min(xs.values()) > 0
  ax.set(xlabel=axis, ylabel=f"final {' '.join(SELECT[task])}",
         xscale="log" if positive and max(xs.values()) / min(xs.values()) >= 10 else "linear")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  compare.save_figure(fig, path)
  return True


def write(root: epath.Path, config_file: str, axes: list[str], kept: tuple[str, ...] = (),
          tune: list[str] | None = None) -> str:
  """Writes root/summary.md, summary.json and the plots from every finished point in root and in the
  kept summary.json files; the curves plot only the points whose workdirs are in root. tune: the axes
  each variant's best value is chosen over (None: all); the others are compared value by value."""
  tune = list(axes) if tune is None else list(tune)
  own = load_points(root)
  if not own:
    raise ValueError(f"{root} has no finished grid point to summarise")
  task = own[0]["task"]
  here = {p["name"] for p in own}
  points = own + kept_points(list(kept), task, config_file, axes, set(here))
  rows = group(points, task)
  chosen = best(rows, tune)
  pairs = paired(chosen, points, task)
  plots, curves = [], {}
  for axis in axes:
    name = f"sensitivity_{axis}.png"
    if sensitivity_plot(rows, axis, task, root / name):
      plots.append(name)
  if task == "lm":
    # Validation curves (tokens, FLOPs, wall clock) and loss by position of each variant's best runs.
    compare.compare([str(root / n) for r in chosen.values() for n in r["points"] if n in here],
                    str(root / "curves.png"))
    plots += ["curves.png"] + (["curves_positions.png"] if (root / "curves_positions.png").exists() else [])
  else:
    # The headline metric against instances seen and wall clock, every variant's best runs.
    _, split, key = METRICS[task][0]
    runs = [compare.read_run(str(root / n), split) for r in chosen.values() for n in r["points"] if n in here]
    compare.plot(runs, str(root / "curves.png"), split, key, compare.INSTANCE_AXES)
    plots.append("curves.png")
    curves = compare.curves(runs, key, compare.INSTANCE_AXES[0][1])
  text = markdown(task, config_file, tune, rows, chosen, pairs, plots)
  harness_text, harness = harness_paired.grid_section(root, chosen, points)
  text += harness_text
  if kept:
    text += (f"\nAlso counted: {len(points) - len(own)} points of {', '.join(kept)} (no workdirs here: "
             f"in the tables, not in the curves).\n")
  storage.write_text(root / "summary.md", text)
  storage.write_text(
      root / "summary.json",
      json.dumps(
          {
              "task": task,
              "config_file": config_file,
              "axes": axes,
              "tune": tune,
              "select": SELECT[task],
              "rows": rows,
              "best": chosen,
              "paired": pairs,
              "curves": curves,
              "kept": list(kept),
              "harness": harness,
              "points": points
          }, indent=1))
  return text
