"""Shared by the workflow tests: small overrides that keep a full RL step fast."""

SMOKE = [
    "model.preset=micro",
    "model.warmstart.steps=0",
    "data.max_prompt_len=40",
    "rollout.prefill_buckets=(40,)",
    "rollout.max_new_tokens=8",
    "rollout.max_concurrent_decodes=8",
    "data.eval_size=8",
    "trainer.eval_every=0",
    "trainer.total_steps=3",
    "data.chat_template=True",
]


def smoke_overrides(run_dir, *extra):
  return SMOKE + [f"run_dir={run_dir}", *extra]
