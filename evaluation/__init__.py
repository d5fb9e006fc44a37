"""Held-out evaluation (Mean@k, Best@k, greedy EM), the replay experiment, its tables and charts."""
