"""Trains one run per attention variant and compares them:
`lm-sweep --config=FILE --attentions=softmax,linear,hyla --root=DIR [--config.a.b=v ...]`.

Every variant trains from the same config (so the same seed and data order) into ROOT/<variant>,
its final checkpoint is evaluated (lm-eval), each in its own process, and lm-compare writes ROOT/compare.md and
ROOT/compare.png. Rerunning resumes: a variant whose final evaluation exists is not touched, one
interrupted mid-training resumes from its latest checkpoint.
"""

import subprocess
import sys
import time

import ml_collections
from absl import flags, logging
from etils import epath
from ml_collections import config_flags

from eval import compare
from lm import attention, cli

FLAGS = flags.FLAGS


def sweep(config_file: str, config: ml_collections.ConfigDict, overrides: list[str],
          attentions: list[str], root: str) -> str:
  """Trains, evaluates and compares; returns the markdown table. `config` is config_file with the
  `--config.a.b=v` overrides applied; lm-train gets the file and the overrides."""
  unknown = [a for a in attentions if a not in attention.PRESETS]
  if unknown or not attentions:
    raise ValueError(f"unknown attention {', '.join(map(repr, unknown))}; choose from: "
                     f"{', '.join(attention.PRESETS)}")
  root = epath.Path(root)
  steps = config.train.steps
  for name in attentions:
    workdir = root / name
    if (workdir / "eval" / f"step_{steps}.json").exists():
      print(f"sweep: {name} is done (step {steps} evaluated); not retraining", flush=True)
      continue
    print(f"sweep: training {name} into {workdir}", flush=True)
    start = time.perf_counter()
    _run(["lm.train", f"--config={config_file}", f"--workdir={workdir}", *overrides,
          f"--config.model.attention={name}"])
    _run(["eval.evaluate", f"--workdir={workdir}", f"--step={steps}"])
    print(f"sweep: {name} trained and evaluated in {time.perf_counter() - start:.0f}s", flush=True)
  return compare.compare([str(root / a) for a in attentions], str(root / "compare.png"),
                         str(root / "compare.md"))


def _run(module_and_args: list[str]) -> None:
  """Runs `python -m module args` with this Python, its output shown as it comes."""
  result = subprocess.run([sys.executable, "-m", *module_and_args])
  if result.returncode:
    raise SystemExit(f"lm-sweep: `{' '.join(module_and_args)}` failed (exit {result.returncode}); "
                     f"fix the cause and rerun the same command: finished variants are kept")


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  start = time.perf_counter()
  try:
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    text = sweep(config_flags.get_config_filename(FLAGS["config"]), FLAGS.config, overrides,
                 FLAGS.attentions, FLAGS.root)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"lm-sweep: {e}") from e
  print(text, end="")
  print(f"sweep: {FLAGS.root}/compare.md and compare.png written "
        f"({time.perf_counter() - start:.0f}s in this invocation)")


def run():
  # Defined here, not on import, like lm-eval's: lm.train defines --config too.
  config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).")
  flags.DEFINE_list("attentions", ["softmax", "linear", "hyla"],
                    "Attention presets (lm.attention.PRESETS) to train, one run each.")
  flags.DEFINE_string("root", None, "Directory holding one workdir per variant.")
  flags.mark_flags_as_required(["config", "root"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
