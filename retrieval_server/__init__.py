"""FastAPI retrieval service: dense (FAISS) and BM25 search over a wiki corpus (Search-R1 API)."""
