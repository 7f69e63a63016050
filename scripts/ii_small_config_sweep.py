"""Indirect indexing at sizes a 2-core CPU could train: does any show the RoPE/PoPE gap early?

Eight variants of the cpu preset (task length and shift range, shift 0 allowed or not, 2-4
layers, learning rate), each trained 8 000 steps with seeds 0 and 1 vmapped; recorded in
docs/results/indirect_indexing.md. One process per (config, encoding); a tqdm bar per run, and
OUT/CONFIG/ENCODING/{metrics.jsonl,result.json} as `experiments.indirect_indexing` writes them:

  python scripts/ii_small_config_sweep.py CONFIG ENCODING OUT    # SWEEP_STEPS overrides 8000
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

from experiments import indirect_indexing as ii
from pope_jax.data import indirect_indexing as task

STEPS = int(os.environ.get("SWEEP_STEPS", 8000))


def variant(*, layers=2, lmin=10, lmax=16, shift=3, zero=True, lr=1e-3) -> ii.Preset:
  """The cpu preset with another task, depth or learning rate; evaluation every 1 000 steps."""
  base = ii.PRESETS["cpu"]
  return dataclasses.replace(
      base,
      task=task.IndirectIndexingConfig(min_length=lmin, max_length=lmax, max_shift=shift,
                                       allow_zero_shift=zero),
      model=dataclasses.replace(base.model, num_layers=layers),
      train=dataclasses.replace(base.train, steps=STEPS, learning_rate=lr,
                                min_learning_rate=lr / 10, eval_every=1000,
                                checkpoint_every=100_000, eval_batches=8, steps_per_call=50,
                                data_workers=1))


CONFIGS = {
    "A_2L_cpu": variant(),
    "B_4L_cpu": variant(layers=4),
    "C_4L_5-8_s1": variant(layers=4, lmin=5, lmax=8, shift=1),
    "D_2L_cpu_nozero": variant(zero=False),
    "E_3L_6-10_s2": variant(layers=3, lmin=6, lmax=10, shift=2),
    "F_2L_cpu_lr3e-3": variant(lr=3e-3),
    "G_4L_cpu_nozero": variant(layers=4, zero=False),
    "H_2L_5-8_s1_nozero": variant(lmin=5, lmax=8, shift=1, zero=False),
}

if __name__ == "__main__":  # Guarded: grain's worker processes re-import this module.
  if len(sys.argv) != 4 or sys.argv[1] not in CONFIGS or sys.argv[2] not in ii.ENCODINGS:
    raise SystemExit(f"usage: python scripts/ii_small_config_sweep.py CONFIG ENCODING OUT\n"
                     f"CONFIG: {', '.join(CONFIGS)}; ENCODING: {', '.join(ii.ENCODINGS)}")
  name, encoding, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
  runs = ii.run_encoding(CONFIGS[name], encoding, [0, 1], out / name, resume=False,
                         progress=True)
  print(name, encoding, json.dumps([{k: r[k] for k in r if "accuracy" in k} for r in runs]))
