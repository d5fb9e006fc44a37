"""Serving: the FastAPI app and its guards (`app.py`, `guards.py`, `errors.py`, `state.py`), the
answers' path (`answers.py`: the result cache `cache.py`, coalescing, the emulated cost
`emulated_cost.py`), the micro-batcher and the retrievers (`batching.py`, `retrievers.py`), the
metrics, the query log, the connections' limits and the uvicorn runtime (`runtime.py`)."""
