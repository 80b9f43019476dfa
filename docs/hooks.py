"""MkDocs hooks (mkdocs.yml ``hooks:``): the reference pages are generated from the code at every build, so they
cannot drift from it. A page holds a marker, ``<!-- keel:NAME -->`` alone on a line, which is replaced by the markdown
of :data:`SECTIONS` [NAME]: the settings model's fields, the HTTP API's OpenAPI document, the problem types and the
Prometheus metrics. The OpenAPI document itself is added to the site as ``reference/openapi.json``. An unknown
marker fails the build."""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import annotated_types
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

MARKER = re.compile(r"^<!-- keel:([a-z-]+) -->$", re.MULTILINE)
OPENAPI_FILE = "reference/openapi.json"


# --- settings ---------------------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """``text`` fit for one cell of a markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def _bounds(field: FieldInfo) -> str:
    low = high = ""
    for rule in field.metadata:
        if isinstance(rule, annotated_types.Ge):
            low = f"{_number(rule.ge)}"
        elif isinstance(rule, annotated_types.Gt):
            low = f"above {_number(rule.gt)}"
        elif isinstance(rule, annotated_types.Le):
            high = f"{_number(rule.le)}"
        elif isinstance(rule, annotated_types.Lt):
            high = f"below {_number(rule.lt)}"
    if low and high and not low.startswith("above") and not high.startswith("below"):
        return f"{low} to {high}"
    if low:
        return low if low.startswith("above") else f"at least {low}"
    if high:
        return high if high.startswith("below") else f"at most {high}"
    return ""


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _type_name(annotation: Any) -> str:
    """A type as a person setting an environment variable reads it."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is typing.Literal:
        return " or ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"JSON list of {_type_name(args[0])}s" if args else "JSON list"
    if origin is dict:
        return f"JSON object: {_type_name(args[0])} → {_type_name(args[1])}" if args else "JSON object"
    names = {bool: "boolean", int: "integer", float: "number", str: "string", Path: "path", SecretStr: "secret"}
    if annotation in names:
        return names[annotation]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        fields = annotation.model_fields.items()
        return "{" + ", ".join(f"{name}: {_type_name(f.annotation)}" for name, f in fields) + "}"
    return str(annotation)


def _is_secret(annotation: Any) -> bool:
    return annotation is SecretStr or any(_is_secret(a) for a in typing.get_args(annotation))


def _default(field: FieldInfo) -> str:
    if _is_secret(field.annotation):
        return "unset"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int | float):
        return f"`{_number(value)}`"
    if isinstance(value, Path):
        return f"`{value}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""` (empty)'
    plain = json.loads(json.dumps(value, default=lambda v: v.model_dump() if isinstance(v, BaseModel) else str(v)))
    return f"`{json.dumps(plain, separators=(', ', ': '))}`"


def _groups() -> list[tuple[str, list[tuple[str, FieldInfo]]]]:
    """The settings by the class that declares them, most general first."""
    from models.settings import Settings

    titles = {
        "Settings": "General",
        "ServerFields": "PostgreSQL and Redis",
        "JobFields": "Jobs, workers and the beat",
        "ServiceFields": "The model, Slack, GitHub and the outbox",
        "ApiFields": "The HTTP API and the console",
        "AuditFields": "The journal's audit",
        "ObservabilityFields": "Alerts, metrics and traces",
    }
    owners: list[type] = [Settings]
    owners += [c for c in reversed(Settings.__mro__) if c.__module__.startswith("models.") and c is not Settings]
    groups: list[tuple[str, list[tuple[str, FieldInfo]]]] = []
    for owner in owners:
        declared = vars(owner).get("__annotations__", {})
        fields = [(name, Settings.model_fields[name]) for name in declared if name in Settings.model_fields]
        if fields:
            groups.append((titles.get(owner.__name__, owner.__name__), fields))
    return groups


def _breakable(name: str) -> str:
    """``name`` as inline code that a narrow column may break after an underscore, and nowhere else."""
    return "<code>" + name.replace("_", "_<wbr>") + "</code>"


def env_var(name: str) -> str:
    from models.settings import Settings

    return f"{str(Settings.model_config.get('env_prefix', '')).upper()}{name.upper()}"


def settings_markdown() -> str:
    """One table per group of settings: variable, type, default, description (the fields' ``description``)."""
    out = []
    for title, fields in _groups():
        out += [f"## {title}", "", "| variable | type | default | description |", "|---|---|---|---|"]
        for name, field in fields:
            if not field.description:
                raise PluginError(f"setting {name} has no description: give it Field(description=...)")
            kind = _type_name(field.annotation)
            bounds = _bounds(field)
            kind = f"{kind}, {bounds}" if bounds else kind
            cells = (_breakable(env_var(name)), _cell(kind), _cell(_default(field)), _cell(field.description))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


# --- HTTP API ---------------------------------------------------------------------------------------------------------


@cache
def openapi() -> dict[str, Any]:
    """The API app's OpenAPI document, from the app as ``keel serve`` builds it (no database is opened: the app's
    lifespan never runs) on the default settings, not this machine's environment."""
    from agents.ingress.app import create_app
    from models.settings import Settings

    return create_app(Settings.model_construct()).openapi()


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _schema_type(schema: Mapping[str, Any]) -> str:
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#schema-{name.lower()})"
    for combined in ("anyOf", "oneOf", "allOf"):
        if combined in schema:
            parts = [_schema_type(s) for s in schema[combined] if s.get("type") != "null"]
            nullable = any(s.get("type") == "null" for s in schema[combined])
            return " or ".join(parts) + (" or null" if nullable else "")
    if "enum" in schema:
        return " or ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type")
    if kind == "array":
        return f"array of {_schema_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        return f"object of {_schema_type(schema['additionalProperties'])}"
    if isinstance(kind, str):
        return kind + (f" ({schema['format']})" if "format" in schema else "")
    return "any"


