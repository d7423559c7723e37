"""The run's top-level config (``Config``) and its run-wide sections: placement, trainer,
logging, sft.  Each key one field: type, default, one-line doc, core flag and check (see
``config/declare.py``); the model and algorithm sections are in ``config/sections.py``.
"""

from __future__ import annotations

import dataclasses

from distflow_jax.config import response, vision_checks
from distflow_jax.config.declare import Section, key, open_key, section
from distflow_jax.config.sections import (Actor, Algo, Cluster, Critic, Data, Model,
                                          Reference, Reward, Rollout, compile_cache_dir)
from distflow_jax.config.validators import Folder, InRange, LearningRate, Option, Positive, Whole

frozen = dataclasses.dataclass(frozen=True)
P = Positive()


@frozen
class MeshShape(Section):
  data: int = key(1, "data-parallel axis size")
  fsdp: int = key(-1, "fully-sharded axis size; -1 = the devices left")
  tensor: int = key(1, "tensor-parallel axis size")


@frozen
class Mesh(Section):
  devices: str = key("all", "the role's devices: all | a spec such as '0:4'")
  mesh: MeshShape = section(MeshShape, "the role's mesh axes")

  @classmethod
  def from_config(cls, node) -> Mesh:
    """A role's placement as dag/planner.role_mesh reads it: devices 'all' and the mesh
    {'fsdp': -1} when left out; an axis a given mesh leaves out is 1."""
    devices = node["devices"] if "devices" in node else "all"
    shape = (node["mesh"] if "mesh" in node else None) or {"fsdp": -1}
    return cls(devices=devices, mesh=MeshShape(**{f.name: shape[f.name] if f.name in shape
                                                  else 1 for f in dataclasses.fields(MeshShape)}))


@frozen
class RolloutDevices(Section):
  devices: str = key("actor", "the rollout replicas' devices: actor (the actor's) | a spec "
                     "('0:4') of their own, e.g. for trainer.max_staleness > 0")


@frozen
class Placement(Section):
  actor: Mesh = section(Mesh, "the actor's devices and mesh")
  reference: Mesh = section(Mesh, "the reference model's devices and mesh")
  critic: Mesh = section(Mesh, "the critic's devices and mesh")
  reward: Mesh = section(Mesh, "a reward model's devices and mesh")
  rollout: RolloutDevices = section(RolloutDevices, "where rollouts are generated")


@frozen
class Health(Section):
  kl_max: float = key(1.0, "warn above this KL to the reference, nats per token; 0 = off")
  length_fraction: float = key(0.25, "warn when the mean response length falls below this x "
                               "its first steps' mean")
  baseline_steps: int = key(3, "the first steps that set the length and entropy baselines")
  patience: int = key(3, "steps a length / entropy signal must hold")
  zero_reward_steps: int = key(20, "warn after this many steps of mean reward exactly 0")
  min_entropy: float = key(0.02, "warn below this policy entropy, nats per token")
  clip_idle_steps: int = key(10, "warn after this many steps of PPO clip fraction exactly 0")
  eval_drop: float = key(0.05, "warn when held-out accuracy falls this far below its best")


@frozen
class Trainer(Section):
  total_steps: int = key(20, "RL steps", core=True, check=P)
  eval_every: int = key(5, "held-out evaluation every K steps", core=True,
                        check=Positive(allow_zero=True, note=" (0 = no evaluation)"))
  eval_reward: str = key("math", "the evaluation's verifier: math | math_lenient | any "
                         "registered reward", core=True)
  log_samples: int = key(4, "held-out samples logged per evaluation (samples.jsonl)",
                         check=Whole(True, " (0 = no samples)"))
  save_every: int = key(10, "checkpoint every K steps and at the end", core=True,
                        check=Positive(allow_zero=True,
                                       note=" (0 = a checkpoint only at the end)"))
  keep: int = key(3, "keep the last N checkpoints",
                  check=Positive(allow_zero=True, note=" (0 = keep every checkpoint)"))
  async_save: bool = key(True, "write checkpoints in the background")
  deterministic: bool = key(False, "bitwise-equal results on any data-parallel layout "
                            "(docs/reproducibility.md)")
  max_staleness: int = key(0, "asynchronous RL: batch j from policy max(0, j - K)",
                           check=Positive(allow_zero=True, note=" (0 = the synchronous loop)"))
  health: Health = section(Health, "training-health warnings (observe/health.py)")
  stop_on_collapse: bool = key(False, "stop on a collapse signal, naming the last checkpoint")
  compile_cache_dir: str = key(compile_cache_dir(), "JAX's persistent compilation cache",
                               core=True, check=Folder("no compile cache"))
  compile_ahead: str = key("auto", "compile every shape a run can meet up front: auto (with "
                           "the cache) | always | never", check=Option("compile_ahead"))
  compile_overlap: bool = key(True, "compile the first step's training programs while its "
                              "rollout runs")


