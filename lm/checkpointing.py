"""Checkpoints: train state, data-iterator state and config in one orbax step directory.

Layout of `workdir/checkpoints/<step>/`:
  state/   the TrainState (step, params, optimiser state, RNG key), written asynchronously, sharded;
  data/    one JSON file per logical data shard with its grain iterator state, written by the
           process that owns the shard (so resuming on another process count finds every shard);
  config/  the run's config, to refuse a resume whose model would not match the saved arrays.
orbax writes each step into a temporary directory and renames it when complete, so a step that a
crash interrupted is never picked up, and it never overwrites a saved step.
"""

import dataclasses
import json
import shutil
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from data_pipelines import storage
from lm import model as model_lib

# Fields that may differ between the saved run and the resuming one: they change how the math is
# computed (train.microbatches: the same summed gradient in k parts, one dropout mask per step) or how
# long training runs, not what the saved arrays and data positions mean.
MUTABLE_FIELDS = ("model.attention_impl", "train.cross_entropy_impl", "model.remat", "model.rope_by_product",
                  "model.dtype", "model.matmul_dtype", "train.microbatches", "train.steps",
                  "train.log_every_steps", "train.on_nonfinite", "eval", "checkpoint", "mesh", "data.dir",
                  "data.tokenizer", "data.threads", "compilation_cache", "cpu_library_fusion", "cpu_devices",
                  "watchdog", "metrics")
# Fields added to the config after checkpoints existed, each with the value that computes what runs
# saved before it computed. A saved config without such a field reads as having that value, so those
# runs still resume and evaluate; any other field missing from a saved config is a difference.
ADDED_FIELDS = {
    "model.relative_bidirectional": True,
    "model.relative_bias_per_layer": False,
    "model.relative_bias_std": 0.02,
    "model.projection_bias": False,
    "model.residual_init": "depth",
    "train.schedule": "cosine",
    "train.cross_entropy_impl": "xla",
    "mesh.shard_state_over_data": False,
}


class DataShards:
  """The data iterators of this process, keyed by logical shard index."""

  def __init__(self, iterators: dict[int, Any]):
    self.iterators = iterators


class DataShardsHandler(ocp.CheckpointHandler):
  """Every process writes and reads only the files of its own shards."""

  def save(self, directory: epath.Path, args: "DataShardsSave"):
    for index, it in args.item.iterators.items():
      (directory / f"shard_{index:05d}.json").write_text(json.dumps(it.get_state()))

  def restore(self, directory: epath.Path, args: "DataShardsRestore"):
    for index, it in args.item.iterators.items():
      path = directory / f"shard_{index:05d}.json"
      if not path.exists():
        raise ValueError(f"checkpoint {directory.parent} has no state for data shard {index} "
                         f"({path.name}): it was saved with another data.shards, or it is damaged")
      it.set_state(json.loads(path.read_text()))
    return args.item

  def metadata(self, directory: epath.Path):
    return None


@ocp.args.register_with_handler(DataShardsHandler, for_save=True)
@dataclasses.dataclass
class DataShardsSave(ocp.args.CheckpointArgs):
  item: DataShards


@ocp.args.register_with_handler(DataShardsHandler, for_restore=True)
@dataclasses.dataclass
class DataShardsRestore(ocp.args.CheckpointArgs):
  item: DataShards


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in config.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def differences(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
  """(field, saved value, current value) of every field outside MUTABLE_FIELDS that differs."""
  mutable = lambda key: any(key == m or key.startswith(m + ".") for m in MUTABLE_FIELDS)
  new = _flat(current)
  old = {**{k: v for k, v in ADDED_FIELDS.items() if k in new}, **_flat(saved)}

  def same(k):
    # Attention compares layer by layer: "hyla,softmax" over 4 layers is "hyla,softmax,hyla,softmax".
    if k == "model.attention" and k in old and k in new and "model.L" in old and "model.L" in new:
      return (model_lib.layer_presets(old[k],
                                      old["model.L"]) == model_lib.layer_presets(new[k], new["model.L"]))
    return old.get(k) == new.get(k)

  return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if not mutable(k) and not same(k)]


