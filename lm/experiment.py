"""What follows from a config and the devices: model, task, optimiser, mesh, shardings, jitted steps."""

import functools
import importlib.metadata
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax import flatten_util
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from data_pipelines import pipeline
from lm import cross_entropy, model as model_lib, optimizer as optimizer_lib, rounding, sharding, stats, tasks
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


# The kinds of operations XLA's CPU backend may hand to YNNPACK (config.cpu_library_fusion).
LIBRARY_FUSIONS = ("dot", "eltwise", "reduce")


def cpu_compiler_options(kinds: str, platform: str) -> dict[str, str] | None:
  """The XLA options of the train and eval steps: config.cpu_library_fusion, on CPU only."""
  names = [k.strip() for k in kinds.split(",") if k.strip()]
  unknown = set(names) - set(LIBRARY_FUSIONS)
  if unknown:
    raise ValueError(f"unknown cpu_library_fusion kind(s) {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join(LIBRARY_FUSIONS)}, comma-separated, or \"\" for XLA's default")
  if platform != "cpu" or not names:
    return None
  return {"xla_cpu_experimental_ynn_fusion_type": ",".join(f"LIBRARY_FUSION_TYPE_{n.upper()}" for n in names)}


# libtpu before 0.0.50 moves the gradient all-reduce out of the microbatch loop (XLA's
# while-loop-all-reduce-code-motion) even where the loop zeroes the accumulated embedding gradient on
# all but one device of the all-reduce group, which is how SPMD partitions the gradient of the
# embedding's gather: the other devices then keep only their last microbatch (openxla/xla#49143).
# tests/test_compile.py finds it in libtpu 0.0.42.1's compiled train step, not in 0.0.50.1's, which
# keeps that all-reduce in the loop (docs/faults.md). XLA's GPU compiler runs the same pass and cannot
# be checked here, so GPUs run without it; XLA's CPU compiler does not run it.
FIXED_LIBTPU = (0, 0, 50)


