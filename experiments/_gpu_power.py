"""SM clock, board power and time per call while a jitted function runs back to back (a helper,
no CLI).

Used by `experiments.bench_attention --power`. A GPU under its board power limit lowers its SM
clock ("SW power cap"), so a kernel that executes more tensor-core work per call can lose more
clock than its baseline under sustained load than in a short burst. `sustained_run` times a
first window of calls at the idle clock and then back-to-back windows for a few seconds, while
`nvidia-smi` samples the SM clock, the board power and the clock-event reasons.
"""

from __future__ import annotations

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


def power_limit_w() -> float:
  """The board power limit in W (`nvidia-smi --query-gpu=power.limit`, first GPU)."""
  out = subprocess.run([require_nvidia_smi(), "--query-gpu=power.limit",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True,
                       check=True).stdout
  return float(out.split()[0])


def parse_samples(lines: list[str]) -> list[dict]:
  """`nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_event_reasons.active
  --format=csv,noheader,nounits` lines -> [{"sm_mhz", "power_w", "reasons"}]; lines that do not
  parse (a partial last line, "[N/A]") are skipped."""
  samples = []
  for line in lines:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != len(QUERY):
      continue
    try:
      samples.append({"sm_mhz": float(fields[0]), "power_w": float(fields[1]),
                      "reasons": int(fields[2], 16)})
    except ValueError:
      continue
  return samples


def summarize(windows_ms: list[float], samples: list[dict]) -> dict:
  """Burst and sustained time per call, and the clock and power over the run.

  Args:
    windows_ms: ms per call of each window, in order (the first at the idle clock).
    samples: `parse_samples` output over the same run.

  Returns:
    {"burst_ms": the first window, "sustained_ms": the median of the second half of the windows,
    "sm_mhz_median", "sm_mhz_min", "power_w_median", "power_w_max", "power_capped_share": share
    of samples with the SW power cap reason}.

  Raises:
    ValueError: no window or no sample.
  """
  if not windows_ms or not samples:
    raise ValueError(f"nothing to summarise: {len(windows_ms)} windows, {len(samples)} samples")
  clocks = [s["sm_mhz"] for s in samples]
  power = [s["power_w"] for s in samples]
  return {"burst_ms": windows_ms[0],
          "sustained_ms": float(np.median(windows_ms[len(windows_ms) // 2:])),
          "sm_mhz_median": float(np.median(clocks)), "sm_mhz_min": min(clocks),
          "power_w_median": float(np.median(power)), "power_w_max": max(power),
          "power_capped_share": float(np.mean([bool(s["reasons"] & SW_POWER_CAP)
                                               for s in samples]))}


def sustained_run(fn, *args, seconds: float = 4.0, calls_per_window: int = 10,
                  idle_s: float = 2.0, interval_ms: int = 50) -> dict:
  """Runs `fn(*args)` back to back for `seconds` in windows of `calls_per_window` calls, after
  `idle_s` without work (so the clock starts from idle), while nvidia-smi samples every
  `interval_ms`.

  Returns:
    `summarize`'s dict plus "windows_ms" and "samples".

  Raises:
    RuntimeError: nvidia-smi is missing, or it wrote no sample.
  """
  smi = require_nvidia_smi()
  jax.block_until_ready(fn(*args))  # compiled and warm before the idle pause
  time.sleep(idle_s)
  sampler = subprocess.Popen([smi, f"--query-gpu={','.join(QUERY)}",
                              "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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
    lines = sampler.communicate()[0].splitlines()
  samples = parse_samples(lines)
  if not samples:
    raise RuntimeError(f"nvidia-smi wrote no sample in {seconds} s ({len(lines)} lines)")
  return {**summarize(windows_ms, samples), "windows_ms": windows_ms, "samples": samples}
