"""The grid runner: attention presets x seeds x config values, one process and workdir per point.

`lm-grid --config=FILE --root=DIR [--presets=softmax,linear,hyla,hyla+softmax] [--seeds=0,1]
 [--grid=train.lr=1e-3,3e-3,1e-2 ... [--tune=train.lr] | --best_from=OTHER_ROOT] [--config.a.b=v ...]`

A hybrid variant joins its layers' presets with + (hyla+softmax trains model.attention="hyla,softmax"),
in --presets, point names and the summary alike.
Every point trains with lm-train into ROOT/<preset>_seed<seed>[_<field>=<value>...]; its results
(the trainer's final evaluation, and for the compositional tasks lm-latent's latent-code decoding)
go to ROOT/<point>/point.json, and the summary of every finished point is rewritten after each. Rerunning the
same command keeps finished points and resumes interrupted ones from their checkpoints. The summary
(eval/grid_summary.py) goes to ROOT/summary.md, summary.json and the plots beside them, and
ROOT/records.tar.gz holds every finished point without its checkpoints: unpacked under another
machine's runs folder, the same command keeps those points there too.
With --harness_tasks=wikitext,piqa,... (and --harness_data_dir, the `harness` extra) every finished point
is also scored by lm-harness and the summary adds each variant's harness metrics and per-item paired
differences between variants.
"""

import importlib.util
import io
import itertools
import json
import re
import signal
import subprocess
import sys
import tarfile
import time
import urllib.parse

import ml_collections
from absl import flags
from etils import epath
from ml_collections import config_flags

from data_pipelines import storage
from eval import compare, grid_summary
from eval.harness import paired as harness_paired
from lm import attention, checkpointing, model as model_lib
from lm.runtime import cli, metrics

FLAGS = flags.FLAGS
COMPOSITIONAL = ("sraven", "fuzzy_logic")
RECORDS = "records.tar.gz"
# What the runner and the summary read of a finished point: not its checkpoints, caches, ownership
# files or plots (the summary redraws them).
POINT_RECORDS = ("point.json", "config.json", "metrics", "latent.json", "harness")
AXES_OWNED = {"model.attention": "--presets", "seed": "--seeds"}


class GridError(ValueError):
  """Bad input found before any training."""


def normalize_overrides(argv: list[str], flag_values=FLAGS) -> list[str]:
  """The `--config.a.b` overrides of argv, each as one `--config.a.b=v` argument. The space form
  (`--config.a.b v`) takes the next argument as its value, as absl does, except for booleans."""
  out, args = [], iter(argv)
  for arg in args:
    name = arg.lstrip("-").split("=", 1)[0]
    if not (name.startswith("config.") or name.startswith("noconfig.")) or not arg.startswith("--"):
      continue
    if "=" in arg or name.startswith("no") or flag_values[name].boolean:
      out.append(arg)
    else:
      value = next(args, None)
      if value is None:
        raise GridError(f"{arg} has no value; write {arg}=VALUE")
      out.append(f"{arg}={value}")
  return out