def libtpu_version() -> str | None:
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def microbatch_compiler_options(microbatches: int, platform: str, libtpu: str | None) -> dict[str, str]:
  """The XLA options the train step needs for its microbatch loop to sum gradients correctly: on an
  accelerator, without the pass that miscompiles it, unless a libtpu of FIXED_LIBTPU or later says
  otherwise."""
  if microbatches == 1 or platform == "cpu":
    return {}
  if platform == "tpu" and libtpu and tuple(int(n) for n in re.findall(r"\d+", libtpu)[:3]) >= FIXED_LIBTPU:
    return {}
  return {"xla_disable_hlo_passes": "while-loop-all-reduce-code-motion"}


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
    self.compiler_options = cpu_compiler_options(config.get("cpu_library_fusion", ""), platform)
    micro = microbatch_compiler_options(k, platform, libtpu_version() if platform == "tpu" else None)
    self.train_compiler_options = {**(self.compiler_options or {}), **micro} or None
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
    # On CPU, with every parameter whole on every device, each device takes the gradients of its own
    # rows and the step adds them up itself (_summed_over_devices); with the state split over the data
    # axis, each device takes them against the gathered parameters (_sums_of_gathered); elsewhere jit
    # partitions the step.
    self.sums_on_devices = platform == "cpu" and shards > 1 and all(
        s.is_fully_replicated for s in jax.tree.leaves(self.state_shardings.params))

  def check_kernels_run_here(self, flag: str = "--config.model.attention_impl") -> None:
    """An explicit TPU kernel (model.attention_impl=pallas, splash, ...) on other devices stops with a
    line naming the field and the choices that run here (`flag` sets it), not Pallas's own sentence
    at the first step."""
    impl = self.model_cfg.attention_impl
    here = [name for name, row in ATTENTION_IMPLS.items() if self.platform in row.auto]
    if impl != "auto" and impl in ATTENTION_IMPLS and impl not in here:
      raise ValueError(f"model.attention_impl={impl!r} runs on TPU only, and this run's devices are "
                       f"{self.platform}; set {flag} to one of: auto, {', '.join(here)}")

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

  def _grads(self, params, batch, rng):
    """The batch's mean loss, its summed weight and the mean loss's gradients."""
    # check_vma off: the attention cores' custom gradients carry no per-axis variance types.
    if self.state_over_data:
      specs = jax.tree.map(lambda s: s.spec, self.state_shardings.params)
      sums = functools.partial(self._sums_of_gathered, specs)
      total, weight, grads = jax.shard_map(sums, in_specs=(specs, P(sharding.BATCH), P()),
                                           out_specs=(P(), P(), specs), check_vma=False)(params, batch, rng)
    elif self.sums_on_devices:
      total, weight, grads = jax.shard_map(self._summed_over_devices, in_specs=(P(), P(sharding.BATCH), P()),
                                           out_specs=P(), check_vma=False)(params, batch, rng)
    else:
      total, weight, grads = self._sums(params, batch, rng)
    scale = 1.0 / jnp.maximum(weight, 1.0)
    return total * scale, weight, jax.tree.map(lambda g: g * scale, grads)

  def _summed_over_devices(self, params, batch, rng):
    """_sums of this device's rows, added over the devices once per step, as one vector. XLA's CPU
    all-reduce synchronises the device threads once per operand, and the partitioned step all-reduces
    every gradient in every microbatch: for SRAVEN's model 74 operands x 4 microbatches, about 5 ms
    per microbatch, where one vector a step takes one meeting (steps 15-30% shorter;
    docs/compositional.md)."""
    flat, unflatten = flatten_util.ravel_pytree(self._sums(params, batch, rng))
    return unflatten(jax.lax.psum(flat, sharding.BATCH))

  def _sums_of_gathered(self, specs, params, batch, rng):
    """_sums of this device's rows against the parameters gathered whole from their shards
    (mesh.shard_state_over_data), each gradient summed over the devices and scattered back to its
    shard. The optimiser's update then reads and writes a sixteenth of the state on each of 16 chips
    (configs/c4_50m.py on v5e:4x4: 1.34 GB a step per chip with the state whole, docs/compile_table.md).
    The parameters that the model only uses rounded to its compute dtype are rounded before they are
    gathered (lm/rounding.py), and their gradients come back in that dtype (summed over microbatches
    in float32, `_sums`): the numbers are those of the state whole on every device, where XLA sums
    bfloat16 gradients too."""
    low = model_lib.DTYPES[self.model_cfg.dtype]
    rounded = self.rounded_before_use(
        *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (batch, rng)))
    whole = jax.tree.map(lambda p, spec, r: sharding.gather_over_data(p.astype(low) if r else p, spec),
                         params, specs, rounded)
    total, weight, grads = self._sums(whole, batch, rng)
    grads = jax.tree.map(lambda g, p, spec: sharding.scatter_over_data(g, spec).astype(p.dtype), grads,
                         params, specs)
    return jax.lax.psum(total, sharding.BATCH), jax.lax.psum(weight, sharding.BATCH), grads

  def rounded_before_use(self, batch, rng) -> dict:
    """Per parameter, whether the training loss on `batch` (arrays or their abstract shapes) uses it
    only rounded to the model's compute dtype, once (lm/rounding.py)."""
    return rounding.rounded_before_use(lambda p, b, r: self._weighted_loss(p, b, r)[0],
                                       model_lib.DTYPES[self.model_cfg.dtype], self.abstract_state.params,
                                       batch, rng)

  def _sums(self, params, batch, rng):
    """The weighted loss summed over the batch's microbatches, the summed weight and the gradients of
    the sum."""
    grad_fn = jax.value_and_grad(self._weighted_loss, has_aux=True)
    k = self.config.train.microbatches
    if k == 1:
      (total, (_, weight)), grads = grad_fn(params, batch, rng)
    else:
      # Microbatch i takes rows i, i+k, i+2k, ...: every device holds its share of each microbatch.
      micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape((-1, k) + x.shape[1:]), 0, 1), batch)

      def body(carry, mb):
        mb = jax.tree.map(sharding.constrain_batch, mb)
        # Every microbatch takes the step's key: attention dropout's mask is one per step, shared over
        # the batch, so k parts train exactly what one batch would.
        (total, (_, weight)), grads = grad_fn(params, mb, rng)
        return jax.tree.map(lambda c, x: c + x.astype(c.dtype), carry, (total, weight, grads)), None

      # The gradients add up in float32 at least: a parameter gathered rounded to bfloat16
      # (mesh.shard_state_over_data) has bfloat16 gradients, which the state whole converts to float32
      # in every microbatch before the sum.
      accumulator = lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32))
      zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(accumulator, params))
      (total, weight, grads), _ = jax.lax.scan(body, zeros, micro)
    return total, weight, grads

  @functools.cached_property
  def _train_step(self):

    def step(state: TrainState, batch):
      rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
      loss, weight, grads = self._grads(state.params, batch, rng)
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
