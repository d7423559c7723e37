"""Run by tests/test_lowering.py in a fresh process: a real tiny run, every program it
compiles (jax's compile log), then ``plan --lower``'s catalogue of the same config.

    python tests/lowering_probe.py OUT.json DEVICES -- --config=grpo:tiny --config.x=...

Writes ``{"compiled": [[name, signature], ...], "catalogue": [[name, signature], ...],
"count": N}`` where a signature is the program's flat input shapes and dtypes and N is
``plan --programs``' count of the catalogue.
"""

import json
import logging
import re
import sys

from distflow_jax import distributed

OUT, DEVICES = sys.argv[1], int(sys.argv[2])
ARGS = sys.argv[sys.argv.index("--") + 1:]
distributed.simulate_cpu_devices(DEVICES)

import jax  # noqa: E402

_TYPE = re.compile(r"(bool|u?int\d+|float\d+|bfloat16)\[([\d,]*)\]")


def signature(text: str) -> str:
  return ";".join(f"{d}[{s}]" for d, s in _TYPE.findall(text))


compiled: list[tuple[str, str]] = []


class Capture(logging.Handler):
  def emit(self, record):
    msg = record.getMessage()
    m = re.match(r"Compiling jit\((.*?)\) with global shapes and types (.*?)\. Argument mapping",
                 msg, re.S)
    if m:
      compiled.append((m.group(1), signature(m.group(2))))


logging.getLogger("jax").addHandler(Capture())
logging.getLogger("jax").setLevel(logging.WARNING)
jax.config.update("jax_log_compiles", True)

from distflow_jax import cli  # noqa: E402

sys.argv = ["distflow-jax", "train", *ARGS]
try:
  rc = cli.main(["train", *ARGS])
  if rc:
    sys.exit(rc)
except SystemExit as e:
  if e.code:
    raise
jax.config.update("jax_log_compiles", False)

from absl import flags  # noqa: E402

from distflow_jax.config import checks, loading  # noqa: E402
from distflow_jax.dag import FUNCTIONS  # noqa: E402
from distflow_jax.lowering import abstract, catalogue, count  # noqa: E402
from distflow_jax.memory import report  # noqa: E402

fv = flags.FlagValues()
loading.parse(fv, [a for a in ARGS if a.startswith("--config")])
cfg = fv.config
topo = checks.topology(cfg, 1, DEVICES)
plan = checks.plan_from_config(cfg, topo, FUNCTIONS)
ctx = abstract.abstract_context(cfg, plan, abstract.model_shape(cfg))
programs = catalogue.programs(cfg, plan, ctx)
cat = []
for p in programs.programs:
  traced = p.trace()
  for t in getattr(traced, "parts", [traced]):  # a program of several (rollout/cache_growth)
    cat.append((t.fun_name, signature(" ".join(str(a) for a in t.jaxpr.in_avals)),
                p.node, p.name))
with open(OUT, "w") as f:
  json.dump({"compiled": compiled, "catalogue": cat,
             "count": count.count(programs).total}, f)
