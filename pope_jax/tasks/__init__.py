"""The papers' experiments as library code: presets, training runs, evaluation and results pages.

Each module holds one experiment's presets (a model and a training config plus its data), the
function that trains or reuses its models, and the summary that writes results.md/json/png; the
CLIs in `experiments/` parse flags and call these.
"""
