"""Training loop: `lm-train --config=configs/X.py --workdir=DIR [--config.a.b=v ...]`."""

import functools
import math
import time
from typing import Any, Iterator

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags
from etils import epath
from ml_collections import config_flags

from data_pipelines import pipeline
from lm import metrics, model as model_lib, optimizer as optimizer_lib, sharding, tasks

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics and checkpoints.")


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


class Experiment:
  """Everything a run needs that follows from the config and the devices: model, optimiser,
  mesh, shardings, jitted steps."""

  def __init__(self, config: ml_collections.ConfigDict, devices=None):
    self.config = config
    self.model_cfg = model_lib.ModelConfig.from_dict(config.model.to_dict())
    self.task = tasks.build(config, self.model_cfg.V)
    self.model = model_lib.Transformer(self.model_cfg)
    self.optimizer = optimizer_lib.make(config.train)
    self.mesh = sharding.make_mesh(config.mesh, devices)
    self.batch_sharding = sharding.batch_sharding(self.mesh)
    shards = math.prod(self.mesh.shape[a] for a in sharding.BATCH)
    for name, rows in (("train.batch_size", config.train.batch_size),
                       ("eval.batch_size", config.eval.batch_size)):
      if rows % shards:
        raise ValueError(f"{name}={rows} is not divisible by the {shards} batch shards of the mesh "
                         f"(data x fsdp); choose a multiple of {shards}")
    self.abstract_state = jax.eval_shape(self._init, jax.random.key(0))
    self.state_shardings = sharding.shardings(self.abstract_state, self.mesh)
    self.num_params = model_lib.count_params(self.abstract_state.params)

  def _init(self, rng: jax.Array) -> TrainState:
    inputs = jnp.zeros((1, 8) + ((self.model_cfg.input_dim,) if self.model_cfg.input_dim else ()),
                       jnp.float32 if self.model_cfg.input_dim else jnp.int32)
    params = self.model.init(rng, inputs)["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.optimizer.init(params))

  def init_state(self) -> TrainState:
    """Initialises directly into the sharded layout: nothing is ever whole on one device."""
    init = jax.jit(self._init, out_shardings=self.state_shardings)
    return init(jax.random.key(self.config.seed))

  def apply(self, params, batch, **kw):
    outputs, _ = self.model.apply({"params": params}, batch["inputs"],
                                  positions_bt=batch.get("positions"),
                                  segment_ids_bt=batch.get("segment_ids"), **kw)
    return outputs

  def loss(self, params, batch, rng):
    return self.task.loss(self.apply(params, batch, deterministic=False, rngs={"dropout": rng}), batch)

  @functools.cached_property
  def train_step(self):
    def step(state: TrainState, batch):
      rng = jax.random.fold_in(jax.random.key(self.config.seed + 1), state.step)
      (loss, count), grads = jax.value_and_grad(self.loss, has_aux=True)(state.params, batch, rng)
      updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      stats = {"loss": loss, "grad_norm": optax.tree.norm(grads), "target_tokens": count,
               "lr": optimizer_lib.schedule(self.config.train)(state.step)}
      return TrainState(step=state.step + 1, params=params, opt_state=opt_state), stats
    return jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                   out_shardings=(self.state_shardings, None), donate_argnums=0)

  @functools.cached_property
  def eval_step(self):
    step = lambda params, batch: self.task.eval_sums(self.apply(params, batch), batch)
    return jax.jit(step, in_shardings=(self.state_shardings.params, self.batch_sharding))

  def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host-local rows → one global array per field, sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, v)
            for k, v in local.items()}

  def evaluate(self, params, batches: Iterator[dict[str, np.ndarray]]) -> dict[str, float]:
    """The task's metrics over every batch of a set. Per-batch sums stay on device until the end,
    so the host dispatches the whole set without waiting; they are added in float64."""
    per_batch = jax.device_get([self.eval_step(params, self.global_batch(b)) for b in batches])
    sums = {k: float(np.sum([np.float64(b[k]) for b in per_batch])) for k in per_batch[0]}
    return self.task.summarize(sums)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains for config.train.steps and returns the final evaluation metrics."""
  workdir = epath.Path(workdir)
  try:
    exp = Experiment(config)
  except (ValueError, FileNotFoundError) as e:
    # Mistakes in the config or the data: the message names the fix, a traceback would bury it.
    raise SystemExit(f"lm-train: {e}") from e
  workdir.mkdir(parents=True, exist_ok=True)
  is_main = jax.process_index() == 0
  if is_main:
    (workdir / "config.json").write_text(config.to_json(indent=1))
  print(f"model: {exp.model_cfg.attention} attention, {exp.num_params:,} parameters, "
        f"{jax.device_count()} devices, mesh {dict(exp.mesh.shape)}", flush=True)

  shard = pipeline.Shard(jax.process_index(), jax.process_count())
  train_iter = exp.task.train_iterator(shard, config.train.batch_size // jax.process_count())
  eval_sets = exp.task.eval_sets(shard, config.eval.batch_size // jax.process_count())

  writer = metrics.Writer(workdir, enabled=is_main)
  steps = config.train.steps
  tokens_per_step = config.train.batch_size * exp.task.seq_len
  progress = metrics.Progress(steps, tokens_per_step, start_step=0)
  state = exp.init_state()

  def run_eval(step: int) -> dict:
    results = {}
    for name, batches in eval_sets.items():
      start = time.perf_counter()
      result = {**exp.evaluate(state.params, batches()), "tokens_seen": step * tokens_per_step}
      writer.write(step, f"eval/{name}", result)
      shown = ", ".join(f"{k} {v:.4g}" for k, v in result.items() if k != "tokens_seen")
      print(f"eval {name} at step {step}: {shown} ({time.perf_counter() - start:.1f}s)", flush=True)
      results[name] = result
    return results

  pending = None  # the previous step's metrics, read after the next step is dispatched
  for step in range(steps):
    batch = exp.global_batch(next(train_iter))
    state, stats = exp.train_step(state, batch)
    if pending is not None:
      _report(pending, writer, progress, config, tokens_per_step)
    pending = (step + 1, stats)
    if step == 0:
      jax.block_until_ready(stats)
      progress.mark(1)
    if (step + 1) % config.eval.every_steps == 0 and step + 1 < steps:
      run_eval(step + 1)
  _report(pending, writer, progress, config, tokens_per_step, force=True)
  final = run_eval(steps)
  main_set = final[next(iter(final))]
  if "perplexity" in main_set:
    baseline = main_set.get("unigram_perplexity")
    print(f"final validation perplexity {main_set['perplexity']:.2f}"
          + (f" (unigram baseline {baseline:.2f})" if baseline else ""), flush=True)
  return final


def _report(pending, writer, progress, config, tokens_per_step, force=False):
  step, stats = pending
  if step % config.train.log_every_steps and not force:
    return
  stats = {k: float(v) for k, v in jax.device_get(stats).items()}
  if not math.isfinite(stats["loss"]):
    raise FloatingPointError(f"loss is {stats['loss']} at step {step}; stopping")
  stats.update(progress.report(step, stats["loss"]))
  writer.write(step, "train", {**stats, "tokens_seen": step * tokens_per_step})


def main(argv):
  del argv
  train_and_evaluate(_CONFIG.value, _WORKDIR.value)


def run():
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)


if __name__ == "__main__":
  run()
