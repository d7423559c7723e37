"""User environments for the multi-turn tests (loaded through config.plugins or named as
``plugin_envs:Class``): a scripted tool environment and ones that misbehave."""

import math
import time

from distflow_jax.envs import base, parsers


class Scripted:
  """Answers every turn with a fixed observation; done after ``turns`` steps; reward 1 for
  a turn that made a complete <tool> call, else 0.  Records what it was given (class-level log)."""
  turns = 3
  log: list = []

  def __init__(self):
    self.steps = 0

  def reset(self, row):
    Scripted.log.append(("reset", dict(row)))
    return " obs0 "

  def step(self, action_text):
    Scripted.log.append(("step", action_text))
    self.steps += 1
    reward = 1.0 if parsers.tool_parser("tag").parse(action_text) is not None else 0.0
    return f" result {self.steps} ", reward, self.steps >= self.turns


class ScoresCut(Scripted):
  """Scripted, with a step that takes the ``truncated`` keyword: it logs what it was told
  and scores a cut turn -1 (an environment's own choice)."""

  def step(self, action_text, truncated=False):
    Scripted.log.append(("truncated", truncated))
    obs, reward, done = super().step(action_text)
    return obs, -1.0 if truncated else reward, done


class Raises(Scripted):
  def step(self, action_text):
    raise KeyError("no such tool")


class Hangs(Scripted):
  def step(self, action_text):
    time.sleep(60)
    return "", 0.0, True


class NotText(Scripted):
  def step(self, action_text):
    return 42, 0.0, False


class NanReward(Scripted):
  def step(self, action_text):
    return "ok", math.nan, False


class Leaky(Scripted):
  """Shows the answer in its first observation: an evaluation must not credit the model."""
  def reset(self, row):
    return f" {row['answer']} \n"


class HostileCalc:
  """The built-in calculator (envs/calc.py) handed abusive calls in place of the model's
  turns: each turn's text (of any episode) is replaced by the next of ``CALLS``; records
  the observations."""
  CALLS = ("<tool>calc(9**9**9)</tool>", "<tool>calc(__import__('os').system('x'))</tool>",
           "<tool>calc(" + "9" * 40 + "*" + "9" * 20 + ")</tool>", "<tool>calc(" + "(" * 30
           + ")</tool>", "<tool>calc(1/0)</tool>", "<tool>exec(1)</tool>")
  seen: list = []

  def __init__(self):
    from distflow_jax.envs import calc
    self.env = calc.CalcEnv()

  def reset(self, row):
    return self.env.reset(row)

  def step(self, action_text):
    call = self.CALLS[len(HostileCalc.seen) % len(self.CALLS)]
    out = self.env.step(call)
    HostileCalc.seen.append(out[0])
    return out


for _name, _cls in (("scripted", Scripted), ("hostile_calc", HostileCalc), ("leaky", Leaky), ("raises", Raises), ("hangs", Hangs),
                    ("not_text", NotText), ("nan_reward", NanReward)):
  if _name not in base.env_names():
    base.register_env(_name, _cls)
