"""A corpus of realistic JSON Schemas (and regexes and choices) for structured-output tests.

Each is the kind of thing a typed client sends (a Pydantic model's schema, a form, an API
payload). Free-text strings carry a `maxLength` and arrays a `maxItems`: a random-weight
model closes a string only by chance (about one token in the vocabulary ends it), so an
unbounded string would run to max_tokens, which is the model's doing, not the grammar's.
The tiny test tokenizer is byte-level BPE, so it can spell every string here.
"""

from __future__ import annotations

from typing import Any

PERSON: dict[str, Any] = {
    "title": "Person",
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email", "maxLength": 24},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}

ORDER: dict[str, Any] = {
    "title": "Order",
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[A-Z]{2}[0-9]{3}$"},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["id", "status", "items"],
    "additionalProperties": False,
}

EVENT: dict[str, Any] = {
    "title": "Event",
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "day": {"type": "string", "format": "date"},
        "tags": {
            "type": "array",
            "items": {"enum": ["work", "home", "urgent"]},
            "maxItems": 3,
        },
        "attendees": {"type": "integer", "minimum": 1, "maximum": 500},
    },
    "required": ["id", "day", "tags"],
    "additionalProperties": False,
}

SHAPE: dict[str, Any] = {
    "title": "Shape",
    "oneOf": [
        {
            "type": "object",
            "properties": {
                "kind": {"const": "circle"},
                "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
            },
            "required": ["kind", "radius"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "kind": {"const": "rect"},
                "width": {"type": "integer", "minimum": 1, "maximum": 50},
                "height": {"type": "integer", "minimum": 1, "maximum": 50},
            },
            "required": ["kind", "width", "height"],
            "additionalProperties": False,
        },
    ],
}

ROUTE: dict[str, Any] = {
    "title": "Route",
    "type": "object",
    "$defs": {
        "point": {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
            "additionalProperties": False,
        }
    },
    "properties": {
        "start": {"$ref": "#/$defs/point"},
        "end": {"$ref": "#/$defs/point"},
        "stops": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
    },
    "required": ["start", "end"],
    "additionalProperties": False,
}

SETTING: dict[str, Any] = {
    "title": "Setting",
    "type": "object",
    "properties": {
        "key": {"type": "string", "pattern": "^[a-z]{1,8}(\\.[a-z]{1,8})?$"},
        "value": {
            "anyOf": [
                {"type": "integer", "minimum": -1000, "maximum": 1000},
                {"type": "boolean"},
                {"type": "string", "maxLength": 10},
                {"type": "null"},
            ]
        },
        "scope": {"type": "string", "enum": ["user", "system"]},
    },
    "required": ["key", "value"],
    "additionalProperties": False,
}

# (name, schema): every schema of the corpus.
JSON_SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("person", PERSON),
    ("order", ORDER),
    ("event", EVENT),
    ("shape", SHAPE),
    ("route", ROUTE),
    ("setting", SETTING),
]

REGEXES: list[tuple[str, str]] = [
    ("phone", r"\+33 [1-9]( [0-9]{2}){4}"),
    ("email", r"[a-z]{1,10}@(example|test)\.(com|org)"),
    ("version", r"v(0|[1-9][0-9]?)\.(0|[1-9][0-9]?)\.(0|[1-9][0-9]?)"),
]

CHOICES: list[tuple[str, list[str]]] = [
    ("sentiment", ["positive", "negative", "neutral"]),
    ("answer", ["yes", "no", "I don't know", 'it "depends"']),
]
