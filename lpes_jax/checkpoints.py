"""Checkpoint loading: Hugging Face safetensors folders and GGUF files → Llama params.

Two plain name maps (`hf_name_map`, `gguf_name_map`) from our Flax parameter paths to the
checkpoint's tensor names, plus per-tensor transforms kept apart from the names:
  * Dense kernels are the transposed [out, in] weights;
  * GGUF q/k rows (and biases) are un-permuted from llama.cpp's interleaved-pair order back to
    Hugging Face's half-split order — with the query head count for q and the kv head count for k,
    and only for the architectures llama.cpp permutes (llama, mistral), never qwen2.
Every tensor's shape is asserted; missing, unexpected and duplicate names fail loudly, naming them,
before anything is converted. Safetensors are memory-mapped and converted one tensor at a time in
layer order, so peak host memory is about one tensor beyond the params themselves.

Shape letters: D model width, N query heads, K kv heads, H head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from lpes_jax.config import DTYPES, LlamaConfig
from lpes_jax.llama import Llama
from lpes_jax.tokenizer import GGUF_VOCABULARIES, llama_cpp_defaults
from pope_jax.dtypes import canonical_dtype

Path = tuple[str, ...]
# Buffers some checkpoints store that carry no weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
GGUF_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                        "Q5_K", "Q6_K")
GGUF_PERMUTED_ARCHITECTURES = ("llama", "mistral")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One parameter: our Flax path, the checkpoint name, the checkpoint shape and its transform."""
  path: Path
  name: str
  shape: tuple[int, ...]
  transform: str = "none"   # "none", "transpose"; GGUF adds "unpermute_q", "unpermute_k".


def _layer_specs(cfg: LlamaConfig, i: int, names: dict[str, str]) -> list[TensorSpec]:
  d, n, kh, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                    cfg.intermediate_size)
  p = (f"layers_{i}",)
  specs = [
      TensorSpec(p + ("input_layernorm", "weight"), names["attn_norm"], (d,)),
      TensorSpec(p + ("self_attn", "q_proj", "kernel"), names["q"], (n * h, d), "transpose"),
      TensorSpec(p + ("self_attn", "k_proj", "kernel"), names["k"], (kh * h, d), "transpose"),
      TensorSpec(p + ("self_attn", "v_proj", "kernel"), names["v"], (kh * h, d), "transpose"),
      TensorSpec(p + ("self_attn", "o_proj", "kernel"), names["o"], (d, n * h), "transpose"),
      TensorSpec(p + ("post_attention_layernorm", "weight"), names["mlp_norm"], (d,)),
      TensorSpec(p + ("mlp", "gate_proj", "kernel"), names["gate"], (f, d), "transpose"),
      TensorSpec(p + ("mlp", "up_proj", "kernel"), names["up"], (f, d), "transpose"),
      TensorSpec(p + ("mlp", "down_proj", "kernel"), names["down"], (d, f), "transpose"),
  ]
  if cfg.qkv_bias:
    specs += [
        TensorSpec(p + ("self_attn", "q_proj", "bias"), names["q_bias"], (n * h,)),
        TensorSpec(p + ("self_attn", "k_proj", "bias"), names["k_bias"], (kh * h,)),
        TensorSpec(p + ("self_attn", "v_proj", "bias"), names["v_bias"], (kh * h,)),
    ]
  if cfg.o_bias:
    specs.append(TensorSpec(p + ("self_attn", "o_proj", "bias"), names["o_bias"], (d,)))
  return specs


def hf_name_map(cfg: LlamaConfig) -> list[TensorSpec]:
  """Our params ↔ Hugging Face `LlamaForCausalLM` / `Qwen2ForCausalLM` tensor names, in layer order."""
  specs = [TensorSpec(("embed_tokens", "embedding"), "model.embed_tokens.weight",
                      (cfg.vocab_size, cfg.hidden_size))]
  for i in range(cfg.num_layers):
    a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    specs += _layer_specs(cfg, i, {
        "attn_norm": f"model.layers.{i}.input_layernorm.weight",
        "mlp_norm": f"model.layers.{i}.post_attention_layernorm.weight",
        "q": f"{a}.q_proj.weight", "k": f"{a}.k_proj.weight", "v": f"{a}.v_proj.weight",
        "o": f"{a}.o_proj.weight", "q_bias": f"{a}.q_proj.bias", "k_bias": f"{a}.k_proj.bias",
        "v_bias": f"{a}.v_proj.bias", "o_bias": f"{a}.o_proj.bias",
        "gate": f"{m}.gate_proj.weight", "up": f"{m}.up_proj.weight",
        "down": f"{m}.down_proj.weight"})
  specs.append(TensorSpec(("norm", "weight"), "model.norm.weight", (cfg.hidden_size,)))
  if not cfg.tie_word_embeddings:
    specs.append(TensorSpec(("lm_head", "kernel"), "lm_head.weight",
                            (cfg.vocab_size, cfg.hidden_size), "transpose"))
  return specs


