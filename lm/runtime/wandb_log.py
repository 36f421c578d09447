"""Optional Weights & Biases logging: every record of the run log also goes to a W&B run.

On when `metrics.wandb_project` is set; wandb (the `wandb` extra) is imported only then, and only
process 0 logs. A restarted run continues the same W&B run, whose id is kept in WORKDIR/wandb_run_id.
Charts use the training step, logged as `step`, for their x-axis: after a restart the steps since the
checkpoint come again, and W&B's own step counter may only grow.
"""

import numbers
from typing import Any

import ml_collections
from etils import epath

from data_pipelines import storage


class Tee:
  """Writes each record to `writer` (the run log) and logs its numbers to W&B as `kind/name`."""

  def __init__(self, writer, cfg: ml_collections.ConfigDict, workdir: epath.Path, config: dict):
    try:
      import wandb  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError(f"metrics.wandb_project={cfg.wandb_project!r} needs wandb; install the extra: "
                        'pip install -e ".[wandb]", or leave metrics.wandb_project empty') from e
    id_file = workdir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
    self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity or None, id=run_id,
                          resume="allow", name=workdir.name, config=config, mode=cfg.wandb_mode,
                          dir=cfg.wandb_dir or None)
    storage.write_text(id_file, run_id)
    self.run.define_metric("*", step_metric="step")
    self.writer = writer

  def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
    self.writer.write(step, kind, values)
    scalars = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, numbers.Real)}
    if scalars:
      self.run.log({"step": step, **scalars})

  def close(self) -> None:
    self.writer.close()
    self.run.finish()
