"""dtype arguments of the Llama side as JAX users write them; errors name the argument."""

import jax.numpy as jnp
import numpy as np
import pytest

from lpes_jax import LlamaConfig, load_pretrained
from lpes_jax.checkpoints import load_checkpoint

SHAPE = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
             num_kv_heads=1, head_dim=4)


@pytest.mark.parametrize("dtype, name", [
    (jnp.bfloat16, "bfloat16"), (jnp.float32, "float32"), (np.dtype("float16"), "float16"),
    ("bf16", "bfloat16"), ("fp32", "float32"), ("float16", "float16"), (np.float32, "float32"),
])
def test_llama_config_stores_the_canonical_name(dtype, name):
  cfg = LlamaConfig(**SHAPE, dtype=dtype)
  assert cfg.dtype == name
  assert cfg == LlamaConfig(**SHAPE, dtype=name) and hash(cfg) == hash(LlamaConfig(**SHAPE,
                                                                                    dtype=name))


@pytest.mark.parametrize("dtype, error", [("int8", ValueError), (jnp.int32, ValueError),
                                          ("float128x", ValueError), (object(), TypeError)])
def test_llama_config_error_names_the_argument(dtype, error):
  with pytest.raises(error, match=r"^dtype must") as e:
    LlamaConfig(**SHAPE, dtype=dtype)
  assert "LlamaConfig" not in str(e.value)


@pytest.mark.parametrize("load", [load_pretrained, load_checkpoint])
def test_loaders_check_dtype_first_and_name_it(load, tmp_path):
  # A bad dtype fails before the (missing) file is opened.
  with pytest.raises(ValueError, match=r"^dtype must"):
    load(str(tmp_path / "missing.gguf"), dtype="int8")
  with pytest.raises(TypeError, match=r"^dtype must"):
    load(str(tmp_path / "missing.gguf"), dtype=object())
  with pytest.raises(FileNotFoundError):
    load(str(tmp_path / "missing"), dtype=jnp.bfloat16)   # A good dtype gets to the file check.


@pytest.mark.parametrize("dtype, name", [(jnp.float32, "float32"), (jnp.bfloat16, "bfloat16"),
                                         (np.dtype("float16"), "float16"), ("bf16", "bfloat16")])
def test_load_pretrained_takes_jax_dtypes(dtype, name):
  import jax
  from tests.lpes_jax.conftest import FIXTURES
  _, params, cfg = load_pretrained(f"{FIXTURES}/llama_mha_llama3", dtype=dtype)
  assert cfg.dtype == name
  assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(name)}