def check_compatible(saved: dict, current: dict) -> None:
  """Raises naming every field whose change would make the saved state mean something else."""
  diffs = [f"{k}: checkpoint has {a!r}, config has {b!r}" for k, a, b in differences(saved, current)]
  if diffs:
    raise ValueError("the config does not match the checkpoint it would resume from:\n  " +
                     "\n  ".join(diffs) +
                     "\nuse a new --workdir, or set these fields back to the checkpoint's values")


class DamagedCheckpointError(ValueError):
  """A complete step directory that cannot be read back."""


class Checkpointer:
  """An orbax CheckpointManager over workdir/checkpoints; cfg is the `checkpoint` config section."""

  def __init__(self, workdir: str | epath.Path, cfg: ml_collections.ConfigDict):
    self.directory = _directory(workdir)
    options = ocp.CheckpointManagerOptions(save_interval_steps=cfg.every_steps, max_to_keep=cfg.keep,
                                           keep_period=cfg.keep_every or None,
                                           enable_async_checkpointing=cfg.use_async, create=True,
                                           cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(_directory(workdir), options=options,
                                         item_names=("state", "data", "config"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def saved_config(self, step: int) -> dict:
    return self._read(step, config=ocp.args.JsonRestore())["config"]

  def restore(self, step: int, abstract_state, data: DataShards):
    """abstract_state: ShapeDtypeStructs carrying the target shardings (restored straight into them)."""
    return self._read(step, state=ocp.args.StandardRestore(abstract_state),
                      data=DataShardsRestore(data))["state"]

  def _read(self, step: int, **items):
    try:
      return self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax and TensorStore raise many types, each with pages of detail
      raise DamagedCheckpointError(_unreadable(self.directory, step, e)) from e

  def set_aside(self, step: int) -> epath.Path:
    """Moves a damaged step out of orbax's sight (nothing is deleted); returns where it went."""
    target = self.directory.parent / "damaged_checkpoints" / str(step)
    if jax.process_index() == 0:
      target.parent.mkdir(parents=True, exist_ok=True)
      (self.directory / str(step)).rename(target)
    multihost_utils.sync_global_devices(f"set aside damaged checkpoint {step}")
    self.manager.reload()
    return target

  def save(self, step: int, state, data: DataShards, config: ml_collections.ConfigDict,
           force: bool = False) -> bool:
    """Starts a save when the interval says so (or force); returns whether it did."""
    return self.manager.save(
        step, force=force,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=DataShardsSave(data),
                                config=ocp.args.JsonSave(config.to_dict())))

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()

  def discard_unfinished(self) -> None:
    """Deletes what failed saves left (orbax's temporary step directories on a local disk), which
    orbax would delete only at the next start: on a full disk that space is the user's to free.
    Single-process jobs only: another process could still be writing its part."""
    if jax.process_count() == 1 and not storage.is_remote(self.directory):
      for tmp in self.directory.glob("*.orbax-checkpoint-tmp*"):
        shutil.rmtree(tmp)


def load(
    workdir: str,
    step: int | None = None,
    abstract_state: Any = None,
) -> tuple[ml_collections.ConfigDict, Any]:
  """The saved config and the model parameters of the latest or given step: whole arrays on this
  process's first device, whatever mesh saved them, or sharded as `abstract_state` says
  (ShapeDtypeStructs with shardings, from the saved config's Experiment; see `saved_config`)."""
  step, config = saved_config(workdir, step)
  manager = _reader(workdir)
  try:
    params = (abstract_state.params if abstract_state is not None else _on_one_device(
        manager.item_metadata(step)["state"]["params"]))
    # Only the parameters are read, not the optimiser's moments (twice their size) or the rest.
    restore = ocp.args.PyTreeRestore(
        item={"params": params}, partial_restore=True,
        restore_args=ocp.checkpoint_utils.construct_restore_args({"params": params}))
    params = manager.restore(step, args=ocp.args.Composite(state=restore))["state"]["params"]
  except Exception as e:  # as in Checkpointer._read
    others = [s for s in manager.all_steps() if s != step]
    raise DamagedCheckpointError(
        f"{_unreadable(_directory(workdir), step, e)}; "
        f"{f'read another step with --step=S, one of {others}; ' if others else ''}lm-train with "
        f"--config.checkpoint.skip_damaged=true sets damaged steps aside and resumes from the newest "
        f"intact one") from e
  finally:
    manager.close()
  return config, params


def saved_config(workdir: str, step: int | None = None) -> tuple[int, ml_collections.ConfigDict]:
  """The latest (or given) complete step in workdir and the config it was saved with."""
  manager = _reader(workdir)
  step = manager.latest_step() if step is None else step
  if step is None:
    what = "a file" if epath.Path(workdir).is_file() else "not the workdir of a run that saved one"
    raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints: {workdir} is {what}; --workdir "
                            f"must name the directory that lm-train --workdir wrote")
  if step not in manager.all_steps():
    raise FileNotFoundError(f"no checkpoint at step {step} in {workdir}/checkpoints; steps there: "
                            f"{list(manager.all_steps())}: choose one of them")
  if problem := not_a_checkpoint(workdir, step):
    manager.close()
    raise ValueError(problem)
  try:
    config = ml_collections.ConfigDict(
        manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])
  except Exception as e:  # as in Checkpointer._read
    raise DamagedCheckpointError(_unreadable(_directory(workdir), step, e)) from e
  finally:
    manager.close()
  for field, value in ADDED_FIELDS.items():
    section, name = field.rsplit(".", 1)
    if section in config and name not in config[section]:
      config[section][name] = value
  return step, config


