"""The run itself: set-up shared by every command that runs a model (``setup``), the RL step
loop (``trainer``) and one step's walk over the plan (``executor``), dynamic sampling,
evaluation, the SFT command's loop (``sft_run``), where an eval/generate model comes from
(``model_source``) and the persistent compile cache.  It may import every room below it
(warmstart, observe, persist, nodes, state) and the config checks; only memory/, lowering/,
commands/ and cli.py import it.
"""
