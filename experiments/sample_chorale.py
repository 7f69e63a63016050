"""Sample a chorale from a JSB model trained by `python -m experiments.jsb` into a MIDI file.

    python -m experiments.jsb --preset smoke --out runs/jsb_smoke              # train first
    python -m experiments.sample_chorale --run runs/jsb_smoke/pope --out chorale.mid
    python -m experiments.sample_chorale --run runs/jsb/rope --model-seed 3 --prime-steps 16 \\
        --temperature 0.9 --top-p 0.95 --seed 1 --out primed.mid

--run is one encoding's folder, OUT/<encoding>/, where all seeds of that encoding trained side
by side: pick one with --seed-index (its position in run.json's seeds) or --model-seed (its
seed); the latest checkpoint is read. The prompt is BOS, then with --prime-steps N the first N
16th-note steps of a test chorale (--prime-chorale), which the file keeps before the sampled
steps. Decoding uses the KV cache of `pope_jax.generation`; BOS (an input only) is never
sampled, so the file holds exactly --steps new steps.

The MIDI file (`pope_jax.data.midi`) has four tracks, soprano, alto, tenor, bass, on channels
0..3; a step lasts --ticks-per-step ticks at 480 per quarter note (120: a 16th note) at --bpm
quarter notes per minute (default 80; chorales are usually sung at 60-100). JSB has no onset
token, so a pitch held over consecutive steps is one note; a silent step is no note.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from experiments import common
from pope_jax import generation
from pope_jax.data import jsb, midi
from pope_jax.tasks import jsb as task


def main(argv: list[str] | None = None) -> np.ndarray:
  parser = common.make_parser("sample_chorale", __doc__)
  parser.add_argument("--run", type=common.existing_dir, required=True,
                      help="one encoding's folder, OUT/<encoding> of experiments.jsb")
  which = parser.add_mutually_exclusive_group()
  which.add_argument("--seed-index", type=common.nonnegative_int,
                     help="the model: position of its seed among those trained (default: 0)")
  which.add_argument("--model-seed", type=common.nonnegative_int,
                     help="the model: the seed it was trained with")
  parser.add_argument("--steps", type=common.positive_int, default=128,
                      help="16th-note steps to sample (16 per 4/4 bar)")
  parser.add_argument("--prime-steps", type=common.nonnegative_int, default=0,
                      help="continue the first N steps of a test chorale (0: from BOS alone)")
  parser.add_argument("--prime-chorale", type=common.nonnegative_int, default=0,
                      help="index of the priming chorale in the test split")
  common.add_sampling_flags(parser, temperature=1.0)
  parser.add_argument("--ticks-per-step", type=common.positive_int, default=midi.TICKS_PER_STEP,
                      help="MIDI ticks per step at 480 per quarter note")
  parser.add_argument("--bpm", type=common.positive_float, default=midi.DEFAULT_BPM,
                      help="tempo, quarter notes per minute")
  parser.add_argument("--out", type=Path, default=Path("chorale.mid"), help="MIDI file to write")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  args = parser.parse_args(argv)
  if args.out.is_dir():
    parser.error(f"--out {args.out} is a folder; give a file name such as chorale.mid")
  try:
    config, seeds = task.run_seeds(args.run)
    generation.Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    midi.steps_to_midi(np.zeros((0, 4), int), ticks_per_step=args.ticks_per_step, bpm=args.bpm)
  except (FileNotFoundError, KeyError, TypeError, ValueError) as e:
    parser.error(str(e))
  index = 0 if args.seed_index is None else args.seed_index
  if index >= len(seeds):
    parser.error(f"--seed-index {index}: {args.run} trained {len(seeds)} seeds "
                 f"({', '.join(map(str, seeds))})")
  if args.model_seed is not None and args.model_seed not in seeds:
    parser.error(f"--model-seed {args.model_seed}: {args.run} trained seeds "
                 f"{', '.join(map(str, seeds))}")
  prime = None
  if args.prime_steps:
    test = jsb.load_chorales()["test"]
    if args.prime_chorale >= len(test):
      parser.error(f"--prime-chorale {args.prime_chorale}: the test split has {len(test)}")
    prime = test[args.prime_chorale][:args.prime_steps]
    if len(prime) < args.prime_steps:
      parser.error(f"--prime-steps {args.prime_steps}: test chorale {args.prime_chorale} has "
                   f"{len(prime)} steps")

  seed = seeds[index] if args.model_seed is None else args.model_seed
  config, params, seed = task.load_run(args.run, seed)
  bar = tqdm(total=4 * args.steps, desc="tokens", disable=args.no_progress)
  steps = task.sample_chorale(
      config, params, num_steps=args.steps, key=jax.random.key(args.seed), prime=prime,
      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
      on_token=lambda i: bar.update(1))
  bar.close()
  args.out.parent.mkdir(parents=True, exist_ok=True)
  midi.write_midi(args.out, steps, ticks_per_step=args.ticks_per_step, bpm=args.bpm)
  notes = sum(len(midi.voice_notes(v)) for v in steps.T)
  primed = 0 if prime is None else len(prime)
  print(f"wrote {args.out}: {len(steps)} steps ({primed} primed, {len(steps) - primed} "
        f"sampled), {notes} notes; {config.pos_encoding} model, seed {seed}", flush=True)
  return steps


if __name__ == "__main__":
  main()
