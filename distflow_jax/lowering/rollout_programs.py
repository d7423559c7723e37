"""The rollout's programs for ``plan --lower``: process 0's replica (the backend the config
names, built by ``RunContext.replicas.backend`` (state/replicas.py) on that host's devices, or on its group's where a
replica spans hosts): the weight sync's steps, the engine's init / decode / grow / prefill
/ insert (``Engine.programs``) or the reference sampler's one program, and the frozen
vision tower of a vision-language run.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from distflow_jax.dag.spec import Role
from distflow_jax.lowering import abstract as ab
from distflow_jax.lowering.program import Program, _Refused
from distflow_jax.models.vision import vision_layout
from distflow_jax.rollout.engine_backend import EngineBackend
from distflow_jax.rollout.reference import ReferenceSampler
from distflow_jax.state import roles as roles_lib
from distflow_jax.state.context import RunContext


def _placed(abstract_params: Any, shardings: Any) -> Any:
  """A backend's parameters as ``ShapeDtypeStruct``s in its own layout."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      abstract_params, shardings)


def rollout_programs(ctx: RunContext, node, devices, greedy: bool = False) -> list[Program]:
  """Process 0's rollout replica: its weight sync and every generate program."""
  rollout = ctx.section(node, "rollout")
  ordered = roles_lib.ordered_devices()
  # Process 0's replica: its own devices, or its group's where a replica spans hosts.
  group0 = ctx.replicas.processes(rollout.tensor_parallel, 0)
  host0 = [ordered[i] for i in devices if ctx.topo.process_of(i) in group0]
  backend = ctx.replicas.backend(rollout, greedy=greedy, devices=host0)
  tag = node.id + ("/eval" if greedy else "")
  process = {d: ctx.topo.process_of(i) for i, d in enumerate(ordered)}
  out = [Program(tag, p.name, p.fn, p.args)
         for p in backend.sync_programs(ctx.roles[Role.ACTOR].params, process.get)]
  if isinstance(backend, EngineBackend):
    eng = backend.engine
    try:
      out += [Program(tag, p.name, p.fn, p.args)
              for p in eng.programs(_placed(eng._abstract_params, eng.param_shardings))]
    except Exception as e:  # noqa: BLE001 - shapes come from tracing a prefill: its row says why
      out.append(Program(tag, "prefill", _Refused(e), ()))
  elif isinstance(backend, ReferenceSampler):
    out += _reference_programs(ctx, backend, tag)
  return out


def _reference_programs(ctx: RunContext, sampler: ReferenceSampler, tag: str) -> list[Program]:
  """The reference sampler's one program at its widest call: every local prompt's n rows,
  the longest prompt bucket plus the response budget."""
  cfg, conf = ctx.cfg, sampler.config
  rows = cfg.data.prompts_per_step // ctx.topo.num_processes * cfg.rollout.n
  width = -(-(max(conf.prefill_buckets) + conf.max_new_tokens) // 8) * 8
  images = None
  if ctx.vision is not None:  # rollout/images.PromptImages.rows
    i, d, _ = ab.image_dims(cfg, ctx.vision.cfg)
    images = (np.zeros((rows, i, d), np.float32), np.zeros((rows, width), bool),
              np.zeros((rows, 3, width), np.int32))
  args = (_placed(sampler._abstract_params, sampler.param_shardings),
          np.zeros((rows, width), np.int32), np.ones((rows,), np.int32),
          np.zeros((rows, 2), np.uint32), np.int32(0), images)
  return [Program(tag, f"next_token[rows={rows},len={width}]", sampler._next, args)]


def vision_programs(ctx: RunContext, node_id: str) -> list[Program]:
  """The frozen vision tower's forward over one prompt's image (state/vision.py: once
  per prompt, on this process's default device)."""
  enc = ctx.vision
  _, _, grid = ab.image_dims(ctx.cfg, enc.cfg)
  patches = int(np.prod(grid))
  pixels = np.zeros((patches, ab.image_processor(enc.cfg).patch_dim), np.float32)
  layout = vision_layout(enc.cfg.vision, np.asarray(grid).reshape(1, 3))
  return [Program(node_id, f"vision_tower[patches={patches}]", enc._fwd,
                  (enc.graphdef, enc.params, pixels, layout))]
