"""Pallas GPU kernels (Mosaic GPU, Hopper).

Public API: `pallas_kernels.pope_attention.pope_attention` (fused PoPE attention, forward and
backward) and its `is_supported`; block sizes in `pope_attention_config`; named benchmark and test
shapes in `shapes`. Imported lazily by `pope_jax.attention` (`implementation="pallas"`), so a
CPU-only install never loads it unless asked.
"""
