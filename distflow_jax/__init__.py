"""distflow-jax: driver-free, multi-controller RL post-training of LLMs in JAX.

Every host runs the same program: it plans the DAG workflow from the config,
keeps its own portion of the plan and moves data only through collectives,
and only where the data layout changes.  Nothing is done at import time.
"""

__version__ = "0.1.0"