def gguf_name_map(cfg: LlamaConfig) -> list[TensorSpec]:
  """Our params ↔ llama.cpp GGUF tensor names (shapes in numpy order = HF [out, in])."""
  permute = cfg.model_type in GGUF_PERMUTED_ARCHITECTURES
  specs = [TensorSpec(("embed_tokens", "embedding"), "token_embd.weight",
                      (cfg.vocab_size, cfg.hidden_size))]
  for i in range(cfg.num_layers):
    b = f"blk.{i}"
    layer = _layer_specs(cfg, i, {
        "attn_norm": f"{b}.attn_norm.weight", "mlp_norm": f"{b}.ffn_norm.weight",
        "q": f"{b}.attn_q.weight", "k": f"{b}.attn_k.weight", "v": f"{b}.attn_v.weight",
        "o": f"{b}.attn_output.weight", "q_bias": f"{b}.attn_q.bias",
        "k_bias": f"{b}.attn_k.bias", "v_bias": f"{b}.attn_v.bias",
        "o_bias": f"{b}.attn_output.bias", "gate": f"{b}.ffn_gate.weight",
        "up": f"{b}.ffn_up.weight", "down": f"{b}.ffn_down.weight"})
    if permute:
      layer = [dataclasses.replace(s, transform=s.transform + "+unpermute_q")
               if s.name.startswith(f"{b}.attn_q.") else
               dataclasses.replace(s, transform=s.transform + "+unpermute_k")
               if s.name.startswith(f"{b}.attn_k.") else s for s in layer]
    specs += layer
  specs.append(TensorSpec(("norm", "weight"), "output_norm.weight", (cfg.hidden_size,)))
  if not cfg.tie_word_embeddings:
    specs.append(TensorSpec(("lm_head", "kernel"), "output.weight",
                            (cfg.vocab_size, cfg.hidden_size), "transpose"))
  return specs


