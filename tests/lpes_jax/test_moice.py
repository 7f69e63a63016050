"""MoICE (`lpes_jax.moice`, `lpes_jax.moice_training`) on a tiny random Llama: the mixture
against a float64 NumPy reference, reductions to the base model, the load-balancing loss by
hand, gradients against finite differences, router-only training, cached decoding, save/load."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpes_jax import generate, moice, moice_training
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import Llama, init_params
from pope_jax import rope_attention

CFG = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                  eos_token_ids=(1,), pad_token_id=0)
MCFG = moice.MoiceConfig(bases=(10000.0, 17500.0, 25000.0), top_k=2)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


def _batch(seed=1, b=3, t=10):
  tokens = jax.random.randint(jax.random.key(seed), (b, t), 2, CFG.vocab_size)
  mask = jnp.ones((b, t), bool).at[0, :3].set(False).at[1, :1].set(False)
  return tokens, mask


def _routers(mcfg=MCFG, std=0.7, seed=2):
  return moice.init_routers(jax.random.key(seed), CFG, mcfg, std=std)


def _apply(params, tokens, mask, routers=None, mcfg=MCFG, config=CFG):
  attention = None if routers is None else moice.moice_attention(routers, config, mcfg)
  return Llama(config).apply({"params": params}, tokens, attention_mask=mask,
                             attention=attention)


# ---------------------------------------------------------------------------------------------
# One layer against a float64 reference


def _rope64(x, pos, base):
  h = x.shape[-1]
  freqs = base ** (-np.arange(0, h, 2) / h)
  ang = pos[:, :, None, None] * freqs                                     # [B, T, 1, H/2]
  x1, x2 = x[..., : h // 2], x[..., h // 2:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                         x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def _moice_layer_reference(w, q, k, v, pos, bases, top_k):
  """Float64 NumPy: router on q rotated by bases[0], top-K renormalised softmax, mixture of the
  causal attention outputs of each base."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  w = {n: np.asarray(a, np.float64) for n, a in w.items()}
  qr = _rope64(q, pos, bases[0])
  a1, a3 = qr @ w["w1"], qr @ w["w3"]
  logits = (a1 / (1 + np.exp(-a1)) * a3) @ w["w2"]                       # [B, T, N, E]
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
  p = np.where(logits >= kth, p, 0.0)
  p /= p.sum(-1, keepdims=True)
  rep = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
  T = q.shape[1]
  causal = np.tril(np.ones((T, T), bool))
  out = 0.0
  for e, base in enumerate(bases):
    s = np.einsum("btnh,bsnh->bnts", _rope64(q, pos, base), _rope64(k, pos, base))
    s = np.where(causal, s / np.sqrt(q.shape[-1]), -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    out = out + p[..., e, None] * np.einsum("bnts,bsnh->btnh", a, v)
  return out


def test_moice_layer_matches_float64_reference():
  B, T, N, K, H = 2, 7, 4, 2, 8
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (B, T, N, H))
  k = jax.random.normal(ks[1], (B, T, K, H))
  v = jax.random.normal(ks[2], (B, T, K, H))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  routers = _routers()
  attend = functools.partial(rope_attention, is_causal=True, implementation="xla")
  out, sown = moice.moice_attention(routers, CFG, MCFG)(1, q, k, v, q_positions=pos,
                                                        attend=attend)
  w = {n: leaf[1] for n, leaf in routers.items()}
  ref = _moice_layer_reference(w, q, k, v, np.asarray(pos), MCFG.bases, MCFG.top_k)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
  assert sown["router_logits"].shape == (B, T, N, MCFG.num_experts)


