"""Analyses of trained models: frequency usage (magnitudes by hand, capture from a real model)
and perplexity by length."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pope_jax import analysis
from pope_jax.config import ModelConfig
from pope_jax.model import Transformer


def test_frequency_magnitudes_by_hand():
  x = jnp.array([3.0, 0.0, 1.0, 4.0, 2.0, 5.0])   # H = 6
  # Half-split pairs (0, 3), (1, 4), (2, 5): |(3, 4)| = 5, |(0, 2)| = 2, |(1, 5)| = sqrt(26).
  np.testing.assert_allclose(analysis.frequency_magnitudes(x, "rope"), [5, 2, np.sqrt(26)],
                             rtol=1e-6)
  # Interleaved pairs (0, 1), (2, 3), (4, 5).
  np.testing.assert_allclose(analysis.frequency_magnitudes(x, "rope", rope_layout="interleaved"),
                             [3, np.sqrt(17), np.sqrt(29)], rtol=1e-6)
  np.testing.assert_allclose(analysis.frequency_magnitudes(x, "pope"), np.log1p(np.exp(x)),
                             rtol=1e-6)
  with pytest.raises(ValueError):
    analysis.frequency_magnitudes(x, "none")


@pytest.mark.parametrize("enc", ["rope", "pope"])
def test_frequency_usage_matches_manual_projection(enc):
  cfg = ModelConfig(vocab_size=13, num_layers=2, d_model=16, num_heads=2, num_kv_heads=1,
                    pos_encoding=enc)
  tokens = jax.random.randint(jax.random.key(0), (2, 5), 0, 13)
  params = Transformer(cfg).init(jax.random.key(1), tokens)["params"]
  weights = np.ones((2, 5), np.float32)
  weights[1, 3:] = 0.0                                        # padding left out of the mean
  usage = analysis.frequency_usage(cfg, params, [{"inputs": tokens, "weights": weights}])
  f = 4 if enc == "rope" else 8
  assert usage["query"].shape == (2, f) and usage["key"].shape == (2, f)
  assert usage["frequencies"].shape == (f,) and usage["frequencies"][0] == 1.0
  # Layer 0 by hand: its input is RMSNorm(embedding).
  p0 = params["block_0"]
  x = params["embed"]["embedding"][tokens]
  x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p0["attn_norm"]["scale"]
  k = jnp.einsum("btd,dnh->btnh", x, p0["attn"]["key"]["kernel"])     # [B, T, 1, 8]
  mag = analysis.frequency_magnitudes(k, enc)
  want = (mag.mean(2) * weights[..., None]).sum((0, 1)) / weights.sum()
  np.testing.assert_allclose(usage["key"][0], want, rtol=1e-4)
  # Two batches give the token-weighted mean of the two.
  both = analysis.frequency_usage(cfg, params, [{"inputs": tokens, "weights": weights}] * 2)
  np.testing.assert_allclose(both["query"], usage["query"], rtol=1e-6)


def test_frequency_usage_errors():
  cfg = ModelConfig(vocab_size=5, num_layers=1, d_model=8, num_heads=2, pos_encoding="none")
  with pytest.raises(ValueError, match="pos_encoding"):
    analysis.frequency_usage(cfg, {}, [])
  cfg = ModelConfig(vocab_size=5, num_layers=1, d_model=8, num_heads=2, pos_encoding="pope")
  params = Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))["params"]
  with pytest.raises(ValueError, match="non-zero weight"):
    analysis.frequency_usage(cfg, params, [{"inputs": np.zeros((1, 3), np.int32),
                                            "weights": np.zeros((1, 3), np.float32)}])


def test_high_frequency_share_and_standard_errors_by_hand():
  usage = np.array([[3.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
  # Columns 0 and 1 are the higher-frequency half (column 0 = 1 rad/token).
  np.testing.assert_allclose(analysis.high_frequency_share(usage), [1.0, 0.5, 2 / 3])
  np.testing.assert_allclose(analysis.high_frequency_share(usage[None].repeat(2, 0)),
                             [[1.0, 0.5, 2 / 3]] * 2)
  # Means 2 and 1, sample variances 1 and 1, n 3 and 3: se = sqrt(2/3).
  gap, z = analysis.standard_errors_apart([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
  assert gap == 1.0 and z == pytest.approx(1 / np.sqrt(2 / 3))
  assert np.isnan(analysis.standard_errors_apart([1.0], [0.0, 1.0])[1])
  assert np.isnan(analysis.standard_errors_apart([1.0, 1.0], [0.0, 0.0])[1])


def test_usage_summary_and_contrast():
  from pope_jax.tasks import frequency_usage as fu
  def run(*rows):                                  # [L, F] rows of one seed
    return {"query": np.array(rows), "key": np.array(rows), "frequencies": np.ones(4)}
  # Layer 0 is not checked; in layer 1 PoPE puts 60-62 % in the high half, RoPE 20-30 %.
  usage = {"rope": [run([1, 1, 1, 1], [1, 1, 4, 4]), run([9, 1, 0, 0], [1, 2, 3, 4])],
           "pope": [run([1, 1, 1, 1], [3, 3, 2, 2]), run([0, 0, 1, 1], [3, 2, 2, 1])]}
  summary = fu.summarize_usage(usage)
  rope = summary["encodings"]["rope"]["query"]
  np.testing.assert_allclose(rope["share_per_seed"], [[0.5, 0.2], [1.0, 0.3]])
  np.testing.assert_allclose(rope["share_mean"], [0.75, 0.25])
  np.testing.assert_allclose(rope["share_sd"], [np.sqrt(0.125), np.sqrt(0.005)])
  np.testing.assert_allclose(rope["mean"], [[5, 1, 0.5, 0.5], [1, 1.5, 3.5, 4]])
  c = summary["contrast"]
  assert c["layers"] == [1] and c["appears"] and c["rope_below_half"]
  np.testing.assert_allclose(c["key"]["gap"][1], 0.6125 - 0.25)
  assert c["query"]["standard_errors"][1] > 0
  assert c["statement"].startswith("The paper's contrast appears")
  text = fu.usage_markdown(summary)
  assert "| rope | query | 2 | 75.0 ± 35.4 | 25.0 ± 7.1 |" in text
  # One seed each, PoPE below RoPE: no standard error, the contrast does not appear.
  one = fu.summarize_usage({"rope": usage["pope"][:1], "pope": usage["rope"][:1]})
  assert not one["contrast"]["appears"] and "standard errors" not in one["contrast"]["statement"]
  assert "| pope | key | 1 | 50.0 | 20.0 |" in fu.usage_markdown(one)


def test_perplexity_by_length(tmp_path):
  from pope_jax.data import text
  text.write_tokens(tmp_path / "valid.bin", np.arange(200) % 13, vocab_size=13)
  cfg = ModelConfig(vocab_size=13, num_layers=1, d_model=16, num_heads=2, pos_encoding="pope")
  params = Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  got = analysis.perplexity_by_length(cfg, params, tmp_path / "valid.bin", [8, 16], batch_size=3,
                                      max_tokens=32)
  assert sorted(got) == [8, 16] and got[8]["windows"] == 4 and got[16]["windows"] == 2
  # Window 0 of length 8 by hand.
  tokens = np.arange(9) % 13
  logits = Transformer(cfg).apply({"params": params}, tokens[None, :-1])
  nll = -jax.nn.log_softmax(logits)[0, np.arange(8), tokens[1:]]
  one = analysis.perplexity_by_length(cfg, params, tmp_path / "valid.bin", [8], max_tokens=8)
  np.testing.assert_allclose(one[8]["loss"], nll.mean(), rtol=1e-5)
  assert one[8]["perplexity"] == pytest.approx(np.exp(one[8]["loss"]))
  with pytest.raises(ValueError, match="GiB"):
    analysis.perplexity_by_length(cfg, params, tmp_path / "valid.bin", [8, 100_000],
                                  memory_budget=2**30)


def test_perplexity_by_length_compiles_once_per_config(tmp_path):
  """A second model of the same config (another seed) reuses the compiled programs, with its own
  parameters."""
  from pope_jax.data import text
  text.write_tokens(tmp_path / "valid.bin", np.arange(100) % 11, vocab_size=11)
  cfg = ModelConfig(vocab_size=11, num_layers=1, d_model=16, num_heads=2, pos_encoding="rope",
                    rope_base=77.0)
  model = Transformer(cfg)
  params = [model.init(jax.random.key(s), jnp.zeros((1, 8), jnp.int32))["params"] for s in (0, 1)]
  first = analysis.perplexity_by_length(cfg, params[0], tmp_path / "valid.bin", [8, 12],
                                        batch_size=2, max_tokens=24)
  programs = {k: v for k, v in analysis._EVAL_PROGRAMS.items() if k[0] == cfg}
  assert sorted(k[1:] for k in programs) == [(2, 8), (2, 12)]
  second = analysis.perplexity_by_length(cfg, params[1], tmp_path / "valid.bin", [12, 8],
                                         batch_size=2, max_tokens=24)
  assert {k: v for k, v in analysis._EVAL_PROGRAMS.items() if k[0] == cfg} == programs
  tokens = (np.arange(25) % 11).reshape(1, 25)     # The 2 windows of 12 by hand.
  windows = np.concatenate([tokens[:, :13], tokens[:, 12:25]])
  logp = jax.nn.log_softmax(model.apply({"params": params[1]}, windows[:, :-1]))
  nll = -np.take_along_axis(np.asarray(logp), windows[:, 1:, None], -1).mean()
  np.testing.assert_allclose(second[12]["loss"], nll, rtol=1e-5)
  assert second[12]["loss"] != first[12]["loss"]


def test_pope_jax_imports_neither_the_kernels_nor_the_clis():
  """Kernel-specific analysis lives in experiments/; pope_jax reaches the kernel only lazily."""
  import subprocess
  import sys
  code = ("import sys, pope_jax, pope_jax.analysis, pope_jax.reporting, pope_jax.tasks.jsb, "
          "pope_jax.tasks.indirect_indexing, pope_jax.tasks.language_model, "
          "pope_jax.tasks.length_extrapolation, pope_jax.tasks.frequency_usage; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in "
          "('pallas_kernels', 'experiments')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"