def unpermute_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute` (convert_hf_to_gguf.py): interleaved pairs → half-split.

  llama.cpp stores, per head, rows in order (0, H/2, 1, H/2+1, ...) so that its interleaved RoPE
  matches Hugging Face's rotate_half; this restores HF row order.

  Args:
    w: [n_head·H, ...] weight (or bias) rows of q (n_head = N) or k (n_head = K).
    n_head: N for q, K for k.

  Returns:
    Same shape, rows reordered.
  """
  if w.shape[0] % (2 * n_head):
    raise ValueError(f"cannot un-permute {w.shape[0]} rows into {n_head} heads of even size")
  half = w.shape[0] // n_head // 2
  return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _apply_transform(w: np.ndarray, spec: TensorSpec, cfg: LlamaConfig) -> np.ndarray:
  for step in spec.transform.split("+"):
    if step == "unpermute_q":
      w = unpermute_llama_cpp(w, cfg.num_heads)
    elif step == "unpermute_k":
      w = unpermute_llama_cpp(w, cfg.num_kv_heads)
  if "transpose" in spec.transform:
    w = w.T
  return w


def _check_names(specs: list[TensorSpec], available: set[str], ignorable: set[str],
                 where: str) -> None:
  expected = {s.name for s in specs}
  missing = sorted(expected - available)
  unexpected = sorted(available - expected - ignorable)
  if missing:
    raise ValueError(f"{where}: missing tensors {missing[:20]}"
                     f"{' and more' if len(missing) > 20 else ''} ({len(missing)} in all)")
  if unexpected:
    raise ValueError(f"{where}: unexpected tensors {unexpected[:20]}"
                     f"{' and more' if len(unexpected) > 20 else ''} ({len(unexpected)} in all)")


def convert(specs: list[TensorSpec], get: Callable[[str], np.ndarray], cfg: LlamaConfig,
            where: str, *, locate: Callable[[str], str] | None = None) -> dict[str, Any]:
  """Builds the params tree tensor by tensor: load, assert shape and dtype, transform, cast.

  Floating-point tensors of any precision are cast to `cfg.dtype`; integer, boolean or complex
  tensors are refused (quantised or corrupt checkpoints, not weights to cast silently).

  Args:
    specs: the name map, in load order.
    get: tensor name → numpy array.
    cfg: the model config (`cfg.dtype` is the parameter dtype).
    where: the checkpoint, named in errors.
    locate: tensor name → the file holding it, named in dtype errors (default: `where`).

  Raises:
    ValueError: a tensor's shape differs from the spec (names tensor, expected, got), or its dtype
      is not floating point (names tensor, dtype and file).
  """
  dtype = jnp.dtype(cfg.dtype)
  params: dict[str, Any] = {}
  for spec in specs:
    w = get(spec.name)
    if tuple(w.shape) != spec.shape:
      raise ValueError(f"{where}: tensor {spec.name!r} has shape {tuple(w.shape)}, expected "
                       f"{spec.shape}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
      raise ValueError(f"{locate(spec.name) if locate else where}: tensor {spec.name!r} has "
                       f"dtype {w.dtype}; weights must be floating point (they are cast to "
                       f"{cfg.dtype})")
    w = _apply_transform(np.asarray(w), spec, cfg)
    node = params
    for key in spec.path[:-1]:
      node = node.setdefault(key, {})
    node[spec.path[-1]] = jnp.asarray(w).astype(dtype)
  return params


def _check_tree(params: dict[str, Any], cfg: LlamaConfig) -> None:
  """The loaded tree has exactly the model's parameter paths and shapes."""
  model = Llama(cfg)
  ref = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  ref_shapes = jax.tree_util.tree_map(lambda x: x.shape, ref["params"])
  got_shapes = jax.tree_util.tree_map(lambda x: x.shape, params)
  if ref_shapes != got_shapes:
    raise AssertionError("loaded parameter tree does not match the model's")


# --- Hugging Face folders -------------------------------------------------------------------------

def _read_json(path: str) -> dict:
  """A JSON object from `path`; ValueError naming the file if it is not one."""
  try:
    with open(path) as fh:
      obj = json.load(fh)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(obj, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
  return obj


def _safetensors_files(folder: str) -> tuple[dict[str, str], list[str]]:
  """name → file for a folder's model.safetensors or sharded index; also the files list."""
  from safetensors import safe_open

  index_path = os.path.join(folder, "model.safetensors.index.json")
  single = os.path.join(folder, "model.safetensors")
  if os.path.exists(index_path):
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index_path}: no 'weight_map' object (tensor name -> shard file)")
    files = sorted(set(weight_map.values()))
  elif os.path.exists(single):
    weight_map, files = None, ["model.safetensors"]
  else:
    raise FileNotFoundError(f"{folder}: neither model.safetensors nor "
                            f"model.safetensors.index.json found")
  located: dict[str, str] = {}
  for fname in files:
    path = os.path.join(folder, fname)
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path}: shard listed in the index is missing")
    try:
      with safe_open(path, framework="numpy") as f:
        names = list(f.keys())
    except Exception as e:  # safetensors raises its own error type for corrupt headers.
      raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    for name in names:
      if name in located:
        raise ValueError(f"tensor {name!r} appears in both {located[name]} and {fname}")
      located[name] = fname
  if weight_map is not None:
    for name, fname in weight_map.items():
      if located.get(name) != fname:
        raise ValueError(f"{index_path}: tensor {name!r} is listed in {fname} but found in "
                         f"{located.get(name)}")
    extra = sorted(set(located) - set(weight_map))
    if extra:
      raise ValueError(f"{index_path}: tensors {extra[:20]} are in the shards but not the index")
  return located, files


def load_hf_config(folder: str, *, dtype: Any = "float32", **overrides) -> LlamaConfig:
  """LlamaConfig from `folder/config.json`.

  Raises:
    FileNotFoundError: no config.json. ValueError: unsupported settings.
  """
  path = os.path.join(folder, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{folder}: missing config.json")
  dtype = canonical_dtype(dtype, argument="dtype", allowed=DTYPES)
  d = _read_json(path)
  cfg = LlamaConfig.from_hf_dict(d, dtype=dtype, source=path)
  return dataclasses.replace(cfg, **overrides) if overrides else cfg


def load_hf(folder: str, *, dtype: Any = "float32", **overrides) -> tuple[LlamaConfig, dict]:
  """Loads a Hugging Face folder (config.json + model.safetensors or sharded index).

  With tie_word_embeddings = true an extra `lm_head.weight` is accepted and ignored (the tied
  embedding is used, as transformers does); with false, a missing `lm_head.weight` is an error.

  Returns:
    (config, params).

  Raises:
    FileNotFoundError / ValueError: missing files, unreadable headers, missing / unexpected /
    duplicate tensors, shape mismatches.
  """
  from safetensors import safe_open

  cfg = load_hf_config(folder, dtype=dtype, **overrides)
  located, files = _safetensors_files(folder)
  specs = hf_name_map(cfg)
  ignorable = {n for n in located if n.endswith(_IGNORED_SUFFIXES)}
  if cfg.tie_word_embeddings:
    ignorable.add("lm_head.weight")
  _check_names(specs, set(located), ignorable, folder)
  handles = {f: safe_open(os.path.join(folder, f), framework="numpy") for f in files}
  try:
    params = convert(specs, lambda name: handles[located[name]].get_tensor(name), cfg, folder,
                     locate=lambda name: os.path.join(folder, located[name]))
  finally:
    handles.clear()
  _check_tree(params, cfg)
  return cfg, params


# --- GGUF -----------------------------------------------------------------------------------------

def _open_gguf(path: str):
  import gguf  # Imported here: only GGUF loading needs it.
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no such GGUF file")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # The reader raises ValueError/IndexError/struct errors on bad files.
    raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt: {e})") from e


def gguf_metadata(reader, *, skip_arrays: bool = True) -> dict[str, Any]:
  """GGUF key/value metadata as Python values (large token arrays skipped unless asked)."""
  out = {}
  for key, field in reader.fields.items():
    if skip_arrays and key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                               "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
      continue
    out[key] = field.contents()
  return out


def dequantize_gguf_tensor(tensor, *, where: str = "GGUF") -> np.ndarray:
  """A GGUF tensor as float32 in numpy order ([out, in] for matrices).

  Raises:
    ValueError: quantisation type not in GGUF_SUPPORTED_TYPES (names tensor and type).
  """
  from gguf.quants import dequantize
  qtype = tensor.tensor_type
  if qtype.name not in GGUF_SUPPORTED_TYPES:
    raise ValueError(f"{where}: tensor {tensor.name!r} has unsupported quantisation type "
                     f"{qtype.name}; supported: {GGUF_SUPPORTED_TYPES}")
  return np.asarray(dequantize(tensor.data, qtype), dtype=np.float32)


def _gguf_attention_biases(cfg: LlamaConfig, names: set[str], path: str) -> LlamaConfig:
  """llama and mistral GGUFs may carry attention biases (llama.cpp loads `attn_q/k/v.bias` and
  `attn_output.bias` as optional tensors of LLM_ARCH_LLAMA); read which from block 0. Every block
  must then have them (else `_check_names` names the missing ones).

  Raises:
    ValueError: some but not all of block 0's q/k/v biases (named).
  """
  if cfg.model_type not in GGUF_PERMUTED_ARCHITECTURES:
    return cfg
  qkv = [f"blk.0.attn_{x}.bias" for x in "qkv"]
  present = [n for n in qkv if n in names]
  if present and len(present) < 3:
    raise ValueError(f"{path}: q/k/v biases must come together; found {present}, missing "
                     f"{sorted(set(qkv) - set(present))}")
  return dataclasses.replace(cfg, qkv_bias=bool(present),
                             o_bias="blk.0.attn_output.bias" in names)


def load_gguf(path: str, *, dtype: Any = "float32", **overrides) -> tuple[LlamaConfig, dict]:
  """Loads a llama.cpp GGUF file: config from metadata, tensors dequantised to float32.

  Returns:
    (config, params), params cast to `dtype`.

  Raises:
    FileNotFoundError / ValueError: unreadable or truncated file, unsupported architecture or
    quantisation type, missing / unexpected / duplicate tensors, shape mismatches. llama and
    mistral files with attention biases load them (`_gguf_attention_biases`). A file without
    BOS/EOS ids gets llama.cpp's defaults (`lpes_jax.tokenizer.llama_cpp_defaults`).
    TypeError / ValueError: `dtype` is not a float32/bfloat16/float16 dtype (checked first).
  """
  dtype = canonical_dtype(dtype, argument="dtype", allowed=DTYPES)
  reader = _open_gguf(path)
  meta = gguf_metadata(reader)
  arch_vocab = f"{meta.get('general.architecture')}.vocab_size"
  if arch_vocab not in meta and "tokenizer.ggml.tokens" in reader.fields:
    meta[arch_vocab] = len(reader.fields["tokenizer.ggml.tokens"].data)  # As llama.cpp counts.
  tensors: dict[str, Any] = {}
  for t in reader.tensors:
    if t.name in tensors:
      raise ValueError(f"{path}: duplicate tensor {t.name!r}")
    tensors[t.name] = t
  if "rope_freqs.weight" in tensors:
    raise ValueError(f"{path}: per-frequency RoPE factors (rope_freqs.weight, llama3 scaling) "
                     f"are not supported for GGUF")
  cfg = LlamaConfig.from_gguf_metadata(meta, tied="output.weight" not in tensors, dtype=dtype,
                                       source=path)
  cfg = _gguf_attention_biases(cfg, set(tensors), path)
  kind = meta.get("tokenizer.ggml.model")
  if kind in GGUF_VOCABULARIES:  # A silent file gets llama.cpp's BOS/EOS ids, as the tokenizer.
    _, bos, eos = llama_cpp_defaults(kind, meta.get("tokenizer.ggml.pre"))
    if "tokenizer.ggml.bos_token_id" not in meta and bos < cfg.vocab_size:
      cfg = dataclasses.replace(cfg, bos_token_id=bos)
    if "tokenizer.ggml.eos_token_id" not in meta and eos < cfg.vocab_size:
      cfg = dataclasses.replace(cfg, eos_token_ids=(eos,))
  if overrides:
    cfg = dataclasses.replace(cfg, **overrides)
  specs = gguf_name_map(cfg)
  _check_names(specs, set(tensors), set(), path)
  for spec in specs:  # Check every type before dequantising anything.
    if tensors[spec.name].tensor_type.name not in GGUF_SUPPORTED_TYPES:
      dequantize_gguf_tensor(tensors[spec.name], where=path)
  params = convert(specs, lambda name: dequantize_gguf_tensor(tensors[name], where=path), cfg,
                   path)
  _check_tree(params, cfg)
  return cfg, params


def load_checkpoint(path: str, *, dtype: Any = "float32", **overrides) -> tuple[LlamaConfig, dict]:
  """(config, params) from a Hugging Face folder or a .gguf file.

  Args:
    path: folder with config.json, or a .gguf file.
    dtype: parameter dtype as JAX users write it (`jnp.float32`, `np.dtype("float16")`, "bf16",
      ...); the config stores its canonical name.
    overrides: LlamaConfig fields to replace (e.g. attention_implementation="cudnn").

  Raises:
    FileNotFoundError: path is neither a folder nor a file.
    TypeError, ValueError: `dtype` is not a float32/bfloat16/float16 dtype (checked first).
    ValueError: a file of a Hugging Face folder (config.json, *.safetensors) instead of the
      folder, or contents that do not load (named by file and field or tensor).
  """
  dtype = canonical_dtype(dtype, argument="dtype", allowed=DTYPES)
  if os.path.isdir(path):
    return load_hf(path, dtype=dtype, **overrides)
  if os.path.basename(path) == "config.json" or path.endswith((".safetensors", ".index.json")):
    raise ValueError(f"{path}: pass the Hugging Face model folder that holds it "
                     f"({os.path.dirname(path) or '.'}), not the file")
  if path.endswith(".gguf") or os.path.isfile(path):
    return load_gguf(path, dtype=dtype, **overrides)
  raise FileNotFoundError(f"{path}: neither a model folder nor a GGUF file")

