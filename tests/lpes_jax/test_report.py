"""results.md of the LPES experiments say what ran, the chance level, the paper's number and the
comparisons computed from results files."""

import pytest

from lpes_jax import report

ARGS = dict(model="smol.gguf", dtype="float32", chat=False, task="kv", num_pairs=6, key_length=4,
            value_length=4, mdqa_file=None, seed=1, max_new_tokens=8, scales="r.json",
            pi_scale=1.5)


RECORD = {"method": "lpes", "task": "kv", "accuracy": {"0": 0.81, "2": 0.23},
          "num_examples": 100, "num_items": 6, "seconds_per_batch_median": 0.039,
          "batch_size": 100, "args": ARGS, "device": "cpu", "num_devices": 1,
          "versions": {"jax": "0"}, "date": "today"}
BASE = dict(RECORD, method="base", accuracy={"0": 0.78, "2": 0.13},
            seconds_per_batch_median=0.0394)


def test_eval_results_md():
  md = report.eval_results_md(RECORD)
  for text in ("smol.gguf", "6 pairs, 4-character keys", "per gold position: 100",
               "1/6 = 0.167", "+11.2 %", "Compared with: no baseline record",
               "| lpes | 0.810 | 0.230 |", "`r.json`"):
    assert text in md, text
  assert "gain over" not in md


def test_eval_results_md_computes_gains_over_a_baseline_record():
  md = report.eval_results_md(RECORD, BASE)
  for text in ("Compared with: base, 100 examples per position, seed 1",
               "| base | 0.780 | 0.130 | 0.0394 |", "| gain over base | +0.030 | +0.100 | |",
               "| lpes | 0.810 | 0.230 | 0.0390 |"):
    assert text in md, text


@pytest.mark.parametrize("change, message", [
    ({"task": "mdqa"}, "baseline task 'mdqa' differs"),
    ({"num_items": 10}, "baseline num_items 10 differs"),
    ({"accuracy": {"0": 0.78, "3": 0.1}}, "baseline gold positions ['0', '3'] differ"),
])
def test_eval_results_md_refuses_a_baseline_on_other_examples(change, message):
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
    report.eval_results_md(RECORD, dict(BASE, **change))


def test_search_results_md():
  record = {"args": dict(ARGS, num_examples=200, seed=0, mode="teacher_forced",
                         answer_prefix=' "'),
            "search": {"weights": [1 / 3] * 3, "population_size": 32, "num_generations": 12,
                       "num_parents": 16, "num_mutations": 8, "num_crossovers": 8, "seed": 0},
            "genome_space": {"kind": "bezier", "grid": [1.0, 1.5, 2.0],
                             "num_control_points": 4},
            "num_candidates": 208,
            "subset_accuracy": {"begin": 0.7, "middle": 0.2, "end": 0.1}, "fitness": 0.33,
            "scales": [1.0, 1.2], "history": [{"best_fitness": 0.3,
                                               "best_subset_accuracy": [0.6, 0.2, 0.1]}]}
  md = report.search_results_md(record)
  for text in ("Search examples: 200", "population 32, 12 generations", "Chance level",
               "3-value grid, 4 Bézier control points", "208 distinct candidates",
               "+11.2 %", "Gain over generation 0's best: +0.030 fitness",
               "| best | 0.330 | 0.700 | 0.200 | 0.100 |",
               "not held-out"):
    assert text in md, text