def parse_config(config_file: str, overrides: list[str]) -> ml_collections.ConfigDict:
  """The config lm-train builds from the same arguments (the same parser, so the same result)."""
  if not epath.Path(config_file).is_file():
    raise GridError(f"no config file {config_file}; give --config=configs/NAME.py (or your own file)")
  argv = ["lm-train", f"--config={config_file}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  try:
    fv(argv)
  except (AttributeError, KeyError) as e:  # a field the config does not have
    hint = re.search(r'Did you mean "([^"]+)"', str(e))
    plain = parse_config(config_file, [])
    field = next((f for f in map(_field, overrides) if not _has(plain, f)), "?")
    raise GridError(f"{config_file} has no field {field}" + (f" (did you mean {hint[1]}?)" if hint else "") +
                    "; fix the --config or --grid field name") from e
  except (flags.Error, ValueError, TypeError) as e:
    raise GridError(f"{' '.join(str(e).split())}; fix the value or the field name") from e
  if not isinstance(fv.config, ml_collections.ConfigDict):
    raise GridError(f"{config_file} does not load: {fv.config}; its get_config() must return a ConfigDict")
  return fv.config


def _field(override: str) -> str:
  return override.lstrip("-").split("=", 1)[0].removeprefix("no").removeprefix("config.")


def _has(config, field: str) -> bool:
  for part in field.split("."):
    if not isinstance(config, ml_collections.ConfigDict) or part not in config:
      return False
    config = config[part]
  return True


def parse_axes(specs: list[str]) -> dict[str, list[str]]:
  """`field=v1,v2,...` flags -> {field: [values as given]}."""
  axes = {}
  for spec in specs:
    field, sep, values = spec.partition("=")
    field = field.removeprefix("config.")
    values = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not field or not values:
      raise GridError(f"--grid={spec} is not FIELD=V1,V2,...; e.g. --grid=train.lr=1e-3,3e-3,1e-2")
    if field in AXES_OWNED:
      raise GridError(f"--grid={spec}: give {field} values with {AXES_OWNED[field]}")
    if field in axes:
      raise GridError(f"--grid names {field} twice; give all its values in one --grid={field}=V1,V2")
    if len(set(values)) < len(values):
      raise GridError(f"--grid={spec} repeats a value")
    axes[field] = values
  return axes


def point_name(preset: str, seed: int, values: dict[str, str]) -> str:
  parts = [preset, f"seed{seed}"] + [f"{k}={urllib.parse.quote(v, safe='')}" for k, v in values.items()]
  return "_".join(parts)


def best_values(root: str, presets: list[str]) -> dict[str, dict[str, str]]:
  """The config values a finished grid's summary chose for each preset. root: the grid's root, or
  its summary.json itself (e.g. a copy kept beside a report after the runs are gone)."""
  path = epath.Path(root)
  path = path if path.is_file() else path / "summary.json"
  if not path.exists():
    raise GridError(f"--best_from={root} has no summary.json; run (or finish) that grid first, or "
                    f"give the path of its summary.json")
  summary = json.loads(path.read_text())
  if summary.get("tune", summary["axes"]) != summary["axes"]:
    raise GridError(f"--best_from={root} tuned only {', '.join(summary['tune'])} of its axes "
                    f"{', '.join(summary['axes'])}, so it chose no single value per preset; give the "
                    f"compared axes with --grid and the tuned one's value with --config")
  best = summary["best"]
  missing = [p for p in presets if p not in best]
  if missing:
    raise GridError(f"--best_from={root} chose no values for {', '.join(missing)} (it ran "
                    f"{', '.join(best)}); run those presets there first or drop them from --presets")
  return {p: best[p]["values"] for p in presets}


def plan(
    config_file: str,
    overrides: list[str],
    presets: list[str],
    seeds: list[str],
    axes: dict[str, list[str]],
    chosen: dict[str, dict[str, str]] | None = None,
) -> tuple[ml_collections.ConfigDict, list[dict]]:
  """The grid's base config and its points, each with its lm-train arguments and parsed config:
  the product of presets, seeds and the axes' values, or (`chosen`) each preset at its own values.
  Every problem of the input is found here, before anything trains."""
  unknown = [
      p for p in presets if any(layer not in attention.PRESETS for layer in grid_summary.layer_presets(p))
  ]
  if not presets or unknown:
    raise GridError(f"unknown attention preset {', '.join(map(repr, unknown)) or '(none given)'}; "
                    f"choose from: {', '.join(attention.PRESETS)}, or a hybrid of them per layer joined "
                    f"by {grid_summary.HYBRID} (hyla{grid_summary.HYBRID}softmax)")
  if len(set(presets)) < len(presets) or len(set(seeds)) < len(seeds):
    raise GridError("--presets and --seeds must not repeat a value")
  try:
    numbers = [int(s) for s in seeds]
  except ValueError as e:
    raise GridError(f"--seeds={','.join(seeds)}: seeds are integers, e.g. --seeds=0,1") from e
  for seed in numbers:  # 0 and 00 are one seed: they would train the same point twice
    if numbers.count(seed) > 1:
      spelt = " and ".join(s for s, n in zip(seeds, numbers) if n == seed)
      raise GridError(f"--seeds={','.join(seeds)} repeats seed {seed} (as {spelt}); give each seed once")
  seeds = numbers
  if not seeds:
    raise GridError("--seeds is empty; give at least one, e.g. --seeds=0")
  for o in overrides:
    field = _field(o)
    if field in AXES_OWNED or field in axes:
      flag = AXES_OWNED.get(field, f"--grid={field}=...")
      raise GridError(f"{o} fixes a field the grid varies; give its values with {flag} only")
  base = parse_config(config_file, overrides)
  if base.task not in grid_summary.METRICS:
    raise GridError(
        f"task {base.task!r} has no grid summary; lm-grid runs: {', '.join(grid_summary.METRICS)}")
  # Presets innermost: the first points finished already compare the variants at one seed.
  if chosen is None:
    order = [(dict(zip(axes, combo)), seed, preset)
             for combo in itertools.product(*axes.values())
             for seed in seeds
             for preset in presets]
  else:
    order = [(chosen[preset], seed, preset) for seed in seeds for preset in presets]
  points = []
  for values, seed, preset in order:
    args = [
        *overrides, f"--config.model.attention={','.join(grid_summary.layer_presets(preset))}",
        f"--config.seed={seed}", *(f"--config.{k}={v}" for k, v in values.items())
    ]
    points.append({
        "name": point_name(preset, seed, values),
        "preset": preset,
        "seed": seed,
        "values": values,
        "args": args,
        "config": parse_config(config_file, args)
    })
    try:
      model_lib.layer_presets(points[-1]["config"].model.attention, points[-1]["config"].model.L)
    except ValueError as e:
      raise GridError(f"--presets={preset}: {e}") from e
  return base, points


def _differences(saved: dict, current: dict) -> str:
  return "; ".join(
      f"{k}: {a!r} there, {b!r} here" for k, a, b in checkpointing.differences(saved, current)[:4])


def check_root(root: epath.Path, base: ml_collections.ConfigDict, axes: list[str],
               points: list[dict]) -> None:
  """ROOT holds this grid's runs only: its manifest names the same base config, and every existing
  point was trained with the config this grid gives it."""
  manifest = root / "grid.json"
  here = json.loads(base.to_json())
  if manifest.exists():
    saved = json.loads(manifest.read_text())
    if checkpointing.differences(saved["base_config"], here):
      raise GridError(f"{root} holds another grid's runs ({saved['config_file']}; "
                      f"{_differences(saved['base_config'], here)}); use a new --root, or the same "
                      f"config and overrides ({' '.join(saved['overrides']) or 'none'})")
    if saved["axes"] != axes:
      raise GridError(f"{root} holds a grid over {', '.join(saved['axes']) or 'presets and seeds only'}; "
                      f"give --grid for exactly those fields (any values), or use a new --root")
  elif root.exists() and not root.is_dir():
    raise GridError(f"--root={root} is a file; give a directory (it is created if missing)")
  elif root.exists() and any(root.iterdir()):
    raise GridError(f"{root} is not empty and has no grid.json: it is not a grid's root; use a new or "
                    f"empty --root")
  for p in points:
    saved = root / p["name"] / "config.json"
    mine = json.loads(p["config"].to_json())
    if saved.exists() and checkpointing.differences(json.loads(saved.read_text()), mine):
      raise GridError(f"{saved.parent} was trained with another config "
                      f"({_differences(json.loads(saved.read_text()), mine)}); move it away or use a "
                      f"new --root")


def write_manifest(root: epath.Path, config_file: str, overrides: list[str], axes: list[str],
                   base: ml_collections.ConfigDict) -> None:
  root.mkdir(parents=True, exist_ok=True)
  if not (root / "grid.json").exists():
    storage.write_text(
        root / "grid.json",
        json.dumps(
            {
                "config_file": config_file,
                "overrides": overrides,
                "axes": axes,
                "base_config": json.loads(base.to_json())
            }, indent=1))


class StopRequest:
  """A SIGTERM to the runner (a scheduler's stop), at any moment: it is passed on to the trainer running
  now, which saves its checkpoint, and the grid stops after the current point, with lm-train's exit
  status for it (0). The previous handler comes back with `restore()`."""

  def __init__(self):
    self.requested, self.child = False, None
    self.previous = signal.signal(signal.SIGTERM, self._request)

  def _request(self, signum, frame):
    del frame
    self.requested = True
    if self.child is not None and self.child.poll() is None:
      self.child.send_signal(signum)

  def restore(self) -> None:
    signal.signal(signal.SIGTERM, self.previous)


_stop: StopRequest | None = None  # while grid() runs


def _run(module_and_args: list[str], forward: bool = True) -> None:
  """Runs `python -m module args` with this Python, its output shown as it comes; `forward`: a SIGTERM
  to the runner reaches it (the trainer, which saves its checkpoint and exits)."""
  child = subprocess.Popen([sys.executable, "-m", *module_and_args])
  if _stop is not None and forward:
    _stop.child = child
    if _stop.requested:  # asked just before the child started
      child.send_signal(signal.SIGTERM)
  try:
    code = child.wait()
  finally:
    if _stop is not None:
      _stop.child = None
  if code:
    raise SystemExit(f"lm-grid: `{' '.join(module_and_args)}` failed (exit {code}); fix the cause "
                     f"and rerun the same command: finished points are kept, this one resumes")


def point_results(workdir: epath.Path, task: str, steps: int) -> dict:
  """The trainer's final evaluation (at `steps`) of every set the summary reports (and the latent
  decoding of the compositional tasks)."""
  sets = {}
  for where in dict.fromkeys(where for _, where, _ in grid_summary.METRICS[task]):
    if where == "latent":
      probe = json.loads((workdir / "latent.json").read_text())
      sets[where] = {"decoding": probe["ood_decoding_accuracy_per_layer"][-1], **probe}
      continue
    last = compare.read_run(str(workdir), where)["evals"][-1]
    if last["step"] != steps:
      raise ValueError(f"{workdir} has no final {where} evaluation at step {steps}; rerun "
                       f"the same command to resume it")
    sets[where] = last
  return sets


def run_point(p: dict, workdir: epath.Path, config_file: str, latent_args: list[str]) -> None:
  config = p["config"]
  _run(["lm.train", f"--config={config_file}", f"--workdir={workdir}", *p["args"]])
  checkpoints = checkpointing.Checkpointer(workdir, config.checkpoint)
  reached = checkpoints.latest_step()
  checkpoints.close()
  if reached != config.train.steps:
    raise SystemExit(f"lm-grid: {p['name']} stopped at step {reached} of {config.train.steps} (stopped "
                     f"or preempted); rerun the same command to resume it from there")
  if config.task in COMPOSITIONAL:
    _run(["eval.latent", f"--workdir={workdir}", *latent_args], forward=False)  # short: it finishes
  result = {k: p[k] for k in ("name", "preset", "seed", "values")}
  result.update(task=config.task, step=config.train.steps, train_seconds=compare.wall_seconds(str(workdir)),
                results=point_results(workdir, config.task, config.train.steps))
  storage.write_text(workdir / "point.json", json.dumps(result, indent=1) + "\n")


def write_records(root: epath.Path) -> None:
  """ROOT/records.tar.gz: the manifest, the summary and every finished point's records (POINT_RECORDS),
  under the root's name. Unpacked into another machine's runs folder, the same command keeps those
  points and summarises them with the rest."""
  files = [root / "grid.json", root / "summary.md", root / "summary.json"]
  for point in grid_summary.load_points(root):
    for name in POINT_RECORDS:
      path = root / point["name"] / name
      if path.is_dir():  # metrics/ and harness/ are flat (a recursive glob would list a bucket by RPCs)
        files += sorted(f for f in path.iterdir() if f.is_file())
      elif path.exists():
        files.append(path)
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
    for path in files:
      data = path.read_bytes()
      info = tarfile.TarInfo(f"{root.name}/{path.relative_to(root)}")
      info.size, info.mtime = len(data), int(time.time())
      tar.addfile(info, io.BytesIO(data))
  storage.write_bytes(root / RECORDS, buffer.getvalue())


def harness_point(workdir: epath.Path, steps: int, harness_args: list[str]) -> None:
  """lm-harness on a finished point (its final checkpoint), unless point.json has its results for the
  same arguments already; the headline metrics go into point.json, the items stay in its file."""
  path = workdir / "point.json"
  result = json.loads(path.read_text())
  if result.get("harness", {}).get("args") == harness_args:
    return
  _run(["eval.harness.cli", f"--workdir={workdir}", f"--step={steps}", *harness_args])
  file = harness_paired.result_file(steps)
  result["harness"] = {
      "args": harness_args,
      "file": file,
      "headline": harness_paired.headline(json.loads((workdir / file).read_text()))
  }
  storage.write_text(path, json.dumps(result, indent=1) + "\n")


def done(workdir: epath.Path, steps: int) -> dict | None:
  path = workdir / "point.json"
  if path.exists():
    result = json.loads(path.read_text())
    if result["step"] == steps:
      reported = {where for _, where, _ in grid_summary.METRICS[result["task"]]}
      if not reported <= set(result["results"]):  # a set the summary reports since this point finished
        result["results"] = point_results(workdir, result["task"], steps)
        storage.write_text(path, json.dumps(result, indent=1) + "\n")
      return result
  return None


def grid(config_file: str, overrides: list[str], presets: list[str], seeds: list[str],
         axes: dict[str, list[str]], root: str, latent_args: tuple[str,
                                                                   ...] = (), best_from: str | None = None,
         kept: tuple[str, ...] = (), harness_args: tuple[str,
                                                         ...] = (), tune: list[str] | None = None) -> str:
  """Trains every point not yet done, then writes the summary; returns its markdown. latent_args:
  lm-latent's flags for the compositional tasks; kept: other grids' summary.json files whose points
  the summary counts too; harness_args: lm-harness's flags (--tasks=...) to score every finished
  point with (none: no harness evaluation); tune: the axes each variant's best value is chosen over
  (None: all of them), the others compared value by value."""
  chosen = None
  if best_from:
    if axes:
      raise GridError("give either --grid (the values to try) or --best_from (the values another grid "
                      "chose), not both")
    chosen = best_values(best_from, presets)
    axes = {k: sorted({v[k] for v in chosen.values()}) for k in next(iter(chosen.values()))}
  if tune is not None and (unknown := [t for t in tune if t not in axes]):
    raise GridError(f"--tune={','.join(unknown)} is not a --grid axis (the axes: "
                    f"{', '.join(axes) or 'none'}); tune a field that --grid gives values")
  root = epath.Path(root)
  base, points = plan(config_file, overrides, presets, seeds, axes, chosen)
  if harness_args and base.task != "lm":
    raise GridError(f"--harness_tasks scores language models; task {base.task!r} has none to score")
  if harness_args and importlib.util.find_spec("lm_eval") is None:
    raise GridError("--harness_tasks needs lm-evaluation-harness: run the grid from a venv with the "
                    "harness extra (pip install -e '.[harness,test]')")
  check_root(root, base, list(axes), points)
  write_manifest(root, config_file, overrides, list(axes), base)
  global _stop
  _stop = StopRequest()
  try:
    return _grid_points(root, config_file, points, list(axes), latent_args, kept, harness_args, tune)
  finally:
    _stop.restore()
    _stop = None


def _stopped(name: str, saved: str) -> SystemExit:
  print(f"lm-grid: preempted (SIGTERM) after point {name} ({saved}); rerun the same command to go on",
        flush=True)
  return SystemExit(0)  # what lm-train exits with for a SIGTERM


def _grid_points(root: epath.Path, config_file: str, points: list[dict], axes: list[str],
                 latent_args: tuple[str, ...], kept: tuple[str, ...], harness_args: tuple[str, ...],
                 tune: list[str] | None) -> str:
  n, trained_seconds, trained = len(points), 0.0, 0

  def summarise() -> str:
    text = grid_summary.write(root, config_file, axes, kept, tune)
    write_records(root)
    return text

  for i, p in enumerate(points, 1):
    workdir = root / p["name"]
    finished = done(workdir, p["config"].train.steps)
    if finished is None:
      left = sum(done(root / q["name"], q["config"].train.steps) is None for q in points[i - 1:])
      eta = f"ETA {metrics.format_duration(trained_seconds / trained * left)}" if trained else "ETA after this point"
      print(f"grid: point {i} of {n}: {p['name']} ({left} to train, {eta})", flush=True)
      start = time.perf_counter()
      try:
        run_point(p, workdir, config_file, list(latent_args))
      except SystemExit:
        if _stop.requested:  # the trainer saved its checkpoint and exited: this point resumes
          raise _stopped(p["name"], "its checkpoint is saved") from None
        raise
      trained_seconds += time.perf_counter() - start
      trained += 1
      # After every point: a grid stopped or still running has the summary of what finished.
      summarise()
      if _stop.requested:  # asked during the point's last evaluation, or after it
        raise _stopped(p["name"], "it finished")
      if harness_args:  # after the stop check: a SIGTERM does not wait for the harness
        harness_point(workdir, p["config"].train.steps, list(harness_args))
        summarise()
    else:
      print(f"grid: point {i} of {n}: {p['name']} is done (step {finished['step']}); kept", flush=True)
      if harness_args:
        harness_point(workdir, finished["step"], list(harness_args))
  return summarise()


def main(argv):
  if len(argv) > 1:
    raise SystemExit(f"lm-grid: unexpected argument {argv[1]!r}; every option is a --flag")
  start = time.perf_counter()
  try:
    text = grid(config_flags.get_config_filename(FLAGS["config"]), normalize_overrides(sys.argv[1:]),
                FLAGS.presets, FLAGS.seeds, parse_axes(FLAGS.grid), FLAGS.root,
                [f"--examples={FLAGS.latent_examples}"] +
                ([f"--paper_examples={FLAGS.latent_paper_examples}"] if FLAGS.latent_paper_examples else []),
                FLAGS.best_from, tuple(FLAGS.kept), harness_flags(FLAGS), FLAGS.tune or None)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"lm-grid: {e}") from e
  print(text, end="")
  print(f"grid: {FLAGS.root}/summary.md, summary.json and plots written "
        f"({time.perf_counter() - start:.0f}s in this invocation)")


