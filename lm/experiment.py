"""What follows from a config and the devices: model, task, optimiser, mesh, shardings, jitted steps.

The train step: the batch's loss and its gradients (summed as lm/gradients.py says), the optimiser's
update, kept only if finite; both steps compile with lm/xla_options.py's options for the platform.
"""

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from data_pipelines import pipeline
from lm import (
    attention,
    cross_entropy,
    gradients,
    model as model_lib,
    optimizer as optimizer_lib,
    sharding,
    stats,
    tasks,
    xla_options,
)
from lm.attention import IMPLS as ATTENTION_IMPLS


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array  # raw uint32 key data: checkpoints store plain arrays


# Fields that count something: each must be a whole number of at least 1 (where a config has it).
COUNTS = ("model.V", "model.D", "model.H", "model.L", "model.F", "model.max_len", "model.relative_buckets",
          "model.relative_max_distance", "data.seq_len", "data.packing_bins", "data.num_vars",
          "data.num_terms", "train.steps", "train.instances", "train.batch_size", "train.microbatches",
          "train.log_every_steps", "eval.every_steps", "eval.batch_size", "eval.batches",
          "eval.final_batches", "checkpoint.every_steps", "checkpoint.keep")
# Whole numbers where 0 means none, off or the default (a negative one was taken without a word).
WHOLE = ("train.warmup_steps", "checkpoint.keep_every", "data.shards", "data.threads", "model.qkv_dim",
         "model.input_dim", "cpu_devices")
# Numbers that must be above zero: a learning rate of 0 trains nothing, a negative one climbs the loss.
POSITIVE = ("train.lr", "train.eps", "model.rope_base")
# Numbers that must not be negative.
NOT_NEGATIVE = ("train.grad_clip", "train.weight_decay", "train.end_lr_frac")
# Fractions: from 0 up to, not including, 1.
FRACTIONS = ("model.attention_dropout", "train.b1", "train.b2")
# Durations in seconds: 0 turns the watchdog off; a negative one used to turn it off silently.
DURATIONS = ("watchdog.step_secs", "watchdog.first_step_secs")
# What a value out of range would have done, where it is not plain.
WHY = {"checkpoint.keep": " (0 deleted every checkpoint, the final one included)"}


def _get(config: ml_collections.ConfigDict, name: str):
  *sections, field = name.split(".")
  for section in sections:
    if section not in config:
      return None
    config = config[section]
  return config.get(field)


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_counts(config: ml_collections.ConfigDict) -> None:
  """Every count, rate, fraction and duration of the config in its range, all checked together before
  anything starts (a workdir, a lock, the data): one line naming the field and the fix."""
  for name in COUNTS + WHOLE + POSITIVE + NOT_NEGATIVE + FRACTIONS + DURATIONS:
    value = _get(config, name)
    if value is None:
      continue
    if name in COUNTS + WHOLE:
      least = 1 if name in COUNTS else 0
      if not (_number(value) and float(value).is_integer() and value >= least):
        whole = _number(value) and float(value).is_integer()
        what = ("counts something and must be a whole number of at least 1"
                if least else "must be 0 or more" if whole else "must be a whole number, 0 or more")
        raise ValueError(f"{name}={value!r} {what}{WHY.get(name, '')}; set --config.{name}=N")
      continue
    if not _number(value) or math.isnan(value) or (name not in DURATIONS and math.isinf(value)):
      raise ValueError(f"{name}={value!r} must be a finite number; set --config.{name}=X")
    if name in POSITIVE and not value > 0:
      raise ValueError(f"{name}={value!r} must be above 0; set --config.{name}=X")
    if name in NOT_NEGATIVE and value < 0:
      raise ValueError(f"{name}={value!r} must be 0 or more; set --config.{name}=X")
    if name in FRACTIONS and not 0 <= value < 1:
      raise ValueError(f"{name}={value!r} must be at least 0 and below 1; set --config.{name}=X")
    if name in DURATIONS and value < 0:
      raise ValueError(f"{name}={value!r} must be 0 or more seconds (watchdog.step_secs=0 turns the "
                       f"watchdog off); set --config.{name}=S")
  watch = config.get("watchdog")
  if watch and _number(watch.get("step_secs")) and watch.step_secs > 0 and not watch.first_step_secs > 0:
    raise ValueError(f"watchdog.first_step_secs={watch.first_step_secs!r} must be above 0 while the watchdog "
                     f"is on (it would stop the run before its first step); set "
                     f"--config.watchdog.first_step_secs=S, or watchdog.step_secs=0 to turn it off")


