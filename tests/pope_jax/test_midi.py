"""`pope_jax.data.midi`: four-voice 16th-note grids as MIDI files, checked by hand."""

import mido
import numpy as np
import pytest

from pope_jax.data import midi


def _notes(track) -> list[tuple[int, int, int, int]]:
  """(channel, start tick, end tick, pitch) of a track's notes."""
  now, open_, notes = 0, {}, []
  for msg in track:
    now += msg.time
    if msg.type == "note_on" and msg.velocity > 0:
      open_[msg.note] = (msg.channel, now)
    elif msg.type in ("note_on", "note_off"):
      channel, start = open_.pop(msg.note)
      notes.append((channel, start, now, msg.note))
  assert not open_
  return notes


GRID = np.array([[72, 67, 64, -1],
                 [72, 67, 64, 48],
                 [74, -1, 64, 48],
                 [74, 65, 62, 48],
                 [72, 65, 62, 48]])


def test_voice_notes_merge_held_pitches_and_skip_silence():
  assert midi.voice_notes(GRID[:, 0]) == [(0, 2, 72), (2, 4, 74), (4, 5, 72)]
  assert midi.voice_notes(GRID[:, 1]) == [(0, 2, 67), (3, 5, 65)]
  assert midi.voice_notes(GRID[:, 3]) == [(1, 5, 48)]
  assert midi.voice_notes(np.full(3, -1)) == [] and midi.voice_notes(np.zeros(0)) == []


def test_steps_to_midi_by_hand(tmp_path):
  path = tmp_path / "c.mid"
  midi.write_midi(path, GRID, ticks_per_step=120, bpm=90)
  back = mido.MidiFile(path)
  assert back.type == 1 and back.ticks_per_beat == 480 and len(back.tracks) == 4
  assert [t.name for t in back.tracks] == ["Soprano", "Alto", "Tenor", "Bass"]
  tempo = [m.tempo for m in back.tracks[0] if m.type == "set_tempo"]
  assert tempo == [mido.bpm2tempo(90)]
  assert _notes(back.tracks[0]) == [(0, 0, 240, 72), (0, 240, 480, 74), (0, 480, 600, 72)]
  assert _notes(back.tracks[1]) == [(1, 0, 240, 67), (1, 360, 600, 65)]
  assert _notes(back.tracks[2]) == [(2, 0, 360, 64), (2, 360, 600, 62)]
  assert _notes(back.tracks[3]) == [(3, 120, 600, 48)]
  # Every track lasts the whole piece (5 steps), silent ends included.
  assert all(sum(m.time for m in t) == 600 for t in back.tracks)
  assert back.length == pytest.approx(5 / 4 * 60 / 90)     # 5 16ths at 90 quarters a minute


def test_steps_to_midi_ticks_per_step():
  doubled = midi.steps_to_midi(GRID, ticks_per_step=240)
  assert _notes(doubled.tracks[3]) == [(3, 240, 1200, 48)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=np.zeros((3, 3), int)), r"\[U, 4\]"),
    (dict(steps=np.full((2, 4), 128)), "0..127"),
    (dict(steps=GRID, ticks_per_step=0), "ticks_per_step"),
    (dict(steps=GRID, bpm=0.0), "bpm"),
    (dict(steps=GRID, bpm=1.0), "bpm"),
    (dict(steps=GRID, velocity=0), "velocity"),
])
def test_steps_to_midi_refuses(kwargs, match):
  with pytest.raises(ValueError, match=match):
    midi.steps_to_midi(kwargs.pop("steps"), **kwargs)
