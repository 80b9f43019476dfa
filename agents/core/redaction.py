"""Secrets out of everything Keel writes down (the journal, ``last_error``, every log line): :func:`redact` replaces
with ``***`` the secrets Keel was configured with (:func:`register_secrets`, :func:`register_settings`) and anything
shaped like a credential (Slack, GitHub, OpenAI-style, AWS and Keel's own tokens, ``Bearer``/``Authorization``
values, a URL's password); :class:`RedactingFilter` applies it to log records. Every pattern takes time linear in the
text's length, since a log line may quote what an unauthenticated client sent. Pure: no database, no network."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote, unquote_plus, urlsplit

from models.audit_keys import audit_key_secrets
from models.settings import Settings

MASK = "***"
#: Known secrets shorter than this are not replaced by value (they would mask ordinary words); their shapes
#: (a URL's password, a bearer token) still are.
MIN_SECRET_LENGTH = 8

_SHAPES: tuple[tuple[re.Pattern[str], str], ...] = (
    # A URL's userinfo password: scheme://user:PASSWORD@host (user may be empty, as in redis://:pw@host). The scheme
    # starts where a run of scheme characters starts and is at most 31 long: tried from every position of a long
    # run ("a-a-a-…") an unbounded one would rescan the rest of the run each time (seconds for 40 KB).
    (
        re.compile(r"(?i)(?<![a-z0-9+.\-])([a-z][a-z0-9+.\-]{0,30}://[^\s:/@]*:)[^\s@/]+(@)"),
        rf"\g<1>{MASK}\g<2>",
    ),
    # Authorization headers, in text, JSON or a dict's repr; the scheme word (Bearer, Basic, …) goes too.
    (
        re.compile(r"(?i)\b((?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?)(?:[A-Za-z]+\s+)?[^\s\"',;]+"),
        rf"\g<1>{MASK}",
    ),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9\-._~+/]+=*"), rf"\g<1>{MASK}"),
    (re.compile(r"\bxox[a-z]-[A-Za-z0-9\-]+"), MASK),  # Slack bot/user/app/refresh tokens
    (re.compile(r"\bxapp-[A-Za-z0-9\-]+"), MASK),  # Slack app-level tokens
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]+"), MASK),  # GitHub fine-grained tokens
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]+"), MASK),  # GitHub classic, OAuth, user-to-server, server, refresh
    (re.compile(r"(?<![A-Za-z0-9\-])sk-[A-Za-z0-9_\-]{16,}"), MASK),  # OpenAI-style API keys
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MASK),  # AWS access key ids
    (re.compile(r"(?<![A-Za-z0-9_\-])keel_[A-Za-z0-9_\-]{32,}"), MASK),  # Keel's own API tokens (keel token create)
)

#: Text none of these fragments occur in can match none of :data:`_SHAPES` (each shape needs one of them, whatever
#: its case): one linear search instead of a substitution per shape, for the short texts that are most of what is
#: written down (a journal event's timestamps and job keys). Extend it with every shape added above.
_ANY_SHAPE = re.compile(r"(?i)://|authorization|bearer|xox|xapp-|github_pat_|gh[pousr]_|sk-|akia|asia|keel_")

_lock = threading.Lock()
_known: tuple[str, ...] = ()  # longest first, so a secret containing another is masked whole


def register_secrets(*secrets: str | None) -> None:
    """Add values that must never be written anywhere (a token, a password). Empty or short values are ignored."""
    global _known
    fresh = {s for s in secrets if s and len(s) >= MIN_SECRET_LENGTH}
    if not fresh:
        return
    with _lock:
        _known = tuple(sorted(set(_known) | fresh, key=len, reverse=True))


def clear_secrets() -> None:
    """Forget the registered secrets (tests)."""
    global _known
    with _lock:
        _known = ()


#: The standard OpenTelemetry variables that may hold a collector's credentials: its URLs (a password, a query
#: such as ``?api_key=…``) and the headers sent with every export (``x-api-key=…``, ``authorization=…``).
OTLP_URL_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
OTLP_HEADER_VARIABLES = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")


def secrets_of(settings: Settings, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Every secret Keel holds, as written and percent-decoded: ``settings``' tokens, API, session and signing keys,
    the journal's audit keys (or the development key under ``KEEL_HOME``), the database roles' passwords and those in
    its URLs, the OTLP endpoint's credentials; and from ``environ`` the S3 secret key and the credentials in the
    standard OTLP variables."""
    found = [
        value.get_secret_value()
        for value in (
            settings.slack_token,
            settings.github_token,
            settings.llm_api_key,
            settings.api_metrics_token,
            settings.db_app_password,
            settings.db_auditor_password,
        )
        if value is not None
    ]
    found.extend(audit_key_secrets(settings))
    if settings.console_session_key is not None:
        found.append(settings.console_session_key.get_secret_value())
    if settings.audit_signing_key is not None:  # a PEM: the whole of it, and each line of its base64 body
        pem = settings.audit_signing_key.get_secret_value()
        found.append(pem)
        found.extend(line.strip() for line in pem.splitlines() if line.strip() and not line.startswith("-----"))
    if environ.get("AWS_SECRET_ACCESS_KEY"):  # the shipper's S3 credentials, which boto3 reads itself
        found.append(environ["AWS_SECRET_ACCESS_KEY"])
    for url in (settings.database_url, settings.migration_database_url, settings.broker_url):
        password = _url_password(url)
        if password:
            found.extend({password, unquote(password)})
    for url in (settings.otlp_endpoint, *(environ.get(name) for name in OTLP_URL_VARIABLES)):
        found.extend(_url_credentials(url))
    for name in OTLP_HEADER_VARIABLES:
        found.extend(_header_values(environ.get(name)))
    return found