def harness_flags(flag_values) -> tuple[str, ...]:
  """lm-harness's arguments from the --harness_* flags; none without --harness_tasks."""
  if not flag_values.harness_tasks:
    return ()
  args = [f"--tasks={','.join(flag_values.harness_tasks)}"]
  for name in ("data_dir", "limit", "batch_size"):
    if flag_values[f"harness_{name}"].value is not None:
      args.append(f"--{name}={flag_values[f'harness_{name}'].value}")
  return tuple(args)


def run():
  flags.DEFINE_list(
      "harness_tasks", [], "lm-harness tasks to score every finished point on (the `harness` extra), "
      "e.g. wikitext,lambada_openai,piqa; the summary adds per-item paired differences.")
  flags.DEFINE_string("harness_data_dir", None, "lm-harness --data_dir: the tasks' local data.")
  flags.DEFINE_integer("harness_limit", None, "lm-harness --limit: items per task.")
  flags.DEFINE_integer("harness_batch_size", None, "lm-harness --batch_size.")
  config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).")
  flags.DEFINE_string("root", None, "Directory holding one workdir per grid point and the summary.")
  flags.DEFINE_list(
      "presets", ["softmax", "linear", "hyla"], "Attention presets (lm.attention.PRESETS); a hybrid "
      "names one per layer (or a repeated pattern) joined by +, e.g. hyla+hyla+hyla+softmax.")
  flags.DEFINE_list("seeds", ["0"], "Seeds; a seed fixes the initialisation and the data order.")
  flags.DEFINE_multi_string(
      "grid", [], "FIELD=V1,V2,...: an axis of config values, e.g. "
      "train.lr=1e-3,3e-3,1e-2; repeat the flag for more axes.")
  flags.DEFINE_list(
      "tune", [], "The --grid axes each variant's best value is chosen over (default: all of them); "
      "the other axes are compared value by value, e.g. --tune=train.lr with --grid=model.D=32,64.")
  flags.DEFINE_string(
      "best_from", None, "Root of a finished grid, or its summary.json: each preset runs at "
      "the config values that grid chose for it (its lowest mean loss), instead of --grid.")
  flags.DEFINE_list(
      "kept", [], "summary.json files of other grids of the same config (e.g. seeds run on another "
      "machine, their workdirs gone) whose finished points the summary counts beside this root's.")
  flags.DEFINE_integer(
      "latent_examples", 1024, "Instances per split for the latent-code probe "
      "(compositional tasks; lm-latent --examples).")
  flags.DEFINE_integer(
      "latent_paper_examples", 0, "Instances per set of the paper code's latent "
      "protocol (lm-latent --paper_examples); 0: lm-latent's default.")
  flags.mark_flags_as_required(["config", "root"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