def test_routing_weights_keep_the_top_k_and_sum_to_one():
  logits = jnp.array([[0.0, 2.0, 1.0, -1.0]])
  w = np.asarray(moice.routing_weights(logits, 2))
  p = np.exp([2.0, 1.0])
  np.testing.assert_allclose(w, [[0.0, p[0] / p.sum(), p[1] / p.sum(), 0.0]], rtol=1e-6)
  np.testing.assert_allclose(moice.routing_weights(logits, 4), jax.nn.softmax(logits), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Reductions to the base model


def test_one_expert_at_the_model_base_is_the_base_model(params):
  tokens, mask = _batch()
  mcfg = moice.MoiceConfig(bases=(CFG.rope_theta,), top_k=1)
  out = _apply(params, tokens, mask, _routers(mcfg), mcfg)
  np.testing.assert_array_equal(out, _apply(params, tokens, mask))


def test_top1_on_the_model_base_among_seven_is_the_base_model(params):
  """Zero routers: equal logits, top-1 keeps the first expert (the model's base) alone."""
  tokens, mask = _batch()
  mcfg = dataclasses.replace(moice.paper_config(CFG.rope_theta), top_k=1)
  zeros = jax.tree.map(jnp.zeros_like, _routers(mcfg))
  out = _apply(params, tokens, mask, zeros, mcfg)
  np.testing.assert_array_equal(out, _apply(params, tokens, mask))


def test_top1_on_another_expert_is_the_model_with_that_base(params):
  """W1 = W3 makes silu(x)·x >= 0, so a positive W2 column wins top-1 for every head and token."""
  tokens, mask = _batch()
  mcfg = moice.MoiceConfig(bases=(CFG.rope_theta, 31000.0), top_k=1)
  r = _routers(mcfg)
  r = {"w1": r["w1"], "w3": r["w1"], "w2": jnp.zeros_like(r["w2"]).at[:, :, 1].set(1.0)}
  out = _apply(params, tokens, mask, r, mcfg)
  other = dataclasses.replace(CFG, rope_theta=31000.0)
  np.testing.assert_allclose(out, _apply(params, tokens, mask, config=other), atol=1e-5)
  assert not np.allclose(out, _apply(params, tokens, mask), atol=1e-3)


def test_paper_config_scales_the_released_bases_to_the_model():
  mcfg = moice.paper_config(100000.0)
  assert mcfg.bases[0] == 100000.0 and mcfg.bases[-1] == 250000.0
  assert (mcfg.num_experts, mcfg.top_k, mcfg.aux_loss_coef) == (7, 7, 0.3)


# ---------------------------------------------------------------------------------------------
# Losses and gradients


def test_load_balancing_loss_by_hand():
  # Two real tokens routed top-1 to expert 0 with p = (σ(2), 1 − σ(2)); a padded token that
  # would go to expert 1 is left out. Loss = E · f_0 · P_0 = 2 · σ(2).
  logits = jnp.array([[2.0, 0.0], [2.0, 0.0], [0.0, 5.0]])[None, None, :, None, :]  # [1,1,3,1,2]
  mask = jnp.array([[True, True, False]])
  sig = 1 / (1 + np.exp(-2.0))
  np.testing.assert_allclose(moice.load_balancing_loss(logits, 1, mask), 2 * sig, rtol=1e-6)
  uniform = jnp.zeros((2, 3, 5, 4, 7))
  np.testing.assert_allclose(moice.load_balancing_loss(uniform, 1), 1.0, rtol=1e-6)
  rand = jax.random.normal(jax.random.key(0), (2, 3, 5, 4, 7))
  np.testing.assert_allclose(moice.load_balancing_loss(rand, 7), 7.0, rtol=1e-6)


def test_lm_loss_counts_real_next_tokens_only():
  logits = jnp.log(jnp.array([[[0.5, 0.5], [0.25, 0.75], [0.9, 0.1]]]))   # [1, 3, 2]
  tokens = jnp.array([[0, 0, 1]])
  mask = jnp.array([[False, True, True]])      # pad, then 2 real tokens: t = 1 predicts t = 2
  np.testing.assert_allclose(moice_training.lm_loss(logits, tokens, mask), -np.log(0.75),
                             rtol=1e-6)


@pytest.mark.slow
def test_router_gradient_matches_finite_differences(params):
  """With top-K = E (smooth: no selection jumps under the perturbation)."""
  tokens, mask = _batch(t=6)
  mcfg = dataclasses.replace(MCFG, top_k=MCFG.num_experts)
  routers = _routers(mcfg, std=0.5)
  loss = lambda r: moice_training.moice_loss(r, params, tokens, mask, CFG, mcfg)[0]
  grad = jax.grad(loss)(routers)
  d = jax.tree.map(lambda x, k: jax.random.normal(k, x.shape),
                   routers, {"w1": jax.random.key(5), "w2": jax.random.key(6),
                             "w3": jax.random.key(7)})
  eps = 1e-2
  shift = lambda s: jax.tree.map(lambda r, dd: r + s * eps * dd, routers, d)
  fd = (loss(shift(1)) - loss(shift(-1))) / (2 * eps)
  ad = sum(jnp.vdot(g, dd) for g, dd in zip(jax.tree.leaves(grad), jax.tree.leaves(d)))
  assert abs(float(ad)) > 1e-4
  np.testing.assert_allclose(ad, fd, rtol=2e-2)


def test_training_lowers_the_loss_and_changes_only_the_routers(params):
  tokens, mask = _batch(b=4, t=12)
  tokens, mask = tokens.reshape(2, 2, 12), mask.reshape(2, 2, 12)
  tcfg = moice_training.RouterTrainConfig(steps=6, batch_size=4, micro_batch=2,
                                          learning_rate=3e-2)
  opt = moice_training.make_optimizer(tcfg)
  step = moice_training.make_train_step(CFG, MCFG, opt)
  routers = start = _routers(std=0.02)
  opt_state = opt.init(routers)
  frozen = jax.tree.map(np.array, params)
  losses = []
  for _ in range(tcfg.steps):
    routers, opt_state, metrics = step(routers, opt_state, params, tokens, mask)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 1e-3, losses
  jax.tree.map(np.testing.assert_array_equal, params, frozen)
  assert all(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(routers),
                                                   jax.tree.leaves(start)))