# What every step directory that lm-train saved holds (orbax's items).
ITEMS = ("state", "data", "config")


def not_a_checkpoint(workdir: str | epath.Path, step: int) -> str | None:
  """Says what a step directory is when it is no checkpoint at all (empty, or someone else's files),
  with the fix; None when it holds a checkpoint's items (which may still be damaged)."""
  directory = _directory(workdir)
  path = directory / str(step)
  names = {p.name for p in path.iterdir()} if path.is_dir() else set()
  if names & set(ITEMS):
    return None
  what = "holds none of the files of a checkpoint" if names else "is an empty directory"
  return (f"{path} {what}, not a checkpoint; move it out of {directory} (or delete it) and run the "
          f"command again")


def _unreadable(directory: epath.Path, step: int, e: Exception) -> str:
  reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
  return f"the checkpoint at step {step} ({directory / str(step)}) cannot be read: {reason[:300]}"


def latest_step(workdir: str | epath.Path) -> int | None:
  """The newest complete step on disk now: what a resume would start from."""
  manager = _reader(workdir)
  step = manager.latest_step()
  manager.close()
  return step


def _directory(workdir: str | epath.Path) -> epath.Path:
  # orbax's async commit threads reject relative paths (after the step has already trained), so a
  # local workdir such as `runs/tiny` is made absolute here; gs:// paths are absolute already.
  path = epath.Path(workdir)
  return (path if "://" in str(workdir) else path.resolve()) / "checkpoints"


def _reader(workdir: str) -> ocp.CheckpointManager:
  # create=False: reading a misspelt workdir must not create it. The state's handler named up front,
  # so that its metadata (shapes, dtypes) can be read before it is restored; the PyTree handler (what
  # the standard one saved through) restores a part of it.
  return ocp.CheckpointManager(_directory(workdir), item_names=("state", "data", "config"),
                               item_handlers={"state": ocp.PyTreeCheckpointHandler()},
                               options=ocp.CheckpointManagerOptions(create=False))


def _on_one_device(metadata: Any) -> Any:
  """A restore target of the saved arrays whole on this process's first device: restoring without
  one asks for the saving run's device topology."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
