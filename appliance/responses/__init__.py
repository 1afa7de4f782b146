"""The OpenAI Responses API (`/v1/responses`), independent of the frontend that serves it.

A request's items become a chat conversation rendered and parsed by the one OpenAI dialect
(appliance/dialect: chat template, tool and reasoning parsers, structured outputs); the
engine's text comes back as Responses output items and stream events; stored responses
live in an SQLite store owned by the caller. HTTP (appliance/http/responses.py) and native
gRPC (appliance/grpc/native_responses.py) call the same pieces. See docs/responses.md.
"""
