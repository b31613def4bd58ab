"""Credentials kept out of what lora_stream shows: option values and text, redacted for display.

What is shown (an error, a ``repr``, a log line, a record) goes through :func:`redact` or :func:`redact_text`;
what is used (a comparison, a request) keeps the real values. Redacted are: the value of every option whose name
looks like a credential (:func:`is_sensitive`: ``api_key``, ``token``, ``secret``, ``password``,
``authorization``, ..., in any case), the userinfo of URLs (``http://user:password@host`` shows as
``http://<redacted>@host``), and in text ``Authorization: ...`` values, ``Bearer ...`` credentials, ``name=value``
and ``"name": "value"`` pairs whose name is such a credential, and any secret passed explicitly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["REDACTED", "is_sensitive", "redact", "redact_text"]

#: What a redacted value shows as.
REDACTED = "<redacted>"

# Anywhere in the name (case and separators ignored): "apiKey", "X-API-Key", "client_secret", "HF_PASSWORD", ...
_WORDS = ("apikey", "secret", "password", "passwd", "passphrase", "authorization", "credential", "cookie", "bearer")
# A whole part of the name (split at anything not a letter or digit): "key", "auth_token", "hf-token", "pwd".
# "max_tokens" and "tokenizer" are not credentials.
_PARTS = frozenset({"key", "token", "auth", "pwd"})
# In free text, a bare "key" / "token" / "auth" before ":" or "=" is too often prose ("missing key: foo.weight").
_BARE = _PARTS

_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"<>]+@")
# "Authorization: Bearer x", "'authorization': 'Basic x'", "Proxy-Authorization=x": the whole value.
_AUTHORIZATION = re.compile(r"""(?i)(authorization['"]?\s*[:=]\s*)(['"]?)(?:[a-z]+\s+)?(?!<)[^\s'",;)}\]]+""")
_BEARER = re.compile(r"(?i)\b(bearer\s+)(?!<|tokens?\b)[A-Za-z0-9._~+/=-]+")
# A credential-like name, then ":" or "=", then its value (quoted, or up to a delimiter).
_PAIR = re.compile(
    r"""(?i)(?P<name>[a-z0-9_-]*(?:api[_-]?key|secret|passw(?:or)?d|passphrase|credential|cookie|token|auth|key|pwd)"""
    r"""[a-z0-9_-]*)(?P<q1>['"]?)(?P<sep>\s*[:=]\s*)"""
    r"""(?:(?P<q2>['"])(?P<quoted>.*?)(?P=q2)|(?P<bare>(?!<)[^\s,;&)}\]'"]+))"""
)


def is_sensitive(name: object) -> bool:
    """Whether an option or field called ``name`` holds a credential (case-insensitive)."""
    if not isinstance(name, str):
        return False
    low = name.lower()
    squashed = re.sub(r"[^a-z0-9]", "", low)
    if any(word in squashed for word in _WORDS):
        return True
    return any(part in _PARTS or part.endswith("token") for part in re.split(r"[^a-z0-9]+", low) if part)


class _Redacted:
    """Stands for a redacted value: its ``repr`` and ``str`` are :data:`REDACTED`, so ``{!r}`` shows no quotes."""

    __slots__ = ()

    def __repr__(self) -> str:
        return REDACTED

    __str__ = __repr__


_HIDDEN = _Redacted()


def redact(value: Any, *, secrets: Iterable[str | None] = ()) -> Any:
    """A copy of ``value`` fit for display: in mappings (nested, and in lists, tuples and sets), the value of every
    credential-like key (:func:`is_sensitive`; ``None`` and ``""`` stay visible) shows as ``<redacted>``, and every
    string goes through :func:`redact_text`. Anything else is returned as it is."""
    hidden = tuple(s for s in secrets if s)
    return _redact(value, hidden)


def _redact(value: Any, secrets: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        return redact_text(value, secrets=secrets)
    if isinstance(value, Mapping):
        return {
            k: (_HIDDEN if is_sensitive(k) and v is not None and v != "" else _redact(v, secrets))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_redact(v, secrets) for v in value]
        if isinstance(value, list):
            return items
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(items)
        if isinstance(value, (set, frozenset)):
            try:
                return type(value)(items)
            except TypeError:  # an unhashable stand-in: show it as a list
                return items
        return items
    return value


def redact_text(text: str, *, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with credentials replaced by ``<redacted>``: each of ``secrets`` (and its stripped form), URL
    userinfo, ``Authorization`` values and ``Bearer`` credentials, and the value of ``name=value`` or
    ``"name": "value"`` pairs whose name is credential-like (a compound one, such as ``api_key``, or a bare
    ``token=`` in a URL's query: a bare ``key:`` in prose stays)."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    for secret in secrets:
        for s in {secret, secret.strip()} if secret else ():
            if s:
                text = text.replace(s, REDACTED)
    text = _AUTHORIZATION.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    return _PAIR.sub(_pair, text)


def _pair(match: re.Match[str]) -> str:
    name = match.group("name")
    in_query = match.start() > 0 and match.string[match.start() - 1] in "?&"  # ?token=... in a URL
    if not is_sensitive(name) or (name.lower() in _BARE and not in_query):
        return match.group(0)
    head = f"{name}{match.group('q1')}{match.group('sep')}"
    if match.group("q2") is not None:
        return f"{head}{match.group('q2')}{REDACTED}{match.group('q2')}"
    value = match.group("bare")
    if value.lower() in ("none", "null", "true", "false"):
        return match.group(0)
    return f"{head}{REDACTED}"
