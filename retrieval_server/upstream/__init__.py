"""Proxy mode: the queries the cache cannot answer forwarded to an upstream server, its settings
(`config.py`), the forwarding with its limits, retries and secrets (`proxy.py`) and the spend
ledger that holds a budget (`spend.py`). A live web search API is the same proxy with another
wire format (`retrieval_server.web`)."""
