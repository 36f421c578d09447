"""Zero-shot tasks of EleutherAI's lm-evaluation-harness scored by our model in JAX (`lm-harness`).

- scoring.py: requests packed into fixed-shape batches of the trained context and scored by one jitted
  step; greedy decoding through lm/decode.py; every process runs the same steps (process 0 decides).
- model.py: the harness's model interface (lm_eval.api.model.LM) on top of scoring.py.
- tasks.py: the tasks' datasets as local files (`lm-harness-download`) and task definitions that point
  the harness's own tasks at them, so that nothing reaches a hub at run time.
- cli.py: the commands; the results (the harness's metrics and every item's scores) beside the run.
- paired.py: per-item paired differences between variants (lm-grid's summary); imports no harness.

Only scoring.py and paired.py import nothing of lm_eval's; the rest needs the `harness` extra.
"""