@frozen
class Wandb(Section):
  enabled: bool = key(False, "log to Weights & Biases (pip install 'distflow-jax[wandb]')")
  project: str = key("distflow-jax", "the wandb project")
  name: str = key("", "the wandb run's name; '' = the config's name")
  mode: str = key("", "'' = wandb's own (WANDB_MODE, else online) | online | offline")


@frozen
class Logging(Section):
  wandb: Wandb = section(Wandb, "Weights & Biases logging")
  heartbeat_s: float = key(15.0, "while a long phase prints nothing, a line every N seconds",
                           check=InRange(0, note=" (seconds between the lines of a long phase; "
                                         "0 = off)"))


@frozen
class Sft(Section):
  steps: int = key(200, "`distflow-jax sft` steps", check=P)
  lr: float = key(1e-4, "the peak learning rate", check=LearningRate())
  batch_size: int = key(16, "global rows per step", check=P)
  warmup_steps: int = key(20, "linear warm-up to lr, then cosine decay",
                          check=Positive(allow_zero=True, note=" (0 = no warm-up)"))
  weight_decay: float = key(0.0, "decoupled weight decay", check=InRange(0))
  grad_clip: float = key(1.0, "global-norm clip", check=InRange(0, note=" (0 = no clipping)"))
  eval_every: int = key(50, "held-out loss every K steps",
                        check=Positive(allow_zero=True, note=" (0 = no evaluation)"))
  eval_size: int = key(64, "held-out rows: of --eval_data, else split off data.train",
                       check=Positive(allow_zero=True, note=" (0 = no held-out rows)"))
  save_every: int = key(100, "checkpoint every K steps and at the end",
                        check=Positive(allow_zero=True,
                                       note=" (0 = a checkpoint only at the end)"))
  keep: int = key(2, "keep the last N checkpoints",
                  check=Positive(allow_zero=True, note=" (0 = keep every checkpoint)"))
  out: str = key("", "the final Hugging Face folder; '' = <run_dir>/sft/model")


@frozen
class Config(Section):
  name: str = key("run", "the run's name", core=True)
  seed: int = key(0, "the run's seed", core=True)
  run_dir: str = key("runs/default", "checkpoints, metrics and samples go here", core=True)
  plugins: tuple = key((), "modules imported before the DAG is validated (they may register "
                       "nodes, rewards, losses)", core=True)
  cluster: Cluster = section(Cluster, "processes and devices; 0 = take them from jax")
  model: Model = section(Model, "the model", core=True)
  data: Data = section(Data, "prompts and their loading", core=True)
  rollout: Rollout = section(Rollout, "generation", core=True)
  actor: Actor = section(Actor, "the policy's training", core=True)
  critic: Critic = section(Critic, "the value model's training (PPO)")
  reference: Reference = section(Reference, "the reference model (no settings)")
  reward: Reward = section(Reward, "rule and model rewards", core=True)
  algo: Algo = section(Algo, "advantage estimation", core=True)
  placement: Placement = section(Placement, "where each role runs")
  trainer: Trainer = section(Trainer, "the loop: steps, evaluation, checkpoints", core=True)
  logging: Logging = section(Logging, "where train logs besides metrics.jsonl and TensorBoard")
  sft: Sft = section(Sft, "`distflow-jax sft`: supervised fine-tuning")
  entry: str = key("", "the DAG's entry node; '' = the single generate node")
  dag: list = open_key(list, "the workflow: nodes with id, role, type, deps (docs/dag.md)",
                       core=True)

  # What the keys above fix between them, computed in one place each (the load-time checks
  # call the same functions on the ml_collections config).
  @property
  def row_tokens(self) -> int:
    """A padded training row's tokens: the longest prompt plus the response width."""
    return response.row_tokens(self)

  @property
  def longest_sample(self) -> int:
    """The tokens a pass feeds for the longest sample (a packed row's least length)."""
    return response.longest_sample(self)

  @property
  def image_key(self) -> str:
    """The row field holding the run's images ('' for a text-only run)."""
    return vision_checks.run_image_key(self)
