"""Environments (issue 35): tool-call parsers, the registry, the guarded calls."""

import time

import pytest

from distflow_jax.config.loading import ConfigError
from distflow_jax.envs import base, guard, parsers
import plugin_envs

pytestmark = pytest.mark.timeout(60)


def test_tag_parser_finds_the_first_complete_call():
  p = parsers.tool_parser("tag")
  text = "think <tool>add(2, 3)</tool> more <tool>x()</tool>"
  end = p.call_end(text)
  assert text[:end] == "think <tool>add(2, 3)</tool>"
  assert p.parse(text) == parsers.ToolCall("add", "2, 3")
  assert p.call_end("<tool>add(2, 3)</to") is None  # not complete yet
  assert p.call_end("no call") is None
  assert p.parse("<tool>2 + 3</tool>").error


def test_hermes_parser_reads_qwen_tool_calls():
  p = parsers.tool_parser("hermes")
  text = 'x <tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call> tail'
  assert text[:p.call_end(text)].endswith("</tool_call>")
  assert p.parse(text) == parsers.ToolCall("calc", {"expr": "2+3"})
  assert p.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == \
      parsers.ToolCall("f", {"a": 1})
  assert "not JSON" in p.parse("<tool_call>{oops</tool_call>").error
  assert p.parse('<tool_call>{"arguments": {}}</tool_call>').error


def test_unknown_parser_is_one_line():
  with pytest.raises(ConfigError, match="rollout.tool_parser='xml'.*tag, hermes"):
    parsers.tool_parser("xml")


def test_registry_by_name_and_module_class():
  assert base.env_factory("scripted") is plugin_envs.Scripted
  assert base.env_factory("plugin_envs:Raises") is plugin_envs.Raises
  with pytest.raises(ConfigError, match="'nope' is not a registered environment"):
    base.env_factory("nope")
  with pytest.raises(ConfigError, match="cannot import 'no_such_mod'"):
    base.env_factory("no_such_mod:Env")
  with pytest.raises(ConfigError, match="has no class or callable 'Missing'"):
    base.env_factory("plugin_envs:Missing")


@pytest.mark.parametrize("cls,needle", [
    (plugin_envs.Raises, "step raised KeyError"),
    (plugin_envs.NotText, "int observation"),
    (plugin_envs.NanReward, "reward nan"),
])
def test_bad_step_ends_the_episode_or_stops(cls, needle):
  g = guard.EnvGuard("bad", 5.0, guard.OnEnvError.END)
  assert g.step(cls(), "text", 7) is None and g.errors == 1
  g = guard.EnvGuard("bad", 5.0, guard.OnEnvError.STOP)
  with pytest.raises(guard.EnvFailure) as e:
    g.step(cls(), "text", 7)
  assert needle in str(e.value) and "'bad'" in str(e.value) and "sample id 7" in str(e.value)


def test_a_hung_step_times_out():
  g = guard.EnvGuard("hangs", 0.3, guard.OnEnvError.END)
  t0 = time.monotonic()
  assert g.step(plugin_envs.Hangs(), "text", 3) is None
  assert time.monotonic() - t0 < 5 and g.errors == 1


def test_a_good_step_passes_through():
  g = guard.EnvGuard("scripted", 5.0, guard.OnEnvError.STOP)
  env = plugin_envs.Scripted()
  assert g.reset(env, {"prompt": "p"}, 0) == " obs0 "
  assert g.step(env, "<tool>f()</tool>", 0) == guard.Step(" result 1 ", 1.0, False)
