"""lm-grid: overrides reach every run exactly, bad input stops before training, the summary's
statistics on hand-made points, the mean / standard-error helper, and end-to-end runs (LM and
fuzzy logic) that resume."""

import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import tiny
from eval import grid, grid_summary
from lm import stats
from lm.runtime import metrics, run_log

TINY = "configs/tiny.py"
HERE = os.path.dirname(__file__)

# --- lm/stats.py ---------------------------------------------------------------------------------


def test_moments_merge_matches_numpy_where_sums_of_squares_cancel():
  x = 1e8 + np.random.default_rng(0).normal(size=1000)  # mean far larger than the spread
  parts = [stats.Moments.of(p) for p in np.split(x, [7, 300, 301])]
  merged = stats.merge_all(parts)
  assert merged.count == 1000 and merged.mean == pytest.approx(x.mean(), rel=1e-12)
  assert merged.m2 / 999 == pytest.approx(x.var(ddof=1), rel=1e-6)
  assert merged.stderr == pytest.approx(x.std(ddof=1) / np.sqrt(1000), rel=1e-6)
  naive = stats.Moments.from_sums(x.sum(), (x**2).sum(), 1000.0)
  assert abs(naive.m2 / 999 / x.var(ddof=1) - 1) > 0.01, "this data should defeat Σx² - n·mean²"


def test_weighted_moments_on_device_equal_the_kept_values():
  x_bt = np.random.default_rng(1).normal(size=(3, 5)).astype(np.float32)
  w_bt = (np.arange(15).reshape(3, 5) % 3 > 0).astype(np.float32)
  on_device = jax.jit(lambda x, w: stats.Moments.of(x, w, xp=jnp))(x_bt, w_bt)
  kept = x_bt[w_bt > 0].astype(np.float64)
  assert float(on_device.count) == len(kept)
  assert float(on_device.mean) == pytest.approx(kept.mean(), rel=1e-5)
  assert float(on_device.m2) == pytest.approx(((kept - kept.mean())**2).sum(), rel=1e-4)


def test_mean_stderr_over_seeds():
  assert stats.mean_stderr([1.0, 3.0]) == pytest.approx((2.0, 1.0))
  assert stats.mean_stderr([5.0]) == (5.0, None)


# --- overrides and bad input ---------------------------------------------------------------------


def test_a_paired_difference_is_resolved_by_students_t_not_by_two_standard_errors():
  assert grid_summary._resolved(1.0, 0.2, 3).startswith("yes (5.0 s.e.; 95% needs 4.3)")
  assert grid_summary._resolved(1.0, 0.3, 3).startswith("no (3.3 s.e.; 95% needs 4.3)")  # > 2 s.e.
  assert grid_summary._resolved(1.0, None, 1) == "one seed: no error bar"
  assert grid_summary._resolved(0.0, 0.0, 3).startswith("no")  # every seed gave the same value


def test_space_and_equals_overrides_give_the_same_runs():
  argv = [
      "--config=" + TINY, "--config.model.D", "48", "--config.data.dir", "/some/dir",
      "--config.model.relative_bias_per_layer", "--config.train.lr=1e-2"
  ]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=["x", *argv])
  fv(["x", *argv])
  overrides = grid.normalize_overrides(argv, fv)
  assert overrides == [
      "--config.model.D=48", "--config.data.dir=/some/dir", "--config.model.relative_bias_per_layer",
      "--config.train.lr=1e-2"
  ]
  _, points = grid.plan(TINY, overrides, ["softmax", "linear"], ["0"], {})
  for p in points:
    c = p["config"]
    assert (c.model.attention, c.model.D, c.data.dir, c.model.relative_bias_per_layer,
            c.train.lr) == (p["preset"], 48, "/some/dir", True, 1e-2)
  assert points[1]["args"][-2:] == ["--config.model.attention=linear", "--config.seed=0"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(presets=["hyla2"]), "unknown attention preset 'hyla2'; choose from: softmax, linear, hyla"),
    (dict(presets=[]), "unknown attention preset (none given)"),
    (dict(seeds=["a"]), "seeds are integers"),
    (dict(seeds=["0", "00"]), "--seeds=0,00 repeats seed 0 (as 0 and 00); give each seed once"),
    (dict(axes={"train.lrr": ["1e-3"]}), "has no field train.lrr (did you mean lr?)"),
    (dict(overrides=["--config.model.DD=3"]), "has no field model.DD"),
    (dict(axes={"train.lr": ["fast"]}), "flag --config.train.lr=fast: could not convert string to float"),
    (dict(axes={"train.steps": ["1.5"]}), "--config.train.steps=1.5"),
    (dict(overrides=["--config.model.attention=hyla"]), "give its values with --presets only"),
    (dict(config_file="configs/nope.py"), "no config file configs/nope.py"),
])
def test_bad_input_stops_before_training(tmp_path, kwargs, message):
  args = dict(config_file=TINY, overrides=[], presets=["softmax"], seeds=["0"], axes={},
              root=str(tmp_path / "root"))
  with pytest.raises(grid.GridError) as e:
    grid.grid(**{**args, **kwargs})
  assert message in str(e.value)
  assert not (tmp_path / "root").exists(), "nothing may be created before the input is checked"


