"""Proxy mode (`hdr serve --upstream URL`): the queries the cache cannot answer are forwarded to
another Search-R1-compatible server (a paid or remote search service, Search-R1's own server,
another `hdr serve`), with the same API, cache and coalescing in front.

Toward the upstream: at most `max_concurrency` requests in flight and `rate_limit_rps` started
per second (a request over the limit waits for its slot); a request carries at most
`max_batch_queries` queries (a larger set is split); 5xx, 429, timeouts and connection errors
are retried `max_retries` times with exponential backoff and full jitter. What still fails is
answered in one line: 504 when the upstream did not answer in time, 502 for anything else it
did (its status and one line of its detail), never a 500 of our own; a 400/413/422 of the
upstream is the client's request, passed on with its status. A body is read up to
`max_response_bytes` and no further, and parsed with orjson (which refuses nesting deeper than
1,024 levels with an error, not a RecursionError); a 200 whose body is not a Search-R1 result
for the queries sent (what hdr's own client would fail to parse) is a 502 and is never cached.

The spend budget (`retrieval_server.upstream.spend`): every query forwarded is one call at
`price_per_call`, reserved before it is sent, so concurrent requests cannot overspend, and
billed as the upstream bills it: answered, or sent and unanswered (a timeout, a connection lost
after sending; `bill_timeouts`), each retry again; released when it was never sent or the
upstream answered an error status. Past `max_calls` calls or `max_spend`, a request with a
query to forward is refused with a 429 naming the budget that ran out, while queries the cache
answers are still served. A forward, once begun, runs to its end even if every client waiting
for it leaves (`finishes_abandoned`, read by `retrieval_server.serving.answers`): what is paid
for is billed and cached.

Secrets: the URL's user and password, its query string's values and the token from `token_env`
are sent upstream but never shown: `shown_url` is what logs, `/health`, `/metrics` and errors
say, and an upstream's error detail has them masked before it is passed on, in every form it
may echo them (as given, URL-encoded, base64 as a Basic header carries the user and password:
`retrieval_server.url_secrets`).
A URL with a user
and password beside a token in `token_env` is refused (one would silently replace the other).

Whether caching the upstream's answers is exact depends on the upstream: a static index
(another `hdr serve`, Search-R1's server) answers a query the same way every time; a live web
search does not, and wants `cache.ttl_s`.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import os
import random
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from pydantic import TypeAdapter, ValidationError

from core.errors import UserError
from retrieval_server.api import Document, ScoredDocument, UpstreamReport
from retrieval_server.pacing import Pacer
from retrieval_server.upstream.config import UpstreamConfig
from retrieval_server.upstream.spend import (
    BudgetSpent,
    BudgetUnavailable,
    FileLedger,
    MemoryLedger,
)
from retrieval_server.url_secrets import MASK, secrets_pattern, url_secrets

if TYPE_CHECKING:
    from retrieval_server.upstream.spend import SpendTotals

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
CLIENT_STATUSES = frozenset({400, 413, 422})  # the request's own fault: passed on as it is
DETAIL_CHARS = 200
ERROR_JSON_BYTES = 64 * 1024  # an error body longer than this is shown as text, not parsed
HEALTH_TIMEOUT_S = 10.0
# what a query's answer must be, as hdr's client reads it (api.ScoredResponse, PlainResponse)
SCORED_ANSWERS = TypeAdapter(list[list[ScoredDocument]])
PLAIN_ANSWERS = TypeAdapter(list[list[Document]])
# what of an upstream's /health decides its answers (besides the query, topk and retriever a
# request names): they go into the proxy's fingerprint
ANSWER_DECIDING = ("documents", "encoder", "index_type", "retrievers", "default_retriever",
                   "profile", "max_query_chars")  # fmt: skip


JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True)
class Outgoing:
    """One request toward the upstream, and its URL as errors show it (no secrets)."""

    method: str
    url: httpx.URL
    shown: str
    body: bytes | None = None
    headers: dict[str, str] | None = None


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header in seconds (delta-seconds or an HTTP date); None if absent or
    unreadable."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0) if when.tzinfo else None


class UpstreamError(Exception):
    """The upstream could not answer: the status to answer with and its one-line detail."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class UpstreamCounts:
    """Since start: HTTP requests the upstream answered, retries, final failures, refusals."""

    requests: int = 0
    retries: int = 0
    failures: int = 0
    refused_over_budget: int = 0
    refused_unavailable: int = 0  # budget not checkable (its store down): answered 503


