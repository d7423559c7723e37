"""What a node sees of the run: its context, its models, its metrics and its step state.

``context`` (RunContext: config, plan, roles, layouts, rollout backends, compiled-function
caches), ``roles`` (each role's model state and how it is built), ``vision`` (the frozen
vision tower of a vision-language run), ``metrics`` (a step's metrics, reduced over hosts),
``algo_state`` (state that changes across steps and is saved with checkpoints) and
``warm_shapes`` (the calls whose other prompt widths compile ahead).  It may import the
libraries (models, data, train, rollout, tasks, rewards, algos), dag/ and the base config;
never nodes/ or a room above them (persist, observe, warmstart, run).
"""
