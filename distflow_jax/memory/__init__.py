"""Per-device memory planning (``distflow-jax plan --memory``): ``compiled`` sizes the real
jitted steps on abstract shapes, ``analytic`` is the shape-only model, ``report`` puts
them together per role and node and checks the fit."""
