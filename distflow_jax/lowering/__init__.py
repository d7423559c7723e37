"""Every program a run compiles, built on abstract shapes and lowered for a target device.

``distflow-jax plan --lower=<target>`` (commands/plan.py) checks on any machine -- a CPU
laptop, CI -- that each program a run of the config would compile can be built for the
target (an H100, an A100, a TPU): the sequence passes, the train steps, the rollout
engine's init / prefill / insert / decode / grow, the weight sync, the re-partitions,
the save's checksums and the warm start, each with the run's own shapes and shardings
on a simulated mesh of the plan's size, through the same builders the run calls.  jax's
own checks are the judge (the cuDNN kernel's shape rules run as on the device:
models/target.py).

This room owns: ``abstract`` (a RunContext whose models are ``ShapeDtypeStruct``s),
``program`` (``Program``, ``Catalogue``), ``catalogue`` (the programs of a config; the
rollout's in ``rollout_programs``), ``gate`` (lowering them, the table,
the one-line refusal).  It may import every layer below it (memory, run, config, warmstart,
persist, observe, nodes, state, ...); nothing but commands/ imports it.
"""
