"""Four-voice 16th-note grids (the JSB format of `pope_jax.data.jsb`) as standard MIDI files.

A grid is [U, 4] int MIDI pitches (soprano, alto, tenor, bass; -1 = silent), one row per 16th-note
step. It becomes a type-1 MIDI file (written with `mido`) of four tracks, one per voice, on
channels 0..3; the soprano track also carries the tempo and a 4/4 time signature.

JSB has no onset token: a held note repeats its pitch at every step. So a pitch repeated in
consecutive steps of a voice is one note (a re-struck note of the same pitch cannot be told
apart and is merged too), and a silent step is no note.

Timing: `TICKS_PER_BEAT` = 480 ticks per quarter note; a step lasts `ticks_per_step` ticks,
default 120 (a 16th note). The default tempo, 80 quarter notes per minute, sits in the 60–100
range at which Bach's chorales are usually sung.

Shape letters: U steps.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import mido
import numpy as np

VOICES = ("Soprano", "Alto", "Tenor", "Bass")
TICKS_PER_BEAT = 480
TICKS_PER_STEP = TICKS_PER_BEAT // 4      # a 16th note
DEFAULT_BPM = 80.0


class Note(NamedTuple):
  start: int    # first step
  end: int      # one past the last step
  pitch: int    # MIDI


def voice_notes(voice: np.ndarray) -> list[Note]:
  """The notes of one voice: runs of one pitch merged, silent steps (-1) skipped.

  Args:
    voice: [U] int MIDI pitches, -1 = silence.

  Returns:
    Notes in time order.
  """
  voice = np.asarray(voice).reshape(-1)
  notes, start = [], 0
  for u in range(1, len(voice) + 1):
    if u == len(voice) or voice[u] != voice[start]:
      if voice[start] >= 0:
        notes.append(Note(start, u, int(voice[start])))
      start = u
  return notes


def steps_to_midi(steps: np.ndarray, *, ticks_per_step: int = TICKS_PER_STEP,
                  bpm: float = DEFAULT_BPM, velocity: int = 80) -> mido.MidiFile:
  """A four-voice grid as a type-1 MIDI file, one track and channel per voice.

  Args:
    steps: [U, 4] int MIDI pitches in 0..127 (SATB columns), -1 = silence.
    ticks_per_step: ticks per step at 480 ticks per quarter (120: a step is a 16th note).
    bpm: tempo in quarter notes per minute.
    velocity: note-on velocity, 1..127.

  Returns:
    The file (save it with `.save(path)`).

  Raises:
    ValueError: steps not [U, 4], a pitch outside -1..127, ticks_per_step < 1, bpm <= 0, or a
      velocity outside 1..127.
  """
  steps = np.asarray(steps)
  if steps.ndim != 2 or steps.shape[1] != len(VOICES):
    raise ValueError(f"steps must be [U, 4] MIDI pitches (SATB), got shape {steps.shape}")
  if ((steps < -1) | (steps > 127)).any():
    raise ValueError("steps must hold MIDI pitches 0..127 or -1 for silence")
  if ticks_per_step < 1:
    raise ValueError(f"ticks_per_step must be >= 1, got {ticks_per_step}")
  if not 0 < bpm < float("inf") or not 0 < mido.bpm2tempo(bpm) < 2 ** 24:
    raise ValueError(f"bpm must be a tempo MIDI can store (about 4 to 60 million), got {bpm}")
  if not 1 <= velocity <= 127:
    raise ValueError(f"velocity must be in 1..127, got {velocity}")
  midi = mido.MidiFile(type=1, ticks_per_beat=TICKS_PER_BEAT)
  for channel, name in enumerate(VOICES):
    track = mido.MidiTrack([mido.MetaMessage("track_name", name=name)])
    if channel == 0:
      track += [mido.MetaMessage("set_tempo", tempo=mido.bpm2tempo(bpm)),
                mido.MetaMessage("time_signature", numerator=4, denominator=4)]
    events = []                                             # (absolute tick, message)
    for note in voice_notes(steps[:, channel]):
      events.append((note.start * ticks_per_step, mido.Message(
          "note_on", channel=channel, note=note.pitch, velocity=velocity)))
      events.append((note.end * ticks_per_step, mido.Message(
          "note_off", channel=channel, note=note.pitch, velocity=0)))
    now = 0
    for tick, message in events:                            # already in time order
      track.append(message.copy(time=tick - now))
      now = tick
    track.append(mido.MetaMessage("end_of_track", time=len(steps) * ticks_per_step - now))
    midi.tracks.append(track)
  return midi


def write_midi(path: str | os.PathLike, steps: np.ndarray, **kwargs) -> mido.MidiFile:
  """Writes `steps_to_midi(steps, **kwargs)` to `path` and returns it (same Raises)."""
  midi = steps_to_midi(steps, **kwargs)
  midi.save(os.fspath(path))
  return midi