@pytest.mark.parametrize("spec, message", [("train.lr=", "is not FIELD=V1,V2,..."),
                                           ("train.lr", "is not FIELD=V1,V2,..."),
                                           ("seed=1,2", "give seed values with --seeds"),
                                           ("train.lr=1,1", "repeats a value")])
def test_bad_grid_flags(spec, message):
  with pytest.raises(grid.GridError) as e:
    grid.parse_axes([spec])
  assert message in str(e.value)


def test_a_root_of_another_grid_is_refused(tmp_path):
  base, _ = grid.plan(TINY, ["--config.model.D=64"], ["softmax"], ["0"], {"train.lr": ["1e-3"]})
  grid.write_manifest(tmp_path, TINY, ["--config.model.D=64"], ["train.lr"], base)
  args = dict(config_file=TINY, presets=["softmax"], seeds=["0"], root=str(tmp_path))
  with pytest.raises(grid.GridError) as e:
    grid.grid(overrides=[], axes={"train.lr": ["1e-3"]}, **args)
  assert "holds another grid's runs" in str(e.value) and "model.D: 64 there, 128 here" in str(e.value)
  with pytest.raises(grid.GridError) as e:
    grid.grid(overrides=["--config.model.D=64"], axes={"train.warmup_steps": ["5"]}, **args)
  assert "holds a grid over train.lr" in str(e.value)
  (tmp_path / "other").mkdir()
  (tmp_path / "grid.json").unlink()
  with pytest.raises(grid.GridError) as e:
    grid.grid(overrides=[], axes={}, **args)
  assert "has no grid.json: it is not a grid's root" in str(e.value)
  (tmp_path / "notes.txt").write_text("a file")
  with pytest.raises(grid.GridError, match=r"^--root=.*notes.txt is a file; give a directory"):
    grid.grid(overrides=[], axes={}, **{**args, "root": str(tmp_path / "notes.txt")})


@pytest.mark.parametrize("finished", [True, False])
def test_a_sigterm_stops_the_grid_after_the_current_point(tmp_path, monkeypatch, capsys, finished):
  """A SIGTERM during a point's final evaluation was lost (the trainer finished, and the grid trained
  the next point whole); one during training made lm-grid exit 1 where lm-train exits 0."""
  ran = []

  def point(p, workdir, config_file, latent_args):
    del workdir, config_file, latent_args
    ran.append(p["name"])
    os.kill(os.getpid(), signal.SIGTERM)  # the trainer gets it too, and saves
    time.sleep(0.1)
    if not finished:
      raise SystemExit(f"lm-grid: {p['name']} stopped at step 2 of 4 (stopped or preempted); rerun the same "
                       f"command to resume it from there")

  monkeypatch.setattr(grid, "run_point", point)
  monkeypatch.setattr(grid.grid_summary, "write", lambda *args: "")
  monkeypatch.setattr(grid, "write_records", lambda root: None)  # packs the summary, which is stubbed
  previous = signal.signal(signal.SIGTERM, lambda *args: None)  # without the grid's own: not the test's end
  try:
    with pytest.raises(SystemExit) as e:
      grid.grid(TINY, [], ["softmax", "linear"], ["0"], {}, str(tmp_path / "root"))
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert e.value.code == 0 and ran == ["softmax_seed0"]
  saved = "its checkpoint is saved" if not finished else "it finished"
  assert capsys.readouterr().out.splitlines()[-1] == (
      f"lm-grid: preempted (SIGTERM) after point softmax_seed0 ({saved}); rerun the same command to go on")


