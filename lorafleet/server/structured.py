"""The request fields that ask for structured output, read the same on both routes: OpenAI's
`response_format` (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` object
(`json`, `regex`, `choice`, `grammar`, `json_object`) and its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`. One of them may constrain a request; a field
or key that would change the output and is not honoured is refused by name, never ignored.
`guided_decoding_backend` only picks vLLM's engine, so it is accepted and has no effect here.
"""

from __future__ import annotations

from typing import Any

from lorafleet.errors import InvalidRequestError
from lorafleet.model.grammar import ANY_JSON_OBJECT, Constraint

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# structured_outputs keys that change what is generated and are not served (false or null: allowed)
REFUSED_KEYS = ("structural_tag", "whitespace_pattern", "disable_any_whitespace", "disable_additional_properties")



def _response_format(fmt: Any) -> Constraint | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequestError("response_format must be an object with a type", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", ANY_JSON_OBJECT, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise InvalidRequestError("response_format: json_schema needs an object with a schema "
                                      '({"name": ..., "schema": {...}})', param="response_format")
        return Constraint.of("json_schema", spec["schema"], "response_format")
    raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                              param="response_format")


def _structured_outputs(so: Any) -> list[Constraint]:
    if not isinstance(so, dict):
        raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
    refused = [k for k in REFUSED_KEYS if so.get(k) not in (None, False)]
    unknown = [k for k in so if k not in KEYS and k not in REFUSED_KEYS and k != "json_object"]
    if refused or unknown:
        raise InvalidRequestError(f"structured_outputs: {', '.join(refused + unknown)} not supported; "
                                  f"use one of {', '.join(KEYS)} or json_object", param="structured_outputs")
    found = [Constraint.of(kind, so[k], f"structured_outputs.{k}") for k, kind in KEYS.items() if so.get(k) is not None]
    if so.get("json_object") not in (None, False):
        if so["json_object"] is not True:
            raise InvalidRequestError("structured_outputs.json_object must be true or false",
                                      param="structured_outputs")
        found.append(Constraint("json_schema", ANY_JSON_OBJECT, "structured_outputs.json_object"))
    return found


def constraint(body: dict) -> Constraint | None:
    """The request's structured output, or None; a 400 naming the field for a malformed or
    unsupported one, or for more than one."""
    found = []
    if body.get("response_format") is not None:
        c = _response_format(body["response_format"])
        found += [c] if c is not None else []
    if body.get("structured_outputs") is not None:
        found += _structured_outputs(body["structured_outputs"])
    found += [Constraint.of(kind, body[f], f) for f, kind in GUIDED.items() if body.get(f) is not None]
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidRequestError("guided_whitespace_pattern is not supported", param="guided_whitespace_pattern")
    if len(found) > 1:
        raise InvalidRequestError(f"one structured output a request: {found[0].param} and {found[1].param} both "
                                  "constrain this one", param=found[1].param)
    return found[0] if found else None
