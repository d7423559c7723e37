"""The optional JetStream adapter: a real `engine_api.Engine` where JetStream imports."""

import importlib

import jax
import numpy as np
import pytest

from distflow_jax.rollout import jetstream_adapter
from test_rollout_engine import PROMPTS, engine, full_forward_greedy, peaky_model


def _jetstream_importable():
  try:
    importlib.import_module("jetstream.engine.engine_api")
    return True
  except Exception:  # ImportError or its own import-time failures
    return False


HAVE_JETSTREAM = _jetstream_importable()


@pytest.mark.skipif(HAVE_JETSTREAM, reason="JetStream is installed; the import-error path "
                    "cannot be exercised")
def test_missing_jetstream_raises_a_clear_import_error():
  with pytest.raises(ImportError, match="distflow-jax\\[jetstream\\]"):
    jetstream_adapter.as_jetstream(engine())


@pytest.mark.skipif(not HAVE_JETSTREAM, reason="optional jetstream extra (google-jetstream) not "
                    "installed or not importable under this JAX")
@pytest.mark.timeout(300)
def test_adapter_is_a_jetstream_engine_and_decodes_greedily():
  from jetstream.engine import engine_api
  model = peaky_model()
  js = jetstream_adapter.as_jetstream(engine())
  assert isinstance(js, engine_api.Engine)
  params = js.load_params(model)
  state = js.init_decode_state()
  prompt = PROMPTS[0]
  padded = np.zeros(8, np.int32)
  padded[:len(prompt)] = prompt
  prefix, first = js.prefill(params=params, padded_tokens=padded, true_length=len(prompt))
  got = [int(first.get_result_at_slot(0).tokens[0, 0])]
  state = js.insert(prefix, state, 1)
  for _ in range(7):
    state, result = js.generate(params, state)
    slot = result.get_result_at_slot(1)
    if slot.valid[0, 0]:
      got.append(int(slot.tokens[0, 0]))
  assert got == full_forward_greedy(model, prompt, 8)