def _data(seed, n, t=12):
  tokens, mask = _batch(seed=seed, b=n, t=t)
  return moice_training.TrainData(np.asarray(tokens), np.asarray(mask))


@pytest.mark.slow
def test_one_constant_lr_run_serves_every_budget_with_heldout_metrics(params, tmp_path):
  """The snapshot after s steps equals a run of budget s; held-out metrics at the snapshots; the
  data pool is cycled; router entropy is at most log E and near it for a fresh router."""
  tcfg = moice_training.RouterTrainConfig(steps=5, batch_size=4, micro_batch=2,
                                          learning_rate=3e-2)
  data, heldout = _data(1, 8), _data(9, 4)          # A pool of 2 steps, cycled over 5.
  run = lambda steps, folder, **kw: moice_training.train_routers(
      CFG, params, data, MCFG, dataclasses.replace(tcfg, steps=steps), tmp_path / folder,
      run_info={"steps": steps}, log=lambda _: None, **kw)
  long = run(5, "long", heldout=heldout, snapshot_steps=(1, 3))
  short = run(3, "short")
  held = [h["step"] for h in long["history"] if "heldout_loss" in h]
  assert held == [1, 3, 5]
  snapshot, _ = moice.load_routers(tmp_path / "long" / "step_3", CFG)
  jax.tree.map(np.testing.assert_array_equal, snapshot, jax.device_get(short["routers"]))
  log_e = np.log(MCFG.num_experts)
  entropy = [h["router_entropy"] for h in long["history"]]
  assert all(0 < e <= log_e + 1e-6 for e in entropy) and entropy[0] > 0.9 * log_e
  # Steps 1 and 3 train on the same sequences (pool of two batches).
  assert long["history"][0]["loss"] != long["history"][1]["loss"]
  with pytest.raises(ValueError, match="multiple of batch_size 4"):
    moice_training.train_routers(CFG, params, _data(1, 6), MCFG, tcfg, tmp_path / "bad",
                                 run_info={})
  with pytest.raises(ValueError, match=r"snapshot_steps \(9,\) must lie in 1..5"):
    moice_training.train_routers(CFG, params, data, MCFG, tcfg, tmp_path / "bad2", run_info={},
                                 snapshot_steps=(9,))


