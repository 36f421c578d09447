"""Where a run's time went: `lm-goodput DIR [DIR ...]`.

Prints one row per training workdir: its wall-clock time over all of its (re)starts, split into
training, compiling, starting, restoring, checkpointing, evaluating, steps repeated after a restart
and time down between processes, and its goodput: the share spent on training steps that count
(lm/runtime/goodput.py says how each is measured).
"""

from absl import app

from lm.runtime import cli, goodput, metrics, run_log

COLUMNS = ("run", "wall-clock", *goodput.RUN_CATEGORIES, "restarts", "goodput")


def table(workdirs: list[str]) -> str:
  """Markdown: each category's time and share of the wall-clock time."""
  rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for workdir in workdirs:
    s = goodput.summarize(run_log.read(workdir))
    if not s["wall"]:
      raise ValueError(f"{workdir} has no goodput records yet (lm-train writes them with each "
                       "progress line)")
    share = lambda c: f"{metrics.format_duration(s[c])} ({100 * s[c] / s['wall']:.1f}%)"
    rows.append("| " + " | ".join([
        workdir.rstrip("/").split("/")[-1],
        metrics.format_duration(s["wall"]), *map(share, goodput.RUN_CATEGORIES),
        str(s["restarts"]), f"{100 * s['goodput']:.1f}%"
    ]) + " |")
  return "\n".join(rows) + "\n"


def main(argv):
  if len(argv) < 2:
    raise app.UsageError("give one or more training workdirs: lm-goodput DIR [DIR ...]")
  try:
    print(table(argv[1:]), end="")
  except ValueError as e:
    raise SystemExit(f"lm-goodput: {e}") from e


def run():
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