class _Unsent(Exception):
    """An attempt that never reached the upstream (no connection): not billed."""


class UpstreamBackend:
    """Forwards queries to the upstream (the `Backend` of `retrieval_server.serving.answers`)."""

    # a forward, once begun, is finished and cached even when every client waiting has left:
    # the upstream bills it either way (retrieval_server.serving.answers reads this)
    finishes_abandoned = True

    def __init__(self, config: UpstreamConfig, ledger: MemoryLedger | None = None) -> None:
        self.config = config
        self.counts = UpstreamCounts()
        token = self.credential()
        parsed = httpx.URL(config.url)
        if token and parsed.userinfo:
            raise UserError(
                f"upstream URL {config.shown_url} carries a user and password and "
                f"${config.token_env} is set too: one would replace the other (Basic or "
                "Bearer); give only one of them"
            )
        self.secrets = url_secrets(config.url, token)
        self._masking: tuple[list[str], re.Pattern[str] | None] = ([], None)
        self.queries_per_request = config.max_batch_queries  # a web API takes one at a time
        self.ledger = ledger if ledger is not None else default_ledger(config)
        self.pacer = Pacer(config.rate_limit_rps)
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self.rng = random.Random()
        self.http = httpx.AsyncClient(
            headers=self.auth_headers(token),
            timeout=httpx.Timeout(config.timeout_s),
            limits=httpx.Limits(
                max_connections=config.max_concurrency,
                max_keepalive_connections=config.max_concurrency,
                keepalive_expiry=2.0,  # below the keep-alive of common servers (hdr's 20 s)
            ),
        )

    def credential(self) -> str | None:
        """The secret sent upstream: the Bearer token in `token_env`, if set."""
        return os.environ.get(self.config.token_env) or None

    def auth_headers(self, token: str | None) -> dict[str, str] | None:
        """The headers that carry the credential on every request."""
        return {"Authorization": f"Bearer {token}"} if token else None

    def refused(self, status: int, content: bytes) -> Exception | None:
        """What to raise, unretried, for an error status that is not the proxy's ordinary
        failure (a web API's spent quota or refused key); None: the ordinary handling."""
        return None

    async def close(self) -> None:
        await self.http.aclose()
        await self.ledger.close()

    def masked(self, text: str) -> str:
        """`text` with every secret of the URL and token masked, in every form
        (`secret_forms`)."""
        if self._masking[0] != self.secrets:  # secrets may be added after __init__
            self._masking = (list(self.secrets), secrets_pattern(self.secrets))
        pattern = self._masking[1]
        return text if pattern is None else pattern.sub(MASK, text)

    async def describe(self) -> dict[str, Any]:
        """The upstream's /health as JSON ({} if it has none, as Search-R1's server). A refused
        connection, or a /health that answers 200 with a body that is not a JSON object, is a
        UserError at start (a wrong URL, or not a Search-R1 server)."""
        shown = self.config.shown_url
        try:
            status, content, _ = await asyncio.wait_for(
                self._send("GET", self.config.endpoint("/health")), HEALTH_TIMEOUT_S
            )
        except (httpx.HTTPError, asyncio.TimeoutError, _Unsent) as err:
            reason = str(err) if isinstance(err, _Unsent) else type(err).__name__
            raise UserError(
                f"upstream {shown} does not answer ({reason}); start it first or correct --upstream"
            ) from None
        except UpstreamError as err:
            raise UserError(f"{err.detail} at /health; is {shown} a Search-R1 server?") from None
        if status not in (200, 503):
            return {}  # no /health (Search-R1's server: 404): nothing is known of it
        body = parse_json(content)
        if isinstance(body, dict):
            return body
        if status == 503:
            return {}
        raise UserError(
            f"upstream {shown} answered /health with a body that is not a JSON object"
            f" ({one_line(content, self.masked)}); is it a Search-R1 server?"
        )

    async def compute(
        self, queries: list[str], topk: int, retriever: str, return_scores: bool
    ) -> list[bytes]:
        """Each query's answer (the upstream's result list, re-encoded compactly), in order."""
        try:
            await self.ledger.reserve(len(queries))  # the first attempt of every chunk
        except BudgetSpent:
            self.counts.refused_over_budget += 1
            raise
        except BudgetUnavailable:
            self.counts.refused_unavailable += 1
            raise
        size = self.queries_per_request
        chunks = [queries[lo : lo + size] for lo in range(0, len(queries), size)]
        started = [False] * len(chunks)
        try:
            parts = await asyncio.gather(
                *(
                    self._forward(chunk, topk, retriever, return_scores, started, i)
                    for i, chunk in enumerate(chunks)
                ),
                return_exceptions=True,
            )
        finally:  # a chunk cancelled before it ran never settles its reservation itself
            for chunk, began in zip(chunks, started, strict=True):
                if not began:
                    self.ledger.settle(len(chunk), 0)
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        return [answer for part in parts for answer in part]  # type: ignore[union-attr]

    async def _forward(
        self,
        queries: list[str],
        topk: int,
        retriever: str,
        return_scores: bool,
        started: list[bool],
        chunk: int,
    ) -> list[bytes]:
        """One chunk's answers; its first attempt's calls are reserved by `compute`, and
        settled by the attempt from the moment it runs (`started[chunk]`)."""
        started[chunk] = True
        body: dict[str, Any] = {"queries": queries, "topk": topk, "return_scores": return_scores}
        if retriever:
            body["retriever"] = retriever
        url, shown = self.config.endpoint("/retrieve"), self.config.shown_endpoint("/retrieve")
        request = Outgoing("POST", url, shown, orjson.dumps(body), JSON_HEADERS)
        content = await self._post(request, len(queries))
        answers = search_r1_answers(content, len(queries), return_scores)
        if answers is None:
            self.counts.failures += 1
            raise UpstreamError(
                502,
                f"upstream {self.config.shown_url} answered a body that is not a Search-R1 result "
                f"for {len(queries)} queries",
            )
        return answers

    async def _post(self, request: Outgoing, calls: int) -> bytes:
        """The upstream's 200 body, after retries; UpstreamError when it does not come. Each
        attempt is settled in the ledger; each retry reserves its calls anew. A 429's
        Retry-After is waited for (instead of the backoff) up to `backoff_max_s`; a longer one
        ends the forward at once."""
        c = self.config
        shown = request.shown
        failure = UpstreamError(502, "")
        wait_s = 0.0  # the upstream's Retry-After of its last 429
        for attempt in range(c.max_retries + 1):
            if attempt:
                self.counts.retries += 1
                cap = min(c.backoff_max_s, c.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(max(self.rng.uniform(0, cap), wait_s))
                try:
                    await self.ledger.reserve(calls)
                except (BudgetSpent, BudgetUnavailable) as err:
                    self.counts.failures += 1
                    raise UpstreamError(
                        failure.status, f"{failure.detail}; not retried: {err}"
                    ) from None
            outcome = await self._attempt(request, calls)
            if isinstance(outcome, UpstreamError):
                failure = outcome
                continue
            status, content, retry_after = outcome
            self.counts.requests += 1
            if status == 200:
                return content
            if (refusal := self.refused(status, content)) is not None:
                raise refusal
            line = f"upstream {shown} answered HTTP {status}: {one_line(content, self.masked)}"
            if status in CLIENT_STATUSES:
                raise UpstreamError(status, line)
            failure = UpstreamError(502, line)
            wait_s = retry_after if status == 429 and retry_after is not None else 0.0
            if wait_s > c.backoff_max_s and attempt < c.max_retries:
                self.counts.failures += 1
                raise UpstreamError(
                    503,
                    f"{line}; it asks to wait {wait_s:g} s (Retry-After), longer than "
                    f"upstream.backoff_max_s {c.backoff_max_s:g}: retry later",
                )
            if status not in RETRY_STATUSES:
                break
        self.counts.failures += 1
        attempts = f" ({c.max_retries + 1} attempts)" if c.max_retries else ""
        raise UpstreamError(failure.status, failure.detail + attempts)

    async def _attempt(
        self, request: Outgoing, calls: int
    ) -> tuple[int, bytes, float | None] | UpstreamError:
        """One attempt: (status, body, Retry-After), or the UpstreamError of a failure to
        retry. Its
        reserved `calls` are settled however it ends: billed when the upstream answered 200,
        or when the request was sent and no answer came (`bill_timeouts`; always when the
        attempt was cancelled, as the upstream answers it regardless)."""
        c = self.config
        shown = request.shown
        billed = False
        try:
            async with self.slots:
                await self.pacer.wait()
                try:
                    status, content, retry_after = await asyncio.wait_for(  # per read: httpx
                        self._send(request.method, request.url, request.body, request.headers),
                        c.timeout_s,
                    )
                except asyncio.CancelledError:
                    billed = True  # sent, perhaps: the upstream answers and bills it anyway
                    raise
            billed = status == 200
            return status, content, retry_after
        except _Unsent as err:
            return UpstreamError(502, f"upstream {shown} unreachable: {err}")
        except UpstreamError as err:  # too large: the upstream answered
            billed = err.status == 200
            return UpstreamError(502, err.detail)
        except (httpx.TimeoutException, asyncio.TimeoutError):
            billed = c.bill_timeouts
            return UpstreamError(504, f"upstream {shown} did not answer within {c.timeout_s:g} s")
        except httpx.HTTPError as err:  # sent, and the connection failed before the answer
            billed = c.bill_timeouts
            return UpstreamError(502, f"upstream {shown} unreachable: {type(err).__name__}")
        finally:
            self.ledger.settle(calls, calls if billed else 0)

    async def _send(
        self,
        method: str,
        url: httpx.URL,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes, float | None]:
        """(status, body, Retry-After in seconds) of one request, the body read up to
        `max_response_bytes`; raises
        `_Unsent` when no connection was made, UpstreamError (with the upstream's status) for
        a body past the cap."""
        cap = self.config.max_response_bytes
        try:
            async with self.http.stream(method, url, content=body, headers=headers) as response:
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > cap:
                        raise UpstreamError(
                            response.status_code,
                            f"upstream {self.config.shown_url} answered more than"
                            f" {cap} bytes (upstream.max_response_bytes)",
                        )
                    chunks.append(chunk)
                retry_after = retry_after_s(response.headers.get("retry-after"))
                return response.status_code, b"".join(chunks), retry_after
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as err:
            raise _Unsent(type(err).__name__) from None

    def report(self, totals: SpendTotals) -> UpstreamReport:
        c = self.config
        return UpstreamReport(
            url=c.shown_url,
            api=c.web.api if c.web is not None else "search-r1",
            requests=self.counts.requests,
            calls=totals.calls,
            committed_calls=totals.committed_calls,
            retries=self.counts.retries,
            failures=self.counts.failures,
            refused_over_budget=self.counts.refused_over_budget,
            refused_unavailable=self.counts.refused_unavailable,
            price_per_call=c.price_per_call,
            spent=totals.spent,
            committed_spend=totals.committed_spend,
            max_calls=c.max_calls,
            max_spend=c.max_spend,
            ledger=self.ledger.where,
            refusing=getattr(self.ledger, "refusing", None),
        )


def default_ledger(config: UpstreamConfig) -> MemoryLedger:
    """The spend file's ledger where one is set, else this process's memory."""
    if config.spend_path is not None:
        return FileLedger(config, config.spend_path, config.shown_url)
    return MemoryLedger(config)


def upstream_description(config: UpstreamConfig, health: dict[str, Any]) -> dict[str, Any]:
    """What decides the upstream's answers, as far as it tells: its URL (shown, and a digest
    of its query string, whose values are never written anywhere), what its /health says of
    its index and serving settings, and its own cache fingerprint (an `hdr serve` upstream's
    covers its index and the settings that change results)."""
    query = httpx.URL(config.url).query
    served = health.get("cache") if isinstance(health.get("cache"), dict) else {}
    return {
        "url": config.shown_url,
        "query_sha256": hashlib.sha256(query).hexdigest() if query else None,
        "fingerprint": served.get("fingerprint"),
        **({"web": config.web.answer_settings()} if config.web is not None else {}),
        **{name: health.get(name) for name in ANSWER_DECIDING},
    }


def parse_json(content: bytes) -> Any:
    """`content` as JSON, or None when it is not (orjson: deep nesting is an error too)."""
    try:
        return orjson.loads(content)
    except (ValueError, RecursionError):
        return None


def search_r1_answers(content: bytes, queries: int, return_scores: bool) -> list[bytes] | None:
    """The answers of a Search-R1 response body, re-encoded, when it holds one valid answer
    per query (as hdr's client validates them); None otherwise."""
    body = parse_json(content)
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list) or len(result) != queries:
        return None
    try:
        (SCORED_ANSWERS if return_scores else PLAIN_ANSWERS).validate_python(result)
    except ValidationError:
        return None
    return [orjson.dumps(answer) for answer in result]


def one_line(content: bytes, masked=lambda text: text) -> str:
    """An upstream's error detail (its JSON `detail`, else its text) as one short line."""
    body = parse_json(content) if len(content) <= ERROR_JSON_BYTES else None
    detail = body.get("detail") if isinstance(body, dict) else None
    if not isinstance(detail, str):
        detail = content[: 4 * DETAIL_CHARS].decode("utf-8", "replace")
    return masked(" ".join(detail.split()))[:DETAIL_CHARS] or "(empty body)"
