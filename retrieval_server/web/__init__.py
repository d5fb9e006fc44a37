"""Live web search as a backend of `hdr serve` (`--web serper|serpapi`): one module per API
(`serper`, `serpapi`), what they share (`base`: the request, the mapping to Search-R1 documents,
the error statuses), their settings (`config`) and the backend that sends their requests through
the proxy's cache, coalescing, budget, rate limit, retries and fleet (`backend`)."""

from retrieval_server.web import serpapi, serper  # noqa: F401  (each registers its API)
