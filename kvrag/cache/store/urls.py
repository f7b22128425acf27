"""Store URLs: credentials found, redacted for printing and kept out of what is recorded."""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

_SECRET_PARAMS = frozenset(
    {"password", "pass", "passwd", "pwd", "auth", "secret", "token", "access_token", "apikey", "api_key"}
)
# A query parameter has begun: '?' or '&', a name, '='. An '@' after one is in the query, not the userinfo's end.
_QUERY_STARTED = re.compile(r"[?&][A-Za-z0-9_.~%+-]*=")


def _split_url(url: str) -> tuple[str, str | None, str]:
    """`url` as (the scheme and '//', the userinfo or None, the rest: host, path, query).

    The userinfo ends at the netloc's last '@', and an unencoded password may hold '/', '?', '#' or '@'
    (which `urllib.parse.urlsplit` would take for the netloc's end): the '@' that ends it is the last one
    not inside a query parameter.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    head = scheme + sep
    at = -1
    for i, ch in enumerate(rest):
        if ch == "@" and not _QUERY_STARTED.search(rest, 0, i):
            at = i
    if at < 0:
        return head, None, rest
    return head, rest[:at], rest[at + 1 :]


def url_secrets(url: str) -> list[str]:
    """The credentials in `url` (its password, its credential query values), as written and decoded."""
    _, userinfo, rest = _split_url(url)
    found = []
    if userinfo is not None and ":" in userinfo:
        found.append(userinfo.partition(":")[2])
    _, q, query = rest.partition("?")
    for part in re.split(r"[&;]", query) if q else ():
        name, eq, value = part.partition("=")
        if eq and unquote(name).lower() in _SECRET_PARAMS:
            found.append(value)
    return [s for secret in found if secret for s in {secret, unquote(secret), unquote(secret.replace("+", " "))}]


def redact(url: str) -> str:
    """A URL with its password and credential query values (password=, auth=, ...) replaced by '***'.

    The username, host, path and other parameters stay as written, for messages and logs.
    """
    head, userinfo, rest = _split_url(url)
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}{':***' if colon else ''}@{rest}"
    where, q, query = rest.partition("?")
    if q:
        parts = re.split(r"([&;])", query)
        for i in range(0, len(parts), 2):
            name, eq, _ = parts[i].partition("=")
            if eq and unquote(name).lower() in _SECRET_PARAMS:
                parts[i] = f"{name}=***"
        rest = f"{where}?{''.join(parts)}"
    return head + rest


def without_credentials(url: str) -> str:
    """`url` with its password and credential query values removed (the username stays): a URL that may be
    written where a log can show it, the credentials given apart."""
    head, userinfo, rest = _split_url(url)
    if userinfo is not None:
        user = userinfo.partition(":")[0]
        rest = f"{user}@{rest}" if user else rest
    where, q, query = rest.partition("?")
    if q:
        kept = [
            part
            for part in re.split(r"[&;]", query)
            if not (part.partition("=")[1] and unquote(part.partition("=")[0]).lower() in _SECRET_PARAMS)
        ]
        rest = f"{where}?{'&'.join(kept)}" if kept else where
    return head + rest


def has_credentials(url: str) -> bool:
    """Whether `url` carries a password or a credential query value."""
    return bool(url_secrets(url))


def encode_userinfo(url: str) -> str:
    """`url` with '/', '?', '#', '@', '[' and ']' in its username and password percent-encoded (redis-py decodes
    them), so that a password holding them reaches the server instead of breaking the URL's parse."""
    head, userinfo, rest = _split_url(url)
    if userinfo is None or not re.search(r"[/?#@\[\]]", userinfo):
        return url
    user, colon, password = userinfo.partition(":")
    safe = "!$&'()*+,;=~-._%"
    return f"{head}{quote(user, safe=safe)}{colon}{quote(password, safe=safe + ':')}@{rest}"
