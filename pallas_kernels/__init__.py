"""Pallas GPU kernels (Mosaic GPU, Hopper).

Imports only jax, numpy and its own modules (never `pope_jax`): the caller passes checked
positions, the frequencies and the clamped phase bias.

Public API: `pallas_kernels.pope_attention.pope_attention` (forward and backward), its
`is_supported` / `unsupported_reason` / `platform_reason`; block sizes in `pope_attention_config`;
named benchmark and test shapes in `shapes`. `pallas_kernels.decode_attention.decode_attention`:
split-K attention of T <= 16 new queries over a KV cache of mapped keys (decoding). Imported lazily by `pope_jax.attention`
(`implementation="pallas"`), so a CPU-only install loads it only if asked.
"""