def register_settings(settings: Settings, environ: Mapping[str, str] = os.environ) -> None:
    """Register every secret ``settings`` and the OTLP variables of ``environ`` hold (see :func:`secrets_of`). Call
    it where a process reads them."""
    register_secrets(*secrets_of(settings, environ))


def redact(text: str) -> str:
    """``text`` with known secrets and credential-shaped substrings replaced by ``***``."""
    if not text:
        return text
    for secret in _known:
        if secret in text:
            text = text.replace(secret, MASK)
    if _ANY_SHAPE.search(text) is None:
        return text
    for pattern, replacement in _SHAPES:
        text = pattern.sub(replacement, text)
    return text


def redact_value(value: Any) -> Any:
    """``value`` with :func:`redact` applied to every string in it (mapping keys too); other values are kept."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {redact(k) if isinstance(k, str) else k: redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """Redacts a record's message, its exception text and its stack before any handler formats it."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, Mapping):  # structlog's event dict: it must stay one for its formatter
            record.msg = redact_value(record.msg)
            return True
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let the handler report it as it always does
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install_log_redaction(loggers: Iterable[logging.Logger] | None = None) -> None:
    """Put a :class:`RedactingFilter` on every handler of ``loggers`` (default: the root logger); idempotent.

    A filter on a handler sees every record the handler writes, including those propagated from child loggers. A
    handler whose formatter redacts its lines itself (a true ``redacts`` attribute: Keel's,
    ``agents.observability.logs.Formatter``) gets none: each line is redacted once.
    """
    for logger in loggers if loggers is not None else (logging.getLogger(),):
        for handler in logger.handlers:
            if getattr(handler.formatter, "redacts", False):
                continue
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())


def _url_credentials(url: str | None) -> set[str]:
    """A URL's password and query values, as written and decoded."""
    if not url:
        return set()
    try:
        parts = urlsplit(url.strip())
        password = parts.password
    except ValueError:
        return set()
    found = {password, unquote(password)} if password else set()
    for raw in parts.query.split("&"):
        value = raw.partition("=")[2]
        found.update({value, unquote_plus(value)})
    return {value for value in found if value}


def _header_values(variable: str | None) -> set[str]:
    """The values of an ``OTEL_EXPORTER_OTLP_HEADERS``-style list (``key=value,key2=value2``, percent-encoded), as
    written and decoded."""
    found: set[str] = set()
    for pair in (variable or "").split(","):
        value = pair.partition("=")[2].strip()
        if value:
            found.update({value, unquote(value)})
    return {value for value in found if value}


def _url_password(url: str | None) -> str | None:
    if not url:
        return None
    try:
        return urlsplit(url).password
    except ValueError:
        return None