def test_hybrids_are_named_with_plus_in_the_grid(tmp_path):
  _, points = grid.plan(TINY, [], ["hyla+softmax", "softmax"], ["0"], {})
  assert [p["name"] for p in points] == ["hyla+softmax_seed0", "softmax_seed0"]
  assert points[0]["args"][0] == "--config.model.attention=hyla,softmax"
  assert points[0]["config"].model.attention == "hyla,softmax"
  with pytest.raises(grid.GridError, match="unknown attention preset 'hyla\\+nope'.* joined by \\+"):
    grid.plan(TINY, [], ["hyla+nope"], ["0"], {})
  with pytest.raises(grid.GridError, match="--presets=hyla\\+hyla\\+softmax: .* does not divide model.L=2"):
    grid.plan(TINY, [], ["hyla+hyla+softmax"], ["0"], {})
  # The summary's rows: a hybrid after the single presets of its first layer, labelled as in --presets.
  for preset, loss in (("hyla+softmax", 4.0), ("hyla", 4.5), ("softmax", 5.0)):
    fake_point(tmp_path, preset, 0, "1e-3", loss)
  rows = grid_summary.group(grid_summary.load_points(tmp_path), "lm")
  assert [r["preset"] for r in rows] == ["softmax", "hyla", "hyla+softmax"]


# --- the summary on hand-made points -------------------------------------------------------------


def fake_point(root, preset, seed, lr, loss, steps=10, values=None):
  """A finished point as lm-grid leaves it: config.json, the training log and point.json. values:
  the point's grid values (default: train.lr alone)."""
  values = values or {"train.lr": lr}
  name = grid.point_name(preset, seed, values)
  workdir = root / name
  c = tiny.get_config()
  c.model.attention, c.seed, c.train.lr, c.train.steps = preset.replace("+", ","), seed, float(lr), steps
  workdir.mkdir(parents=True)
  (workdir / "config.json").write_text(c.to_json())
  writer = metrics.Writer(str(workdir))
  writer.write(0, "run", {"attention": preset, "num_params": 1000, "tokens_per_step": 32 * 128})
  final = {
      "loss": loss,
      "perplexity": float(np.exp(loss)),
      "bits_per_byte": loss / 2,
      "tokens": 100,
      "tokens_seen": steps * 32 * 128,
      "loss_by_position": {
          "first_position": [0, 1, 2],
          "loss": [loss + 1, loss, loss - 1],
          "stderr": [0.1] * 3,
          "tokens": [10, 10, 20]
      }
  }
  writer.write(steps, "eval/validation", final)
  writer.close()
  (workdir / "point.json").write_text(
      json.dumps({
          "name": name,
          "preset": preset,
          "seed": seed,
          "values": values,
          "task": "lm",
          "step": steps,
          "train_seconds": 1.0,
          "results": {
              "validation": final
          }
      }))


def test_summary_picks_each_variants_lr_and_pairs_seeds(tmp_path):
  losses = {
      ("softmax", "1e-3"): [5.0, 5.2],
      ("softmax", "1e-2"): [4.0, 4.4],
      ("hyla", "1e-3"): [4.6, 4.7],
      ("hyla", "1e-2"): [4.9, 5.1]
  }
  for (preset, lr), per_seed in losses.items():
    for seed, loss in enumerate(per_seed):
      fake_point(tmp_path, preset, seed, lr, loss)
  text = grid_summary.write(tmp_path, TINY, ["train.lr"])
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert {
      p: r["values"]["train.lr"] for p, r in summary["best"].items()
  } == {
      "softmax": "1e-2",
      "hyla": "1e-3"
  }
  assert summary["best"]["softmax"]["validation loss"] == pytest.approx([4.2, 0.2])
  (pair,) = summary["paired"]
  # softmax − hyla per seed: 4.0 − 4.6 = −0.6 and 4.4 − 4.7 = −0.3: mean −0.45, s.e. 0.15.
  assert (pair["a"], pair["b"], pair["seeds"]) == ("softmax", "hyla", [0, 1])
  assert pair["validation loss"] == pytest.approx([-0.45, 0.15])
  # 3 standard errors of a two-seed mean: a 95% t-interval at one degree of freedom needs 12.7.
  assert pair["per_seed"]["validation loss"] == pytest.approx([-0.6, -0.3])
  assert "| softmax − hyla | 0, 1 | -0.4500 ± 0.1500 | -0.6000 / -0.3000 | no (3.0 s.e.; 95% needs 12.7) |" in text
  assert text.rstrip().endswith("curves_positions.png)")
  assert "| softmax | train.lr=1e-2 | 0, 1 | 4.2000 ± 0.2000 | 4.0000 / 4.4000 |" in text
  assert summary["best"]["softmax"]["per_seed"]["validation loss"] == [4.0, 4.4]
  assert summary["best"]["softmax"]["at_edge"] == {"train.lr": "largest"}
  assert "At the end of the range tried, so the best may lie beyond it: softmax: train.lr=1e-2 " \
         "(largest); hyla: train.lr=1e-3 (smallest)." in text
  for plot in ("sensitivity_train.lr.png", "curves.png", "curves_positions.png"):
    assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"