def _content(content: Mapping[str, Any]) -> str:
    return "; ".join(
        f"`{media}`" + (f": {_schema_type(body['schema'])}" if body.get("schema") else "")
        for media, body in content.items()
    )


def _operation(method: str, path: str, op: Mapping[str, Any]) -> list[str]:
    out = [f"### {op.get('summary') or f'{method.upper()} {path}'}", "", f"`{method.upper()} {path}`", ""]
    if op.get("description"):
        out += [op["description"].strip(), ""]
    if op.get("parameters"):
        out += ["| parameter | in | required | type | description |", "|---|---|---|---|---|"]
        for p in op["parameters"]:
            required = "yes" if p.get("required") else "no"
            kind = _schema_type(p.get("schema", {}))
            description = p.get("description") or p.get("schema", {}).get("description", "")
            out.append(f"| `{p['name']}` | {p['in']} | {required} | {_cell(kind)} | {_cell(description)} |")
        out.append("")
    body = op.get("requestBody")
    if body:
        out += [f"**Request body**{' (required)' if body.get('required') else ''}: {_content(body['content'])}", ""]
    out += ["| status | meaning | body |", "|---|---|---|"]
    for status, response in op.get("responses", {}).items():
        out.append(f"| {status} | {_cell(response.get('description', ''))} | {_content(response.get('content', {}))} |")
    out.append("")
    return out


def _schema(name: str, schema: Mapping[str, Any]) -> list[str]:
    out = [f"### {name} {{#schema-{name.lower()}}}", ""]
    if schema.get("description"):
        out += [_cell(schema["description"]), ""]
    properties = schema.get("properties", {})
    if properties:
        required = set(schema.get("required", ()))
        out += ["| field | type | required | description |", "|---|---|---|---|"]
        for field, spec in properties.items():
            out.append(
                f"| `{field}` | {_cell(_schema_type(spec))} | {'yes' if field in required else 'no'}"
                f" | {_cell(spec.get('description', ''))} |"
            )
        out.append("")
    elif "enum" in schema:
        out += [f"One of {_schema_type(schema)}.", ""]
    return out


