"""Time to the first step of a restarted run, with and without JAX's persistent compilation cache.

  flock /tmp/bench.lock python benchmarks/restart_compile.py --out=docs/results/restart_compile.md

For each model: one `lm-train` run of 3 steps saves checkpoints at steps 2 and 3 and fills a
compilation cache. Then restarts, alternating with the cache (`--config.compilation_cache=DIR`) and
without (`--config.compilation_cache=none`): each resumes a copy of that workdir with the step-3
checkpoint removed (same config, so the same programs: the learning-rate schedule, for one, is
compiled in), and the time from
starting the process to its first step's progress line is measured (imports, setup, restore, compile,
one step), after which the process is killed. Reported: min and median per variant and the ratio of
the medians. Models: configs/tiny.py, and the same at c4_50m's width and depth (D=512, H=8, L=6,
F=2048; the tiny config's 2048-piece vocabulary, 256 tokens x 8 rows), on the embedded corpus, on
this host's CPU.
"""

import os
import shutil
import statistics
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("scratch", "/tmp/restart_compile", "Scratch directory (data, runs, caches).")
flags.DEFINE_integer("repeats", 3, "Restarts per variant and model.")
flags.DEFINE_string("out", "", "Write the markdown report here too.")

MODELS = {
    "tiny (D=128, L=2)": [],
    "c4_50m width and depth (D=512, L=6)": [
        "--config.model.D=512", "--config.model.H=8", "--config.model.L=6", "--config.model.F=2048",
        "--config.data.seq_len=256", "--config.train.batch_size=8"
    ],
}


def train(workdir: str, cache: str, steps: int, overrides: list[str]) -> list[str]:
  return [
      sys.executable, "-m", "lm.train", "--config=configs/tiny.py", f"--workdir={workdir}",
      f"--config.data.dir={FLAGS.scratch}/data", f"--config.compilation_cache={cache}",
      f"--config.train.steps={steps}", "--config.train.log_every_steps=1",
      "--config.checkpoint.every_steps=2", "--config.eval.every_steps=1000", *overrides
  ]


def time_to_first_step(cmd: list[str]) -> float:
  """Seconds from starting cmd to its first progress line; then the process is killed."""
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if line.startswith("step "):
      elapsed = time.perf_counter() - start
      proc.kill()
      proc.wait()
      return elapsed
  raise RuntimeError("".join(seen[-30:]))


def measure(name: str, overrides: list[str]) -> dict[str, list[float]]:
  root = os.path.join(FLAGS.scratch, name.split()[0])
  shutil.rmtree(root, ignore_errors=True)
  base, cache = os.path.join(root, "base"), os.path.join(root, "cache")
  result = subprocess.run(train(base, cache, 3, overrides), capture_output=True, text=True)
  if result.returncode:
    raise RuntimeError(result.stdout[-3000:] + result.stderr[-3000:])
  times = {"with cache": [], "without cache": []}
  for i in range(FLAGS.repeats):
    for variant, setting in (("with cache", cache), ("without cache", "none")):
      workdir = os.path.join(root, f"restart{i}_{variant.split()[0]}")
      shutil.copytree(base, workdir)  # The cache lives elsewhere.
      shutil.rmtree(os.path.join(workdir, "checkpoints", "3"))  # Resume from step 2.
      times[variant].append(time_to_first_step(train(workdir, setting, 3, overrides)))
      print(f"{name}, {variant}: {times[variant][-1]:.1f}s", flush=True)
  return times


def main(argv):
  del argv
  load = os.getloadavg()
  rows = [
      "| model | without cache: min / median | with cache: min / median | median ratio |", "|---|---|---|---|"
  ]
  for name, overrides in MODELS.items():
    t = measure(name, overrides)
    off, on = t["without cache"], t["with cache"]
    rows.append(f"| {name} | {min(off):.1f} s / {statistics.median(off):.1f} s | {min(on):.1f} s / "
                f"{statistics.median(on):.1f} s | {statistics.median(off) / statistics.median(on):.2f}x |")
  report = "\n".join([
      f"Time from process start to the first step of a restarted run ({FLAGS.repeats} restarts per "
      f"variant, alternating), on {os.cpu_count()} CPU cores; load average "
      f"{load[0]:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (other work shared the "
      "host).", "", *rows, ""
  ])
  print(report)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(report)


if __name__ == "__main__":
  app.run(main)
