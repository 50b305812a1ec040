"""GET /docs: the API's routes as one self-contained HTML page, rendered on the server from /openapi.json.

FastAPI's default page loads Swagger UI from a CDN, so it is blank on a machine without internet access
(where local inference servers often run). No PyPI package ships a Swagger UI that renders OpenAPI 3.1
(what /openapi.json is) and is kept up to date, so this page has no scripts and no external assets: each
route with its summary, request body and responses, then every schema as JSON."""
from __future__ import annotations

import json
from html import escape
from typing import Any

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; padding: 0 1rem; color: #222; }
h1 { margin-bottom: .2rem; } .op { border: 1px solid #ddd; border-radius: 6px; margin: .8rem 0; padding: .6rem .9rem; }
.method { display: inline-block; min-width: 4.2rem; font-weight: 700; text-transform: uppercase; }
.get { color: #1769aa; } .post { color: #2e7d32; } code, pre { font-family: ui-monospace, monospace; }
pre { background: #f6f8fa; padding: .6rem; overflow-x: auto; font-size: 13px; } td { padding: 0 .8rem .1rem 0; }
"""


def _schema_name(schema: dict[str, Any]) -> str:
    ref = schema.get("$ref", "")
    return ref.rsplit("/", 1)[-1] if ref else schema.get("type", "object")


def _operation(path: str, method: str, op: dict[str, Any]) -> str:
    parts = [f'<div class="op" id="{escape(method)}-{escape(path)}">',
             f'<span class="method {escape(method)}">{escape(method)}</span> <code>{escape(path)}</code>']
    if op.get("summary"):
        parts.append(f" &mdash; {escape(op['summary'])}")
    if op.get("description"):
        parts.append(f"<p>{escape(op['description'])}</p>")
    body = op.get("requestBody", {}).get("content", {})
    if body:
        kinds = ", ".join(f"{escape(ct)}: <a href=\"#schema-{escape(_schema_name(c.get('schema', {})))}\">"
                          f"{escape(_schema_name(c.get('schema', {})))}</a>" for ct, c in body.items())
        parts.append(f"<p>Request body: {kinds}</p>")
    rows = "".join(f"<tr><td><code>{escape(str(code))}</code></td><td>{escape(r.get('description', ''))}</td></tr>"
                   for code, r in op.get("responses", {}).items())
    if rows:
        parts.append(f"<table>{rows}</table>")
    parts.append("</div>")
    return "".join(parts)


def render_docs(spec: dict[str, Any], openapi_url: str = "/openapi.json") -> str:
    info = spec.get("info", {})
    title = escape(str(info.get("title", "API")))
    ops = [_operation(path, method, op) for path, item in spec.get("paths", {}).items()
           for method, op in item.items() if isinstance(op, dict)]
    schemas = "".join(f'<details id="schema-{escape(name)}"><summary><code>{escape(name)}</code></summary>'
                      f"<pre>{escape(json.dumps(schema, indent=2))}</pre></details>"
                      for name, schema in spec.get("components", {}).get("schemas", {}).items())
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title} API</title>"
            f"<style>{_STYLE}</style></head><body><h1>{title} API</h1>"
            f"<p>Version {escape(str(info.get('version', '')))}, OpenAPI {escape(str(spec.get('openapi', '')))}. "
            f"The machine-readable schema: <a href=\"{escape(openapi_url)}\"><code>{escape(openapi_url)}</code></a> "
            f"(load it into any OpenAPI viewer or client generator).</p>"
            f"<h2>Routes</h2>{''.join(ops)}<h2>Schemas</h2>{schemas}</body></html>")
