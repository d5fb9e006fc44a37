"""FastAPI retrieval service: dense (FAISS) and BM25 search over a wiki corpus (Search-R1 API).

One subpackage per part: `serving/` (the app, the result cache, batching, retrievers), `index/`
(the corpus, the encoder, `hdr index` and the index's files), `upstream/` (proxy mode and its
spend), `fleet/` (the replicas' Redis), `web/` (live web-search APIs), `snapshot/` (answers
frozen and served back). Beside them: the HTTP contract (`api.py`), the server's settings
(`config.py`), the URL's secrets (`url_secrets.py`), a rate limiter (`pacing.py`) and `hdr
serve` (`cli.py`)."""