def http_markdown() -> str:
    """Every operation of the OpenAPI document, one section per tag in the order the app declares them, then every
    schema the operations name."""
    document = openapi()
    by_tag: dict[str, list[list[str]]] = {}
    for path, item in document["paths"].items():
        for method, op in item.items():
            for tag in op.get("tags") or ["other"]:
                by_tag.setdefault(tag, []).append(_operation(method, path, op))
    out = [document["info"].get("description", "").strip(), ""]
    for tag, operations in by_tag.items():
        out += [f"## {tag.capitalize()}", ""]
        for lines in operations:
            out += lines
    out += ["## Schemas", ""]
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        out += _schema(name, schema)
    return "\n".join(out)


# --- problem types and metrics ----------------------------------------------------------------------------------------


def _first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").split())
    return text.split(". ")[0].rstrip(".") + "." if text else ""


def problems_markdown() -> str:
    """Every problem type the API answers with (``GET /problems``), and the Keel errors each one stands for."""
    from agents.ingress import problems

    errors: dict[str, list[type[Exception]]] = {}
    for error, kind in problems.error_kinds():
        errors.setdefault(kind.slug, []).append(error)
    out = ["| type | status | title | Keel error: when |", "|---|---|---|---|"]
    for kind in sorted(problems.all_kinds().values(), key=lambda k: (k.status, k.slug)):
        raised = "<br>".join(f"`{e.__name__}`: {_cell(_first_sentence(e.__doc__))}" for e in errors.get(kind.slug, []))
        out.append(f"| `{kind.type}` | {kind.status} | {_cell(kind.title)} | {raised or '—'} |")
    return "\n".join(out) + "\n"


def metrics_markdown() -> str:
    """Every metric Keel exports (agents/observability/names.py), grouped as they are exported."""
    from agents.observability.names import ALERTS, DOMAIN, PROCESS_LOCAL, MetricName

    groups: tuple[tuple[str, str, Iterable[MetricName]], ...] = (
        (
            "Domain KPIs",
            "Computed from PostgreSQL; every API process and every beat exports the same values.",
            DOMAIN,
        ),
        (
            "Work in each process",
            "Histograms each process keeps of its own work (a prefork worker's children share one).",
            PROCESS_LOCAL.values(),
        ),
        ("Alerts and the audit", "Read from the alerts' tables by every API process and beat.", ALERTS),
    )
    out = []
    for title, intro, metrics in groups:
        out += [f"## {title}", "", intro, "", "| metric | type | labels | help |", "|---|---|---|---|"]
        for m in metrics:
            labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
            out.append(f"| {_breakable(m.name)} | {m.type} | {labels} | {_cell(m.help)} |")
        out.append("")
    return "\n".join(out)


SECTIONS: dict[str, Callable[[], str]] = {
    "settings": settings_markdown,
    "openapi": http_markdown,
    "problems": problems_markdown,
    "metrics": metrics_markdown,
}


# --- the hooks --------------------------------------------------------------------------------------------------------


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, OPENAPI_FILE, content=json.dumps(openapi(), indent=2) + "\n"))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    def fill(found: re.Match[str]) -> str:
        name = found.group(1)
        if name not in SECTIONS:
            raise PluginError(
                f"{page.file.src_uri}: unknown marker <!-- keel:{name} --> (known: {', '.join(SECTIONS)})"
            )
        # In a block of its own (md_in_html), which docs/stylesheets/extra.css lays out for wide tables.
        return f'<div class="keel-generated" markdown="1">\n\n{SECTIONS[name]()}\n\n</div>'

    return MARKER.sub(fill, markdown)
