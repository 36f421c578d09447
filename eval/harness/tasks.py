"""The harness's tasks from local files: their datasets downloaded once, on a machine with network
(`lm-harness-download`), and task definitions that point the harness's own tasks at them.

A data directory holds, per downloaded task, DIR/<task>/dataset.json (where the data came from and its
files) and one parquet file per split the task reads. `local_tasks` writes, for each such task, a YAML
that includes the harness's own definition of the task (its prompts, choices and metrics unchanged)
and replaces only where its dataset comes from: the local parquet files. Any other YAML task under DIR
(a task of one's own, with local data_files) is found as it is. With the harness's offline settings
(HF_DATASETS_OFFLINE, HF_HUB_OFFLINE), nothing reaches a hub.
"""

import json
from pathlib import Path

import yaml

# The zero-shot set that GLA, DeltaNet and flash-linear-attention report.
STANDARD = ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")
MANIFEST = "dataset.json"
SPLITS = ("training_split", "validation_split", "test_split", "fewshot_split")


def library_tasks() -> dict:
  """The harness's own task index: name -> entry (its YAML path)."""
  from lm_eval.tasks import TaskManager
  return TaskManager().task_index


def library_config(task: str, index: dict | None = None) -> tuple[Path, dict]:
  """The harness's YAML for `task` and its config with includes merged (functions unresolved)."""
  from lm_eval.tasks._yaml_loader import load_yaml
  index = library_tasks() if index is None else index
  entry = index.get(task)
  if entry is None or entry.yaml_path is None:
    raise ValueError(
        f"lm-evaluation-harness has no task {task!r} defined by a YAML file; choose tasks such as "
        f"{', '.join(STANDARD)}")
  return Path(entry.yaml_path), load_yaml(Path(entry.yaml_path), resolve_func=False, recursive=True)


def splits(config: dict) -> list[str]:
  """The dataset splits a task reads."""
  names = [config.get(k) for k in SPLITS] + [(config.get("fewshot_config") or {}).get("split")]
  return list(dict.fromkeys(n for n in names if n))


def download(tasks: list[str], out: str | Path) -> list[Path]:
  """Writes each task's splits to out/<task>/<split>.parquet with its manifest (needs network: the
  datasets come from the Hugging Face hub). Returns the manifests written."""
  import datasets
  out, index, written = Path(out), library_tasks(), []
  for task in tasks:
    _, config = library_config(task, index)
    kwargs = {k: v for k, v in (config.get("dataset_kwargs") or {}).items() if k != "trust_remote_code"}
    data = datasets.load_dataset(config["dataset_path"], config.get("dataset_name"), **kwargs)
    files = {}
    (out / task).mkdir(parents=True, exist_ok=True)
    for split in splits(config):
      data[split].to_parquet(str(out / task / f"{split}.parquet"))
      files[split] = f"{split}.parquet"
    manifest = out / task / MANIFEST
    manifest.write_text(
        json.dumps(
            {
                "task": task,
                "dataset_path": config["dataset_path"],
                "dataset_name": config.get("dataset_name"),
                "format": "parquet",
                "files": files,
                "rows": {
                    s: len(data[s]) for s in files
                }
            }, indent=1) + "\n")
    written.append(manifest)
  return written


def local_tasks(tasks: list[str], data_dir: str | Path, into: str | Path) -> list[Path]:
  """The paths the harness's TaskManager should include: `into`, where a YAML per downloaded task is
  written (pointing its library definition at the local files), and data_dir with any tasks of its
  own. Refuses, naming the download command, a task found in neither."""
  from lm_eval.tasks import TaskManager
  data_dir, into = Path(data_dir).resolve(), Path(into)
  if not data_dir.is_dir():
    raise FileNotFoundError(f"--data_dir={data_dir} is not a directory; write the tasks' data there with "
                            f"lm-harness-download --tasks={','.join(tasks)} --out={data_dir} (needs network)")
  own = set(TaskManager(include_path=str(data_dir), include_defaults=False).all_tasks)
  index, missing = None, []
  into.mkdir(parents=True, exist_ok=True)
  for task in tasks:
    manifest = data_dir / task / MANIFEST
    if not manifest.exists():
      if task not in own:
        missing.append(task)
      continue
    index = library_tasks() if index is None else index
    library_yaml, _ = library_config(task, index)
    saved = json.loads(manifest.read_text())
    definition = {
        "include": str(library_yaml),
        "task": task,
        "dataset_path": saved["format"],
        "dataset_name": None,
        "dataset_kwargs": {
            "data_files": {
                s: str(data_dir / task / f) for s, f in saved["files"].items()
            }
        },
    }
    (into / f"{task}.yaml").write_text(yaml.safe_dump(definition, sort_keys=False))
  if missing:
    raise FileNotFoundError(
        f"no local data for {', '.join(missing)} in {data_dir}; on a machine with network "
        f"run lm-harness-download --tasks={','.join(missing)} --out={data_dir}, or put "
        f"a YAML task of your own there")
  return [into, data_dir]
