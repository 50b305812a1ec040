"""A request's structured-output fields -> StructuredOutputsParams (one spelling per request).

OpenAI's `response_format` (json_object; json_schema, strict or not: the schema is always enforced), plus
SGLang's regex / grammar types; vLLM's `structured_outputs` object and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` fields.
"""
from __future__ import annotations

from ..structured import StructuredOutputError, StructuredOutputsParams
from .protocol import APIError, _SamplingFields


def structured_params(req: _SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint or None, the field it came from). A request that spells more than one is a 400."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format type 'json_schema' needs 'json_schema': {'name': ..., "
                                    "'schema': {...}}.", param="response_format.json_schema", code="invalid_value")
            found.append(("response_format", {"json": rf.json_schema.schema_}))
        else:  # regex / grammar
            value = getattr(rf, rf.type)
            if value is None:
                raise APIError(400, f"response_format type '{rf.type}' needs the '{rf.type}' field.",
                               param=f"response_format.{rf.type}", code="invalid_value")
            found.append(("response_format", {rf.type: value}))
    so = req.structured_outputs
    if so is not None:
        fields = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar)) if v is not None}
        if so.json_object:
            fields["json_object"] = True
        fields["disable_any_whitespace"] = so.disable_any_whitespace
        found.append(("structured_outputs", fields))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", {name: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(400, f"Give one structured-output constraint per request; got {', '.join(n for n, _ in found)}.",
                       param=found[1][0], code="invalid_value")
    param, fields = found[0]
    try:
        return StructuredOutputsParams(**fields), param
    except StructuredOutputError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None
