"""The MQAR grid's result: query accuracy against model width and against the decoding state's size.

  python benchmarks/mqar_report.py --summary=runs/mqar/summary.json --prefix=docs/results/mqar

Reads the summary that `lm-grid --config=configs/mqar.py --grid=model.D=... --grid=data.num_kv_pairs=...
--grid=train.lr=... --tune=train.lr` writes (each variant at its best learning rate per width and number
of pairs), and writes PREFIX.json, PREFIX_width.png (accuracy against width, one panel per number of pairs,
one line per variant) and PREFIX_state.png (the same points against the bytes of the state that exact
decoding keeps for one sequence of the trained length), and prints the table as markdown. The
attention-free floor is the accuracy of a model that sees the queried key but cannot read the pairs:
one chance in the number of value tokens.
"""

import json
import math

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from absl import app, flags
from etils import epath

matplotlib.use("Agg")
from matplotlib import pyplot as plt, ticker  # noqa: E402  (after choosing the non-interactive backend)

from eval import grid_summary  # noqa: E402
from lm import decode, model as model_lib  # noqa: E402

FLAGS = flags.FLAGS
WIDTH, PAIRS = "model.D", "data.num_kv_pairs"
ACCURACY = grid_summary.METRICS["mqar"][0][0]


def state_bytes(model: dict, length: int) -> int:
  """Bytes of every layer's exact decoding state for one sequence of `length` tokens: the key/value
  cache, or linear attention's (and GLA's) constant-size recurrent state."""
  decoder = decode.Decoder(model_lib.ModelConfig.from_dict(model), length)
  params = jax.eval_shape(lambda: decoder.model.init(jax.random.key(0), jnp.zeros(
      (1, 1), jnp.int32))["params"])
  cache = jax.eval_shape(lambda p: decoder.init_cache(p, 1), params)
  return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))


def rows(summary: dict, root: epath.Path) -> list[dict]:
  """One row per (variant, width, pairs) at its best learning rate."""
  if summary["task"] != "mqar" or {WIDTH, PAIRS} - set(summary["axes"]):
    raise ValueError(f"expected an MQAR grid over {WIDTH} and {PAIRS}; this one is task "
                     f"{summary['task']!r} over {', '.join(summary['axes']) or 'no axes'}")
  order = list(dict.fromkeys(row["preset"] for row in summary["best"].values()))  # lm.attention's order
  out = []
  for row in summary["best"].values():
    config = json.loads((root / row["points"][0] / "config.json").read_text())
    values = row["values"]
    out.append({
        "variant": row["preset"],
        "D": int(values[WIDTH]),
        "pairs": int(values[PAIRS]),
        "lr": values.get("train.lr", str(config["train"]["lr"])),
        "seeds": row["seeds"],
        "accuracy": row[ACCURACY],
        "state_bytes": state_bytes(config["model"], config["data"]["seq_len"]),
        "floor": 1 / (config["data"]["vocab_size"] - config["data"]["vocab_size"] // 2),
    })
  return sorted(out, key=lambda r: (r["pairs"], order.index(r["variant"]), r["D"]))


def plot(table: list[dict], x: str, out: str) -> None:
  pairs = sorted({r["pairs"] for r in table})
  variants = list(dict.fromkeys(r["variant"] for r in table))
  fig, axes = plt.subplots(1, len(pairs), figsize=(3.6 * len(pairs), 3.4), sharey=True, squeeze=False)
  for ax, n in zip(axes[0], pairs):
    for i, variant in enumerate(variants):
      mine = sorted((r for r in table if r["pairs"] == n and r["variant"] == variant), key=lambda r: r[x])
      mean = np.array([r["accuracy"][0] for r in mine])
      se = np.array([r["accuracy"][1] or 0.0 for r in mine])
      # Shapes as well as colours: variants with the same state size and accuracy would hide each other.
      ax.errorbar([r[x] for r in mine], mean, yerr=se, marker="osD^vP"[i % 6], markerfacecolor="none",
                  capsize=3, color=f"C{i}", label=variant)
    ax.axhline(table[0]["floor"], color="grey", linestyle=":", label="attention-free floor")
    ax.set(title=f"{n} key-value pairs", xscale="log", ylim=(-0.03, 1.03),
           xlabel="model width D" if x == "D" else "decoding state, bytes per sequence")
    if x == "D":
      ax.set_xticks(sorted({r["D"] for r in table}), [str(d) for d in sorted({r["D"] for r in table})])
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())  # labels on powers of ten only
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].set_ylabel(ACCURACY)
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)


def markdown(table: list[dict]) -> str:
  lines = [
      "| pairs | attention | D | best lr | seeds | query accuracy | state bytes |",
      "|---|---|---|---|---|---|---|"
  ]
  for r in table:
    mean, se = r["accuracy"]
    acc = f"{mean:.3f}" + ("" if se is None else f" ± {se:.3f}")
    lines.append(
        f"| {r['pairs']} | {r['variant']} | {r['D']} | {r['lr']} | {', '.join(map(str, r['seeds']))} "
        f"| {acc} | {r['state_bytes']:,} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  path = epath.Path(FLAGS.summary)
  table = rows(json.loads(path.read_text()), path.parent)
  epath.Path(FLAGS.prefix + ".json").write_text(json.dumps(table, indent=1))
  plot(table, "D", FLAGS.prefix + "_width.png")
  plot(table, "state_bytes", FLAGS.prefix + "_state.png")
  print(markdown(table), end="")


if __name__ == "__main__":
  flags.DEFINE_string("summary", None, "summary.json of the MQAR grid (lm-grid ... --tune=train.lr).")
  flags.DEFINE_string("prefix", None, "Output prefix: PREFIX.json, PREFIX_width.png, PREFIX_state.png.")
  flags.mark_flags_as_required(["summary", "prefix"])
  app.run(main)
