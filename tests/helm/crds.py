"""Validation of custom resources against their CustomResourceDefinitions, as an API server
with the CRD installed would: the published CRDs (tests/helm/crds/, see README.md there)
read as JSON schemas, with the API server's rules on top of plain JSON schema:

- defaults (`default:`) are filled in before anything is checked;
- an unknown field is an error (kubectl's default `--validate=strict`), except where the
  schema says `x-kubernetes-preserve-unknown-fields`;
- `nullable`, `x-kubernetes-int-or-string` as Kubernetes reads them;
- every `x-kubernetes-validations` CEL rule evaluated (with the `cel` package) on the value
  it is attached to; lists of `x-kubernetes-list-type` map or set hold no duplicate keys.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import cel
import jsonschema
import yaml

CRDS = Path(__file__).parent / "crds"


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, for every vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if version.get("served", True):
                    api_version = f"{spec['group']}/{version['name']}"
                    out[(api_version, spec["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return out


def known(api_version: str, kind: str) -> bool:
    return (api_version, kind) in _crd_schemas()


def _json_schema(node: dict) -> dict:
    """An OpenAPI v3 structural schema (a CRD's) as a JSON schema with Kubernetes' meaning."""
    out: dict = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "format"):
            continue
        if key == "properties":
            out[key] = {k: _json_schema(v) for k, v in value.items()}
        elif key in ("items", "not") or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = _json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [_json_schema(v) for v in value]
        elif key == "pattern" and value.startswith("^(?i)"):
            # Go's regexp takes inline flags anywhere; Python's only at the very start.
            out[key] = "(?i)^" + value[len("^(?i)") :]
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = out.get("anyOf", []) + [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _defaulted(value, schema: dict):
    """`value` with the schema's defaults filled in where fields are absent (a copy)."""
    if isinstance(value, dict):
        value = dict(value)
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        for name, item in value.items():
            if name in props:
                value[name] = _defaulted(item, props[name])
            elif isinstance(schema.get("additionalProperties"), dict):
                value[name] = _defaulted(item, schema["additionalProperties"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [_defaulted(v, schema["items"]) for v in value]
    return value


def _server_rules(value, schema: dict, path: str) -> list[str]:
    """The checks beyond JSON schema: CEL rules and list keys, on `value` and below."""
    errors = []
    list_type = schema.get("x-kubernetes-list-type")
    if isinstance(value, list) and list_type in ("map", "set"):
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = [repr([v.get(k) for k in keys]) if list_type == "map" else repr(v) for v in value]
        if len(set(seen)) != len(seen):
            errors.append(f"{path}: duplicate entries in a list of type {list_type}")
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: only meaningful on an update
        try:
            ok = cel.evaluate(rule["rule"], {"self": value})
        except Exception as e:  # a rule that cannot be evaluated fails, as on the server
            ok = f"could not be evaluated: {e}"
        if ok is not True:
            errors.append(f"{path or '.'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, item in value.items():
            sub = props.get(name, schema.get("additionalProperties"))
            if isinstance(sub, dict):
                errors += _server_rules(item, sub, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += _server_rules(item, schema["items"], f"{path}[{i}]")
    return errors


@functools.cache
def _validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = _json_schema(_crd_schemas()[(api_version, kind)])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(resource: dict) -> list[str]:
    """What the API server would refuse in `resource` (empty: it would be accepted)."""
    schema = _crd_schemas()[(resource["apiVersion"], resource["kind"])]
    value = _defaulted(resource, schema)
    validator = _validator(resource["apiVersion"], resource["kind"])
    found = [f"{'.'.join(map(str, e.absolute_path)) or '.'}: {e.message}"
             for e in validator.iter_errors(value)]  # fmt: skip
    return found + _server_rules(value, schema, "")
