"""Data sources (grain random-access sources of {"inputs", "targets", "weights"} records)."""
