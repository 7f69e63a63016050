"""Indirect indexing at sizes a 2-core CPU could train: does any show the RoPE/PoPE gap early?

Eight variants of the cpu preset (task length and shift range, shift 0 allowed or not, 2-4
layers, learning rate), each trained 8 000 steps with seeds 0 and 1 vmapped; recorded in
docs/results/indirect_indexing.md. One process per (config, encoding):

  python scripts/ii_small_config_sweep.py CONFIG ENCODING OUT    # SWEEP_STEPS overrides 8000
"""
import dataclasses, json, sys
from pathlib import Path
from experiments import indirect_indexing as ii
from pope_jax.data import indirect_indexing as task

base = ii.PRESETS["cpu"]
def cfg(name, *, layers=2, d=128, lmin=10, lmax=16, shift=3, zero=True, lr=1e-3,
        steps=int(__import__("os").environ.get("SWEEP_STEPS", 8000))):
  return name, dataclasses.replace(
      base,
      task=task.IndirectIndexingConfig(min_length=lmin, max_length=lmax, max_shift=shift,
                                       allow_zero_shift=zero),
      model=dataclasses.replace(base.model, num_layers=layers, d_model=d),
      train=dataclasses.replace(base.train, steps=steps, learning_rate=lr, min_learning_rate=lr / 10,
                                eval_every=1000, checkpoint_every=100000, eval_batches=8,
                                steps_per_call=50, data_workers=1))
CONFIGS = dict([
  cfg("A_2L_cpu"), cfg("B_4L_cpu", layers=4), cfg("C_4L_5-8_s1", layers=4, lmin=5, lmax=8, shift=1),
  cfg("D_2L_cpu_nozero", zero=False), cfg("E_3L_6-10_s2", layers=3, lmin=6, lmax=10, shift=2),
  cfg("F_2L_cpu_lr3e-3", lr=3e-3), cfg("G_4L_cpu_nozero", layers=4, zero=False),
  cfg("H_2L_5-8_s1_nozero", lmin=5, lmax=8, shift=1, zero=False),
])
if __name__ == "__main__":
  name, enc, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
  rows = ii.run_encoding(CONFIGS[name], enc, [0, 1], out / name, resume=False, progress=False)
  print(name, enc, json.dumps([{k: r[k] for k in r if "accuracy" in k} for r in rows]), flush=True)