def test_tune_chooses_the_lr_per_width_and_pairs_within_a_width(tmp_path):
  # Each width has its own best lr; variants are compared at the same width only.
  losses = {
      ("softmax", "32", "1e-3"): 5.0,
      ("softmax", "32", "1e-2"): 4.0,
      ("softmax", "64", "1e-3"): 3.0,
      ("softmax", "64", "1e-2"): 3.5,
      ("hyla", "32", "1e-3"): 4.5,
      ("hyla", "64", "1e-3"): 3.2,
      ("hyla", "64", "3e-3"): 3.1,
      ("hyla", "64", "1e-2"): 3.4
  }
  for (preset, width, lr), loss in losses.items():
    fake_point(tmp_path, preset, 0, lr, loss, values={"model.D": width, "train.lr": lr})
  text = grid_summary.write(tmp_path, TINY, ["model.D", "train.lr"], tune=["train.lr"])
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert {
      k: r["values"]["train.lr"] for k, r in summary["best"].items()
  } == {
      "softmax (model.D=32)": "1e-2",
      "softmax (model.D=64)": "1e-3",
      "hyla (model.D=32)": "1e-3",
      "hyla (model.D=64)": "3e-3"
  }
  assert summary["tune"] == ["train.lr"] and "## Each variant at its best train.lr" in text
  # Only the tuned axis counts, per width: hyla tried one lr at 32 (no range) and has an inner best at 64.
  assert {
      k: r["at_edge"] for k, r in summary["best"].items()
  } == {
      "softmax (model.D=32)": {
          "train.lr": "largest"
      },
      "softmax (model.D=64)": {
          "train.lr": "smallest"
      },
      "hyla (model.D=32)": {},
      "hyla (model.D=64)": {}
  }
  assert sorted(
      (p["a"], p["b"]) for p in summary["paired"]) == [("softmax (model.D=32)", "hyla (model.D=32)"),
                                                       ("softmax (model.D=64)", "hyla (model.D=64)")]
  with pytest.raises(grid.GridError, match="tuned only train.lr"):
    grid.best_values(str(tmp_path), ["softmax"])
  with pytest.raises(grid.GridError, match="--tune=model.F is not a --grid axis"):
    grid.grid(TINY, [], ["softmax"], ["0"], {"train.lr": ["1e-3"]}, str(tmp_path / "g"), tune=["model.F"])


def test_best_from_takes_a_root_or_its_summary_file(tmp_path):
  for lr, loss in (("1e-3", 5.0), ("1e-2", 4.0)):
    fake_point(tmp_path, "softmax", 0, lr, loss)
  grid_summary.write(tmp_path, TINY, ["train.lr"])
  kept = tmp_path / "kept_summary.json"  # a report's copy, after the runs are gone
  kept.write_text((tmp_path / "summary.json").read_text())
  for source in (tmp_path, kept):
    assert grid.best_values(str(source), ["softmax"]) == {"softmax": {"train.lr": "1e-2"}}
  with pytest.raises(grid.GridError, match="no summary.json"):
    grid.best_values(str(tmp_path / "nowhere"), ["softmax"])


