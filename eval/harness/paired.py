"""Harness results across runs: each task's headline metric, and paired differences between variants on
the same items (lm-grid's summary). Reads the JSON lm-harness writes; imports nothing of the harness.

An item's score is its metric value (accuracy 0/1; for perplexity-type metrics the item's
log-likelihood, the first of the pair the harness aggregates). A paired difference takes, for every
seed both variants ran and every item both scored, A's score minus B's: with 1-2k items the unpaired
standard error of an accuracy is 1-1.5 points, while the paired one removes what the items share.
"""

import json

import numpy as np
import scipy.stats
from etils import epath

from lm import stats

# Per task, the metric reported first (as GLA, DeltaNet and flash-linear-attention report them).
HEADLINE = {
    "wikitext": "word_perplexity",
    "lambada_openai": "acc",
    "piqa": "acc",
    "hellaswag": "acc_norm",
    "winogrande": "acc",
    "arc_easy": "acc",
    "arc_challenge": "acc_norm",
}


def headline(result: dict) -> dict[str, dict]:
  """Per task of an lm-harness result: its headline metric's name, value and standard error."""
  out = {}
  for task, metrics in result["results"].items():
    names = [k.split(",")[0] for k in metrics if "," in k and "_stderr" not in k]
    if not names:
      continue
    name = HEADLINE.get(task) if HEADLINE.get(task) in names else names[0]
    key = next(k for k in metrics if k.split(",")[0] == name)
    stderr = metrics.get(key.replace(",", "_stderr,", 1))
    out[task] = {
        "metric": name,
        "value": metrics[key],
        "stderr": stderr if isinstance(stderr, float) else None
    }
  return out


def item_scores(result: dict) -> dict[str, dict[str, dict[int, float]]]:
  """Per task and metric: doc_id → the item's score."""
  out = {}
  for task, items in result.get("items", {}).items():
    out[task] = {
        m: {
            d: float(v[0] if isinstance(v, list) else v) for d, v in zip(items["doc_id"], values)
        } for m, values in items.items() if m != "doc_id"
    }
  return out


def read(path: str | epath.Path) -> dict | None:
  path = epath.Path(path)
  return json.loads(path.read_text()) if path.exists() else None


def paired(runs_a: list[dict], runs_b: list[dict]) -> dict[str, dict[str, dict]]:
  """runs_a, runs_b: lm-harness results of two variants, one per seed, in the same seed order. Per
  task and metric: mean ± s.e. of A − B over every (seed, item) pair both scored, and the count."""
  out = {}
  for a, b in zip(runs_a, runs_b):
    scores_a, scores_b = item_scores(a), item_scores(b)
    for task in scores_a.keys() & scores_b.keys():
      for metric in scores_a[task].keys() & scores_b[task].keys():
        xa, xb = scores_a[task][metric], scores_b[task][metric]
        out.setdefault(task, {}).setdefault(metric,
                                            []).extend(xa[d] - xb[d] for d in sorted(xa.keys() & xb.keys()))
  return {
      t: {
          m: {
              "mean": stats.mean_stderr(d)[0],
              "stderr": stats.mean_stderr(d)[1],
              "items": len(d)
          } for m, d in ms.items() if d
      } for t, ms in out.items()
  }


def resolved(mean: float, se: float | None, count: int) -> str:
  """Whether the 95% t-interval of a paired mean over `count` differences excludes 0."""
  if not se:
    return "n/a"
  needed = scipy.stats.t.ppf(0.975, count - 1)
  return f"{'yes' if abs(mean) > needed * se else 'no'} ({abs(mean) / se:.1f} s.e.; 95% needs {needed:.1f})"


def markdown(variants: dict[str, list[dict]], pairs: list[tuple[str, str, dict]]) -> str:
  """The summary's harness section. variants: per variant its results (one per seed); pairs: (A, B,
  `paired`'s output)."""
  tasks = list(dict.fromkeys(t for runs in variants.values() for r in runs for t in headline(r)))
  lines = [
      "", "## Harness tasks (lm-harness)", "",
      "Mean over seeds of each task's headline metric (± the harness's standard error over items, "
      "averaged over seeds).", "",
      "| attention | seeds | " + " | ".join(f"{t} {HEADLINE.get(t, '')}".strip() for t in tasks) + " |",
      "|---|---|" + "---|" * len(tasks)
  ]
  for variant, runs in variants.items():
    cells = []
    for t in tasks:
      values = [headline(r)[t] for r in runs if t in headline(r)]
      if not values:
        cells.append("n/a")
        continue
      errs = [v["stderr"] for v in values if v["stderr"] is not None]
      cells.append(f"{np.mean([v['value'] for v in values]):.4f}" +
                   (f" ± {np.mean(errs):.4f}" if errs else ""))
    lines.append(f"| {variant} | {len(runs)} | " + " | ".join(cells) + " |")
  if pairs:
    lines += [
        "", "Paired differences on the same items (A − B over every seed both ran and every item both "
        "scored; accuracy in points of 1, perplexity-type metrics as the item's log-likelihood):", "",
        "| A − B | task | metric | Δ mean ± s.e. | items | resolved (95%) |", "|---|---|---|---|---|---|"
    ]
    for a, b, diff in pairs:
      for t in tasks:
        for metric, d in diff.get(t, {}).items():
          se = "" if d["stderr"] is None else f" ± {d['stderr']:.4f}"
          lines.append(f"| {a} − {b} | {t} | {metric} | {d['mean']:+.4f}{se} | {d['items']} | "
                       f"{resolved(d['mean'], d['stderr'], d['items'])} |")
  return "\n".join(lines) + "\n"


def result_file(step: int) -> str:
  """Where lm-harness writes a step's results, relative to the workdir."""
  return f"harness/step_{step}.json"


def grid_section(root: str | epath.Path, chosen: dict[str, dict], points: list[dict]) -> tuple[str, dict]:
  """lm-grid's harness section for each variant's best points (those whose workdirs are in root and
  have lm-harness results): markdown, and the same as data for summary.json. Empty when none has."""
  by_name = {p["name"]: p for p in points}
  variants = {}
  for variant, row in chosen.items():
    for name in row["points"]:
      point = by_name[name]
      result = read(epath.Path(root) / name / point["harness"]["file"]) if "harness" in point else None
      if result is not None:
        variants.setdefault(variant, {})[point["seed"]] = result
  if not variants:
    return "", {}
  pairs, names = [], list(variants)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      seeds = sorted(variants[a].keys() & variants[b].keys())
      if seeds:
        pairs.append((a, b, paired([variants[a][s] for s in seeds], [variants[b][s] for s in seeds])))
  text = markdown({v: [runs[s] for s in sorted(runs)] for v, runs in variants.items()}, pairs)
  data = {
      "headline": {
          v: {
              str(s): headline(r) for s, r in runs.items()
          } for v, runs in variants.items()
      },
      "paired": [{
          "a": a,
          "b": b,
          "tasks": d
      } for a, b, d in pairs],
  }
  return text, data
