"""hdr inside other trainers: TRL's GRPOTrainer (`trl.py`, the `hdr[trl]` extra)."""
