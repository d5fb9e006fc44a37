"""The secrets a URL carries, and how they are kept out of what hdr shows.

An upstream's or Redis's URL may carry a user and password and, in its query string, keys
(`?api_key=`, `?password=`: the only way to give a unix:// socket's password). They are sent
where they belong but never shown: `show_url` and `shown_redis_url` are what logs, errors,
`/health` and `/metrics` say; `url_secrets` lists what must never appear, and
`secrets_pattern` finds each of them in every form an error may echo (as given, URL-encoded
either way and in either hex case, base64 as a Basic header carries the user and password),
for `MASK` to replace."""

from __future__ import annotations

import base64
import re
from urllib.parse import quote, quote_plus

import httpx

MASK = "***"


def show_url(url: str) -> str:
    """`url` without userinfo and with every query value masked (names kept)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return "(an invalid URL)"
    shown = str(parsed.copy_with(userinfo=b"", query=None))
    masked = "&".join(f"{name}={MASK}" for name, _ in parsed.params.multi_items())
    return f"{shown}?{masked}" if masked else shown


def url_secrets(url: str, token: str | None) -> list[str]:
    """What of the URL and token must never be shown: the password, the user, the query
    string's values (decoded, and as the URL spells them), the user and password as a Basic
    header carries them, the token; each at least 3 characters (shorter ones are no secret
    and would mask ordinary text). `masked` hides their encoded forms too."""
    parsed = httpx.URL(url)
    found = [token or "", parsed.password or "", parsed.username or ""]
    found += [value for _, value in parsed.params.multi_items()]
    found += [pair.partition("=")[2] for pair in parsed.query.decode().split("&")]
    if parsed.userinfo:
        found.append(f"{parsed.username}:{parsed.password}")
    return sorted({s for s in found if len(s) >= 3}, key=len, reverse=True)


def secret_forms(secret: str) -> set[str]:
    """`secret` as an error may echo it: itself, URL-encoded (either way of spaces), and in
    base64 (standard and URL-safe, with and without padding)."""
    raw = secret.encode()
    forms = {secret, quote(secret, safe=""), quote_plus(secret), quote(secret)}
    for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        forms |= {encoded.decode(), encoded.decode().rstrip("=")}
    return {form for form in forms if len(form) >= 3}


def secrets_pattern(secrets: list[str]) -> re.Pattern[str] | None:
    """One pattern for every form of every secret (case-insensitive: an echo may spell
    %2f for %2F), longest first; None when there is none."""
    forms = sorted({form for s in secrets for form in secret_forms(s)}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, forms)), re.IGNORECASE) if forms else None


def shown_redis_url(url: str) -> str:
    """The Redis URL without its user and password, its query string's values masked (a
    password may be given as `?password=`, the only way for a unix:// socket)."""
    base, _, query = url.partition("?")
    try:
        parsed = httpx.URL(base)
    except httpx.InvalidURL:
        return "(an invalid URL)"
    shown = str(parsed.copy_with(userinfo=b"")) if parsed.userinfo else base
    names = [pair.partition("=")[0] for pair in query.split("&") if pair]
    return shown + ("?" + "&".join(f"{name}={MASK}" for name in names) if names else "")
