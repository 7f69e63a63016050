"""SM clock, board power and time per call while a jitted function runs back to back (a helper,
no CLI).

Used by `experiments.bench_attention --power`. At its board power limit a GPU lowers its SM
clock ("SW power cap"). A kernel that draws more power per cycle then loses more clock under
sustained load than in a short burst. `sustained_run` times a first window of calls from an idle
GPU and then back-to-back windows for a few seconds, while `nvidia-smi` samples the SM clock,
the board power and the clock-event reasons of the GPU that JAX runs on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import jax
import numpy as np

QUERY = ("clocks.sm", "power.draw", "clocks_event_reasons.active")
SW_POWER_CAP = 0x4  # nvidia-smi clocks_event_reasons: software power scaling (board power limit)


def require_nvidia_smi() -> str:
  """The path of `nvidia-smi`. Raises RuntimeError (naming it) where it is not on PATH."""
  path = shutil.which("nvidia-smi")
  if path is None:
    raise RuntimeError("--power samples the GPU with nvidia-smi, which is not on PATH")
  return path


def gpu_id() -> str:
  """nvidia-smi's --id of the GPU behind JAX's first device: the first entry of
  CUDA_VISIBLE_DEVICES (an index or a UUID; nvidia-smi ignores that variable), else "0"."""
  return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"


def _query(fields: str, *extra: str) -> list[str]:
  return [require_nvidia_smi(), f"--id={gpu_id()}", f"--query-gpu={fields}",
          "--format=csv,noheader,nounits", *extra]


def power_limit_w() -> float:
  """The board power limit in W (`nvidia-smi --query-gpu=power.limit`, `gpu_id`).

  Raises:
    RuntimeError: nvidia-smi is missing or fails (its message included).
  """
  done = subprocess.run(_query("power.limit"), capture_output=True, text=True, timeout=30)
  try:
    return float(done.stdout.split()[0])
  except (IndexError, ValueError):
    raise RuntimeError(f"nvidia-smi gave no power limit: {(done.stderr or done.stdout)[:300]!r}")


def parse_samples(lines: list[str]) -> list[dict]:
  """`nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_event_reasons.active
  --format=csv,noheader,nounits` lines -> [{"sm_mhz" (MHz), "power_w" (W), "reasons" (int bit
  mask, or None where nvidia-smi prints "[N/A]")}]; lines without a clock and a power (a partial
  last line, "[N/A]") are skipped."""
  samples = []
  for line in lines:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != len(QUERY):
      continue
    try:
      sample = {"sm_mhz": float(fields[0]), "power_w": float(fields[1])}
    except ValueError:
      continue
    try:
      sample["reasons"] = int(fields[2], 16)
    except ValueError:
      sample["reasons"] = None
    samples.append(sample)
  return samples


def summarize(windows_ms: list[float], samples: list[dict]) -> dict:
  """Burst and sustained time per call, and the clock and power over the run.

  Args:
    windows_ms: ms per call of each window, in order (the first from the idle clock).
    samples: `parse_samples` output over the same run.

  Returns:
    {"burst_ms": the first window, "sustained_ms": the median of the second half of the windows,
    "sm_mhz_median", "sm_mhz_min", "power_w_median", "power_w_max", "power_capped_share": share
    of the samples with known reasons that have the SW power cap reason (nan if none known)}.

  Raises:
    ValueError: no window or no sample.
  """
  if not windows_ms or not samples:
    raise ValueError(f"nothing to summarise: {len(windows_ms)} windows, {len(samples)} samples")
  clocks = [s["sm_mhz"] for s in samples]
  power = [s["power_w"] for s in samples]
  capped = [bool(s["reasons"] & SW_POWER_CAP) for s in samples if s["reasons"] is not None]
  return {"burst_ms": windows_ms[0],
          "sustained_ms": float(np.median(windows_ms[len(windows_ms) // 2:])),
          "sm_mhz_median": float(np.median(clocks)), "sm_mhz_min": min(clocks),
          "power_w_median": float(np.median(power)), "power_w_max": max(power),
          "power_capped_share": float(np.mean(capped)) if capped else float("nan")}


def sustained_run(fn, *args, seconds: float = 4.0, calls_per_window: int = 10,
                  idle_s: float = 2.0, interval_ms: int = 50) -> dict:
  """Runs `fn(*args)` back to back, sampling the GPU.

  Args:
    fn, args: a jitted function and its arguments; one warm-up call runs first.
    seconds: how long the windows run (s).
    calls_per_window: calls per window, with one host sync at its end.
    idle_s: the pause without work before the first window (s), so it starts from idle.
    interval_ms: nvidia-smi's sampling interval (ms). Its power.draw is itself an average over
      about a second on current drivers.

  Returns:
    `summarize`'s dict plus "windows_ms" and "samples".

  Raises:
    ValueError: seconds or calls_per_window not positive.
    RuntimeError: nvidia-smi is missing, or it wrote no sample (its message included).
  """
  if seconds <= 0 or calls_per_window < 1:
    raise ValueError(f"seconds ({seconds}) and calls_per_window ({calls_per_window}) must be "
                     "positive")
  command = _query(",".join(QUERY), f"--loop-ms={interval_ms}")
  jax.block_until_ready(fn(*args))  # compiled and warm before the idle pause
  time.sleep(idle_s)
  sampler = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    windows_ms = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
      window_start = time.perf_counter()
      for _ in range(calls_per_window):
        out = fn(*args)
      jax.block_until_ready(out)
      windows_ms.append((time.perf_counter() - window_start) / calls_per_window * 1e3)
  finally:
    sampler.terminate()
    try:
      stdout, stderr = sampler.communicate(timeout=10)
    except subprocess.TimeoutExpired:
      sampler.kill()
      stdout, stderr = sampler.communicate()
  lines = stdout.splitlines()
  samples = parse_samples(lines)
  if not samples:
    raise RuntimeError(f"nvidia-smi wrote no sample in {seconds} s ({' '.join(command)}): "
                       f"{(stderr or ' / '.join(lines[:2]))[:300]!r}")
  return {**summarize(windows_ms, samples), "windows_ms": windows_ms, "samples": samples}