def test_kept_summaries_count_in_the_tables_but_not_the_curves(tmp_path):
  # Seed 0 ran on one machine, whose grid left only its summary.json; seed 1 runs here.
  elsewhere, here = tmp_path / "elsewhere", tmp_path / "here"
  for preset, loss in (("softmax", 4.0), ("hyla", 4.6)):
    fake_point(elsewhere, preset, 0, "1e-3", loss)
  grid_summary.write(elsewhere, TINY, ["train.lr"])
  kept = tmp_path / "kept_summary.json"
  kept.write_text((elsewhere / "summary.json").read_text())
  for preset, loss in (("softmax", 4.4), ("hyla", 4.7)):
    fake_point(here, preset, 1, "1e-3", loss)
  text = grid_summary.write(here, "/abs/" + TINY, ["train.lr"], (str(kept),))
  summary = json.loads((here / "summary.json").read_text())
  assert summary["best"]["softmax"]["seeds"] == [0, 1]
  assert summary["best"]["softmax"]["validation loss"] == pytest.approx([4.2, 0.2])
  (pair,) = summary["paired"]  # softmax − hyla: −0.6 (kept seed 0), −0.3 (seed 1 here)
  assert pair["seeds"] == [0, 1] and pair["validation loss"] == pytest.approx([-0.45, 0.15])
  assert summary["kept"] == [str(kept)] and "Also counted: 2 points of" in text
  # The curves read workdirs: only this root's seed-1 runs exist, and the plot was made from them.
  assert (here / "curves.png").read_bytes()[:4] == b"\x89PNG"
  with pytest.raises(
      ValueError,
      match=r"point hyla_seed1_train.lr=1e-3 is both in .*here/summary.json.*keep each point once"):
    grid_summary.write(elsewhere.parent / "here", TINY, ["train.lr"], (str(kept), str(here / "summary.json")))
  with pytest.raises(ValueError, match="axes"):
    grid_summary.write(here, TINY, [], (str(kept),))


def test_records_hold_finished_points_without_checkpoints(tmp_path):
  """A grid's results outlive its machine: records.tar.gz carries what the summary and the runner
  read, not checkpoints, caches, ownership files or unfinished points."""
  root = tmp_path / "grid"
  for preset, loss in (("softmax", 4.0), ("hyla", 4.6)):
    fake_point(root, preset, 0, "1e-3", loss)
  for junk in ("checkpoints/10/state", "compilation_cache/entry", "owner.json"):
    (root / "softmax_seed0_train.lr=1e-3" / junk).parent.mkdir(parents=True, exist_ok=True)
    (root / "softmax_seed0_train.lr=1e-3" / junk).write_text("x")
  unfinished = root / "linear_seed0_train.lr=1e-3"
  (unfinished / "metrics").mkdir(parents=True)
  (unfinished / "config.json").write_text("{}")
  (root / "grid.json").write_text("{}")
  grid_summary.write(root, TINY, ["train.lr"])
  grid.write_records(root)
  with tarfile.open(root / grid.RECORDS) as tar:
    names = set(tar.getnames())
    tar.extractall(tmp_path / "elsewhere", filter="data")
  point_files = {
      f"{n}_seed0_train.lr=1e-3/{f}" for n in ("softmax", "hyla") for f in ("point.json", "config.json")
  }
  assert point_files <= {n.removeprefix("grid/") for n in names}
  assert {"grid/grid.json", "grid/summary.json", "grid/summary.md"} <= names
  assert not [n for n in names if "checkpoints" in n or "cache" in n or "owner" in n or "linear" in n]
  # What was packed is what the summary reads: the same tables from the unpacked copy.
  assert grid_summary.write(tmp_path / "elsewhere" / "grid", TINY,
                            ["train.lr"]) == (root / "summary.md").read_text()


# --- end to end, in processes ---------------------------------------------------------------------

SMALL = """
from small import small_config


def get_config():
  c = small_config({corpus!r})
  c.train.update(steps=4, log_every_steps=2)
  c.eval.every_steps = 2
  c.checkpoint.every_steps = 2
  return c
"""


def run(cmd, **kw):
  env = {**os.environ, "PYTHONPATH": HERE}  # configs written here import tests/small.py
  return subprocess.run([sys.executable, "-m", "eval.grid", *cmd], capture_output=True, text=True, env=env,
                        timeout=600, **kw)


