"""Per-device memory planning (``distflow-jax plan --memory``): ``compiled`` sizes the real
jitted steps on abstract shapes, ``analytic`` is the shape-only model, ``report`` puts
them together per role and node (``rollout_items``: the rollout node's; ``consumers``: the
Item / Estimate it fills), ``budget`` is what jax can use of a device, ``render`` prints
the plan and checks the fit, ``traffic`` is the re-partition traffic per step."""
