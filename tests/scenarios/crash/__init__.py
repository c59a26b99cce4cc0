"""A training run for the crash test to kill (`train_child.py`), launched as a subprocess."""
