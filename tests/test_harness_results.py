"""lm-harness's results across runs, without the harness installed: per-item paired differences,
lm-compare's harness columns, lm-grid's harness section and its scoring of finished points."""

import json

import numpy as np
import pytest
from test_eval import write_run

from configs import tiny
from eval import compare, grid, grid_summary
from eval.harness import paired


def harness_result(accs: list[float], step: int = 10) -> dict:
  """An lm-harness result of one task (piqa) with these item accuracies."""
  return {
      "step": step,
      "results": {
          "piqa": {
              "acc,none": float(np.mean(accs)),
              "acc_stderr,none": 0.1
          }
      },
      "items": {
          "piqa": {
              "doc_id": list(range(len(accs))),
              "acc": accs
          }
      }
  }


def test_paired_differences_match_by_item():
  a = [harness_result([1.0, 1.0, 0.0, 1.0]), harness_result([1.0, 0.0, 0.0, 1.0])]
  b = [harness_result([0.0, 1.0, 0.0, 1.0]), harness_result([0.0, 0.0, 0.0, 0.0])]
  b[0]["items"]["piqa"]["doc_id"] = [3, 2, 1, 0]  # items are matched by document, not by position
  b[0]["items"]["piqa"]["acc"] = [1.0, 0.0, 1.0, 0.0]
  diff = paired.paired(a, b)["piqa"]["acc"]
  d = [1, 0, 0, 0, 1, 0, 0, 1]
  assert diff["items"] == 8 and diff["mean"] == pytest.approx(np.mean(d))
  assert diff["stderr"] == pytest.approx(np.std(d, ddof=1) / np.sqrt(8))
  assert paired.headline(a[0]) == {"piqa": {"metric": "acc", "value": 0.75, "stderr": 0.1}}
  text = paired.markdown({"hyla": a, "softmax": b}, [("hyla", "softmax", paired.paired(a, b))])
  assert "| hyla − softmax | piqa | acc | +0.3750 ± 0.1830 | 8 | no (2.0 s.e.; 95% needs 2.4) |" in text


def test_compare_shows_harness_columns_when_present(tmp_path):
  write_run(tmp_path / "a", "softmax", {10: 40.0})
  write_run(tmp_path / "b", "hyla", {10: 50.0})
  (tmp_path / "a" / "harness").mkdir()
  for step, accs in ((5, [0.0, 0.0]), (10, [1.0, 0.0])):  # the latest step scored counts
    (tmp_path / "a" / "harness" / f"step_{step}.json").write_text(json.dumps(harness_result(accs, step)))
  rows = compare.compare([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "c.png")).splitlines()
  assert rows[0].endswith("| training tokens/s | piqa acc |")
  assert rows[2].endswith("| 0.5000 |") and rows[3].endswith("| n/a |")
  plain = compare.compare([str(tmp_path / "b")], str(tmp_path / "d.png")).splitlines()
  assert plain[0].endswith("| training tokens/s |")


def grid_point(root, preset: str, seed: int, accs: list[float]) -> None:
  """A finished lm grid point with an lm-harness result."""
  workdir = root / f"{preset}_seed{seed}"
  write_run(workdir, preset, {10: 40.0 + seed})
  c = tiny.get_config()
  c.model.attention, c.seed, c.train.steps = preset, seed, 10
  (workdir / "config.json").write_text(c.to_json())
  (workdir / "harness").mkdir()
  (workdir / "harness" / "step_10.json").write_text(json.dumps(harness_result(accs)))
  last = {"loss": float(np.log(40.0 + seed)), "perplexity": 40.0 + seed, "bits_per_byte": 0.5}
  (workdir / "point.json").write_text(
      json.dumps({
          "name": workdir.name,
          "preset": preset,
          "seed": seed,
          "values": {},
          "task": "lm",
          "step": 10,
          "results": {
              "validation": last
          },
          "harness": {
              "args": ["--tasks=piqa"],
              "file": paired.result_file(10)
          }
      }))


def test_grid_summary_reports_paired_harness_differences(tmp_path):
  grid_point(tmp_path, "softmax", 0, [1.0, 1.0, 0.0, 1.0])
  grid_point(tmp_path, "softmax", 1, [1.0, 0.0, 0.0, 1.0])
  grid_point(tmp_path, "hyla", 0, [0.0, 1.0, 0.0, 1.0])
  grid_point(tmp_path, "hyla", 1, [0.0, 0.0, 0.0, 0.0])
  text = grid_summary.write(tmp_path, "configs/tiny.py", [])
  assert "## Harness tasks (lm-harness)" in text
  assert "| softmax | 2 | 0.6250 ± 0.1000 |" in text and "| hyla | 2 | 0.2500 ± 0.1000 |" in text
  assert "| softmax − hyla | piqa | acc | +0.3750 ± 0.1830 | 8 |" in text
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["harness"]["paired"][0]["tasks"]["piqa"]["acc"]["items"] == 8


def test_grid_scores_a_finished_point_once_per_arguments(tmp_path, monkeypatch):
  grid_point(tmp_path, "softmax", 0, [1.0, 0.0])
  workdir = tmp_path / "softmax_seed0"
  calls = []
  monkeypatch.setattr(grid, "_run", calls.append)
  grid.harness_point(workdir, 10, ["--tasks=piqa"])  # point.json has these arguments' results
  assert calls == []
  grid.harness_point(workdir, 10, ["--tasks=piqa", "--limit=2"])
  assert calls == [["eval.harness.cli", f"--workdir={workdir}", "--step=10", "--tasks=piqa", "--limit=2"]]
  saved = json.loads((workdir / "point.json").read_text())["harness"]
  assert saved["args"] == ["--tasks=piqa", "--limit=2"]
  assert saved["headline"] == {"piqa": {"metric": "acc", "value": 0.5, "stderr": 0.1}}


def test_grid_harness_flags_are_checked_before_training(tmp_path, monkeypatch):
  with pytest.raises(grid.GridError, match="--harness_tasks scores language models; task 'fuzzy_logic'"):
    grid.grid("configs/fuzzy_logic.py", [], ["softmax"], ["0"], {}, str(tmp_path / "f"),
              harness_args=("--tasks=piqa",))
  monkeypatch.setattr(grid.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(grid.GridError, match=r"needs lm-evaluation-harness: .*\.\[harness,test\]"):
    grid.grid("configs/tiny.py", [], ["softmax"], ["0"], {}, str(tmp_path / "t"),
              harness_args=("--tasks=piqa",))
  assert not (tmp_path / "f").exists() and not (tmp_path / "t").exists()