def test_router_entropy_by_hand():
  logits = jnp.log(jnp.asarray([[0.5, 0.25, 0.25], [1.0, 1e-30, 1e-30]]))[None, None, :, None]
  mask = jnp.asarray([[True, False]])
  want = -(0.5 * np.log(0.5) + 2 * 0.25 * np.log(0.25))
  np.testing.assert_allclose(moice.router_entropy(logits, mask), want, rtol=1e-6)
  np.testing.assert_allclose(moice.router_entropy(logits), want / 2, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Decoding with the KV cache


@pytest.mark.slow
def test_cached_greedy_decoding_equals_recomputing(params):
  tokens, mask = _batch(b=3, t=8)
  routers = _routers(std=0.7)
  attention = moice.moice_attention(routers, CFG, MCFG)
  G = 5
  cached = generate.greedy_tokens(CFG, params, tokens, mask, None, G, attention=attention)
  seq, m = tokens, mask
  model = Llama(CFG)
  for g in range(G):
    logits = model.apply({"params": params}, seq, attention_mask=m, attention=attention)
    nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    np.testing.assert_array_equal(nxt, cached[:, g])
    seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
    m = jnp.concatenate([m, jnp.ones((m.shape[0], 1), bool)], axis=1)
  # The logits too, not only their argmax: prefill + one cached step against one full pass.
  step = generate.llama_step(CFG, params, None, attention=attention)
  cache = generate.init_kv_cache(CFG, 3, 9)
  _, cache = step(tokens, mask, cache)
  last, _ = step(cached[:, :1], jnp.ones((3, 1), bool), cache)
  full = model.apply({"params": params}, seq[:, :9], attention_mask=m[:, :9], attention=attention)
  np.testing.assert_allclose(last, full[:, -1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Saving, loading and bad inputs


def test_routers_round_trip_and_refuse_another_model(tmp_path):
  routers = _routers()
  moice.save_routers(tmp_path, routers, MCFG, CFG)
  back, mcfg = moice.load_routers(tmp_path, CFG)
  assert mcfg == MCFG
  jax.tree.map(np.testing.assert_array_equal, back, routers)
  deeper = dataclasses.replace(CFG, num_layers=3)
  with pytest.raises(moice.RoutersMismatch, match=r"w1 has shape \(2, 8, 3\).*3 layers"):
    moice.load_routers(tmp_path, deeper)
  wider = dataclasses.replace(CFG, head_dim=16, hidden_size=64)
  with pytest.raises(moice.RoutersMismatch, match="head dim 16"):
    moice.load_routers(tmp_path, wider)


def test_missing_or_foreign_router_folders_are_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="is not a folder"):
    moice.load_routers(tmp_path / "none")
  with pytest.raises(FileNotFoundError, match="holds no trained routers"):
    moice.load_routers(tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    (dict(bases=()), "MoiceConfig.bases must name"),
    (dict(bases=(1e4, -1.0)), "MoiceConfig.bases"),
    (dict(bases=(1e4, 2e4), top_k=3), r"MoiceConfig.top_k must be in \[1, 2\]"),
    (dict(bases=(1e4,), top_k=1, aux_loss_coef=-1.0), "MoiceConfig.aux_loss_coef"),
])
def test_bad_moice_config(kwargs, message):
  with pytest.raises(ValueError, match=message):
    moice.MoiceConfig(**kwargs)


def test_bad_train_config():
  with pytest.raises(ValueError, match="batch_size .* multiple of micro_batch"):
    moice_training.RouterTrainConfig(batch_size=6, micro_batch=4)


def test_lpes_eval_generator_decodes_with_the_saved_routers(params, tmp_path):
  from lpes_jax import evaluate
  routers = _routers()
  moice.save_routers(tmp_path, routers, MCFG, CFG)
  gen = evaluate.method_generator(CFG, params, evaluate.EvalConfig(
      method="moice", moice_routers=str(tmp_path)))
  tokens, mask = _batch()
  want = generate.greedy_tokens(CFG, params, tokens, mask, None, 4,
                                attention=moice.moice_attention(routers, CFG, MCFG))
  np.testing.assert_array_equal(gen(tokens, mask, 4), want)
  with pytest.raises(ValueError, match="needs moice_routers"):
    evaluate.EvalConfig(method="moice")
