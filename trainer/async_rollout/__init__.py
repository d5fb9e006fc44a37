"""Asynchronous rollout: rollout workers that run ahead of the trainer (`workers.py`) and where
each worker's model and engine are placed (`devices.py`)."""