@pytest.mark.slow
def test_lm_grid_space_overrides_resume_and_summary(small_corpus, tmp_path):
  """Issue 19 item 3: with `--config.model.D 48` the 'linear' run trained softmax. Old flag names
  """
  config = tmp_path / "config.py"
  config.write_text(SMALL.format(corpus=str(small_corpus)))
  root = tmp_path / "grid"
  cmd = [
      f"--config={config}", "--presets=softmax,linear", f"--root={root}", "--config.model.D", "48",
      "--config.train.warmup_steps", "3"
  ]
  first = run(cmd)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "grid: point 2 of 2: linear_seed0" in first.stdout
  configs = {n: json.loads((root / f"{n}_seed0" / "config.json").read_text()) for n in ("softmax", "linear")}
  for name, c in configs.items():
    assert (c["model"]["attention"], c["model"]["D"], c["train"]["warmup_steps"]) == (name, 48, 3)
    assert json.loads(
        (root / f"{name}_seed0" / "point.json").read_text())["results"]["validation"]["step"] == 4
  assert [c["model"].pop("attention") for c in configs.values()] == ["softmax", "linear"]
  assert configs["softmax"] == configs["linear"], "only the attention differs: same seed, same data order"
  summary = (root / "summary.md").read_text()
  assert "| softmax − linear | 0 |" in summary and (root / "curves.png").exists()
  # Rerun: the finished point is kept; the one whose results are gone resumes from its checkpoint.
  log = run_log.read(root / "softmax_seed0")
  (root / "linear_seed0" / "point.json").unlink()
  again = run(cmd)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "point 1 of 2: softmax_seed0 is done (step 4); kept" in again.stdout
  assert "resumed from the checkpoint at step 4" in again.stdout
  assert run_log.read(root / "softmax_seed0") == log
  assert (root / "linear_seed0" / "point.json").exists()


@pytest.mark.slow
def test_fuzzy_logic_grid_reports_ood_r2_and_latent_decoding(tmp_path):
  cmd = [
      "--config=configs/fuzzy_logic.py", f"--root={tmp_path}", "--presets=hyla", "--seeds=0",
      "--latent_examples=32", "--latent_paper_examples=64", "--config.eval.final_batches=1",
      "--config.model.D=16", "--config.model.qkv_dim=8", "--config.model.H=4", "--config.model.F=32",
      "--config.model.attention_dropout=0.0", "--config.train.instances=240", "--config.train.batch_size",
      "8", "--config.train.warmup_steps=3", "--config.eval.batch_size=16", "--config.eval.batches=1",
      "--config.eval.every_steps=10", "--config.checkpoint.every_steps=1000"
  ]
  result = run(cmd)
  assert result.returncode == 0, result.stderr[-3000:]
  point = json.loads((tmp_path / "hyla_seed0" / "point.json").read_text())
  assert point["step"] == 30  # train.steps follows instances // batch_size from the command line
  assert set(point["results"]) == {"ood", "test", "unknown", "latent"}
  assert point["results"]["latent"]["paper_code"]["examples"] == 64  # lm-latent ran with our flags
  r2, test_r2, unknown_r2 = (point["results"][where]["r2"] for where in ("ood", "test", "unknown"))
  row = f"| hyla | (config as given) | 0 | {r2:.4f} | {r2:.4f} | {test_r2:.4f} | {unknown_r2:.4f} |"  # one seed
  assert row in (tmp_path / "summary.md").read_text()
  # A point finished before the summary reported a set: the same command fills it in from the
  # point's logs, without training again.
  del point["results"]["unknown"]
  (tmp_path / "hyla_seed0" / "point.json").write_text(json.dumps(point))
  result = run(cmd)
  assert result.returncode == 0 and "hyla_seed0 is done (step 30); kept" in result.stdout, result.stderr[
      -3000:]
  refreshed = json.loads((tmp_path / "hyla_seed0" / "point.json").read_text())
  assert refreshed["results"]["unknown"]["r2"] == unknown_r2
  assert row in (tmp_path / "summary.md").read_text()
  # Learning curve: OOD R² at every evaluation against instances seen (steps x batch 8); the last
  # point is the final evaluation.
  curve = json.loads((tmp_path / "summary.json").read_text())["curves"]["hyla"]
  assert curve["x"] == [80, 160, 240] and curve["mean"][-1] == pytest.approx(r2) and curve["seeds"] == 1
  assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
  # On another machine: the records unpacked under a new runs folder are kept, not trained again,
  # and give the same summary and curves.
  elsewhere = tmp_path.parent / f"{tmp_path.name}_elsewhere"
  with tarfile.open(tmp_path / grid.RECORDS) as tar:
    tar.extractall(elsewhere, filter="data")
  moved = [a.replace(f"--root={tmp_path}", f"--root={elsewhere / tmp_path.name}") for a in cmd]
  result = run(moved)
  assert result.returncode == 0 and "hyla_seed0 is done (step 30); kept" in result.stdout, result.stderr[
      -3000:]
  assert not (elsewhere / tmp_path.name / "hyla_seed0" / "checkpoints").exists()
  assert json.loads((elsewhere / tmp_path.name / "summary.json").read_text())["curves"]["hyla"] == curve