class Experiment:

  def __init__(self, config: ml_collections.ConfigDict, devices=None):
    check_counts(config)
    self.config = config
    self.model_cfg = model_lib.ModelConfig.from_dict(config.model.to_dict())
    self.task = tasks.build(config, self.model_cfg.V)
    self.model = model_lib.Transformer(self.model_cfg)
    self.optimizer = optimizer_lib.make(config.train)
    self.mesh = sharding.make_mesh(config.mesh, devices)
    self.batch_sharding = sharding.batch_sharding(self.mesh)
    shards = math.prod(self.mesh.shape[a] for a in sharding.BATCH)
    rows, k = config.train.batch_size, config.train.microbatches
    if rows % (k * shards):
      raise ValueError(f"train.batch_size={rows} does not split into train.microbatches={k} "
                       f"microbatches of a multiple of the {shards} batch shards of the mesh "
                       f"(data x fsdp) each; choose a multiple of {k * shards}")
    if config.eval.batch_size % shards:
      raise ValueError(f"eval.batch_size={config.eval.batch_size} is not divisible by the {shards} "
                       f"batch shards of the mesh (data x fsdp); choose a multiple of {shards}")
    platform = self.platform = self.mesh.devices.flat[0].platform
    self.compiler_options, self.train_compiler_options = xla_options.step_options(
        config.get("cpu_library_fusion", ""), k, platform, self.mesh.size)
    cross_entropy.check_impl(config.train.cross_entropy_impl)
    if config.train.on_nonfinite not in ("stop", "skip"):
      raise ValueError(f"unknown train.on_nonfinite {config.train.on_nonfinite!r}; choose stop or skip")
    # The state as created, each parameter (and optimiser moment) boxed with its logical axes.
    boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
    self.abstract_state = nn.meta.unbox(boxed)
    self.state_shardings = sharding.shardings(boxed, self.mesh, params=boxed.params)
    self.num_params = model_lib.count_params(self.abstract_state.params)
    self.state_over_data = config.mesh.shard_state_over_data
    if self.state_over_data:
      if self.mesh.shape["fsdp"] * self.mesh.shape["tensor"] > 1:
        raise ValueError(f"mesh.shard_state_over_data splits the state over the data axis alone, but the "
                         f"mesh is {dict(self.mesh.shape)}; set mesh.fsdp=1 and mesh.tensor=1, or "
                         f"mesh.shard_state_over_data=False")
      self.state_shardings = self.state_shardings.replace(
          params=sharding.over_data(self.abstract_state.params, self.mesh),
          opt_state=sharding.over_data(self.abstract_state.opt_state, self.mesh))
    # How the step sums its gradients follows from the platform and the state's layout (lm/gradients.py).
    self.sums_on_devices = gradients.sums_on_devices(platform, shards, self.state_shardings.params)

  def check_kernels_run_here(self, flag: str = "--config.model.attention_impl") -> None:
    """An explicit kernel of another platform (model.attention_impl=pallas, splash, cudnn, ...) stops
    with a line naming the field and the choices that run here for this model's layers (`flag` sets
    it), not the kernel's own sentence at the first step."""
    cfg, impl = self.model_cfg, self.model_cfg.attention_impl
    row = ATTENTION_IMPLS.get(impl)
    if row is None or not row.auto or self.platform in row.auto:  # auto={}: runs anywhere, auto never takes it
      return
    call = cfg.attention_call()
    here = [
        name for name, r in ATTENTION_IMPLS.items() if self.platform in r.auto and all(
            attention.unsupported(name, cfg.layer_knobs(layer), call) is None for layer in range(cfg.L))
    ]
    raise ValueError(f"model.attention_impl={impl!r} runs on {' and '.join(row.auto).upper()} only, and this "
                     f"run's devices are {self.platform}; set {flag} to one of: auto, {', '.join(here)}")

  def _init_boxed(self, rng: jax.Array) -> TrainState:
    # One row of the run's own length: initialisation runs the attention kernels the run will use,
    # so it must not refuse a length they accept.
    inputs = self.task.example()["inputs"][:1]
    init_rng, train_rng = jax.random.split(rng)
    params = self.model.init(init_rng, inputs)["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params),
                      rng=jax.random.key_data(train_rng))

  def _init(self, rng: jax.Array) -> TrainState:
    return nn.meta.unbox(self._init_boxed(rng))

  def init_state(self) -> TrainState:
    """Initialises directly into the sharded layout: nothing is ever whole on one device."""
    with jax.set_mesh(self.mesh):
      return jax.jit(self._init, out_shardings=self.state_shardings)(jax.random.key(self.config.seed))

  def abstract_sharded_state(self) -> TrainState:
    """ShapeDtypeStructs with shardings: the restore target and the AOT-compile argument."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.abstract_state,
                        self.state_shardings)

  def apply(self, params, batch, **kw):
    """The model's outputs at the positions the task reads (all, or its last readout_last)."""
    return self.model.apply({"params": params}, batch["inputs"], positions_bt=batch.get("positions"),
                            segment_ids_bt=batch.get("segment_ids"), readout_last=self.task.readout_last,
                            **kw)

  def _weighted_loss(self, params, batch, rng):
    """The task's mean loss times its weight: summed over microbatches, then divided by the summed
    weight, it gives the mean over the whole batch."""
    outputs = self.apply(params, batch, deterministic=False, rngs={"dropout": rng},
                         return_readout=self.task.loss_takes_readout)
    mean, weight = self.task.loss(outputs, batch)
    return mean * weight, (mean, weight)

  @functools.cached_property
  def _gradients(self) -> gradients.Summation:
    """How the train step sums its gradients (lm/gradients.py)."""
    return gradients.Summation(self._weighted_loss, self.config.train.microbatches,
                               gradients.strategy(self.state_over_data, self.sums_on_devices),
                               param_shardings=self.state_shardings.params,
                               compute_dtype=model_lib.DTYPES[self.model_cfg.dtype],
                               abstract_params=self.abstract_state.params)

  @functools.cached_property
  def _train_step(self):

    def step(state: TrainState, batch):
      rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
      loss, weight, grads = self._gradients.mean(state.params, batch, rng)
      grad_norm = optax.tree.norm(grads)
      updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
      new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                       opt_state=opt_state, rng=state.rng)
      # A non-finite step leaves the state as it was, so a NaN can never reach a checkpoint.
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      kept = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
      stats = {
          "loss": loss,
          "grad_norm": grad_norm,
          "weight": weight,
          "finite": finite,
          "lr": optimizer_lib.schedule(self.config.train)(state.step)
      }
      return kept.replace(step=state.step + 1), stats

    return jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                   out_shardings=(self.state_shardings, None), donate_argnums=0,
                   compiler_options=self.train_compiler_options)

  def train_step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
    with jax.set_mesh(self.mesh):
      return self._train_step(state, batch)

  def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
    """A global training batch as abstract arrays sharded like real ones; no data is read."""
    rows = self.config.train.batch_size
    return {
        k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype, sharding=self.batch_sharding)
        for k, v in self.task.example().items()
    }

  def lower_train_step(self):
    """The train step for abstract state and batch: ahead-of-time compilation for devices that
    need not be present (lm-compile)."""
    with jax.set_mesh(self.mesh):
      return self._train_step.lower(self.abstract_sharded_state(), self.batch_spec())

  @functools.cached_property
  def _eval_params(self):
    """The parameters' shardings in evaluation: as stored, or whole on every device when the state is
    split over the data axis (gathered once a set by `_gather`, not in every batch)."""
    if not self.state_over_data:
      return self.state_shardings.params
    return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), self.state_shardings.params)

  @functools.cached_property
  def _gather(self):
    return jax.jit(lambda params: params, out_shardings=self._eval_params)

  @functools.cached_property
  def _eval_step(self):
    step = lambda params, batch: self.task.eval_sums(self.apply(params, batch), batch)
    return jax.jit(step, in_shardings=(self._eval_params, self.batch_sharding),
                   compiler_options=self.compiler_options)

  def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host-local rows → one global array per field, sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local.items()}

  def eval_sets(self, final: bool = False) -> dict[str, Callable[[], Iterator[dict[str, np.ndarray]]]]:
    """This process's share of every evaluation set: the same batches on every call. `final`: the
    sets of a run's last evaluation (larger for tasks that say so)."""
    return self.task.eval_sets(pipeline.Shard(jax.process_index(), jax.process_count()),
                               self.config.eval.batch_size // jax.process_count(), final)

  def evaluate(self, params, batches: Iterator[dict[str, np.ndarray]]) -> dict[str, float]:
    """The task's metrics over every batch of a set. Per-batch sums stay on device until the end,
    so the host dispatches the whole set without waiting; they are added (moments merged) in float64."""
    with jax.set_mesh(self.mesh):
      if self.state_over_data:
        params = self._gather(params)
      per_batch = jax.device_get(
          [self._eval_step(params, self.global_batch(b)) for b in _until_all_done(batches)])
    sums = {
        k:
            stats.merge_all([b[k] for b in per_batch]) if isinstance(v, stats.Moments) else float(
                np.sum([np.float64(b[k]) for b in per_batch])) for k, v in per_batch[0].items()
    }
    return self.task.summarize(sums)


def _until_all_done(batches: Iterator[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
  """Yields until every process has run out: processes whose shard ends first feed all-zero batches
  (zero weight), because every process must take part in every step of a global array."""
  if jax.process_count() == 1:
    yield from batches
    return
  template = None
  while True:
    batch = next(batches, None)
    done = multihost_utils.process_allgather(np.int32(batch is None))
    if np.all(done):
      return
    if batch is None:
      if template is None:
        raise ValueError("this process's share of the evaluation set is empty: the set has fewer "
                         "documents than there are processes; evaluate on fewer processes")
      batch = jax.tree.map(np.zeros_like, template)
    template = batch
    yield batch
