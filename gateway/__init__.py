"""The HTTP/JSON gateway: dlsched's REST API, transcoded to the gRPC services.

Routes come from the ``google.api.http`` options in protos/dlsched/v1 (read
from the generated descriptors at start-up, ``rules.py``); requests and
responses use protobuf's JSON mapping (``transcode.py``); errors keep their
``google.rpc.Status`` with ErrorInfo reason and BadRequest fields
(``status.py``); ``openapi.py`` prints the same routes as OpenAPI 3;
``app.py`` is the aiohttp server. Run it with ``python -m gateway``.

Why a transcoder of our own rather than PyPI's ``connectrpc``: Connect serves
each RPC at ``POST /<package>.<Service>/<Method>``; the seed asks for a REST
API with resource routes (``GET /v1/jobs/{id}``, ``POST /v1/jobs/{id}:stop``),
which is what ``google.api.http`` declares and what Envoy's gRPC-JSON
transcoder serves in a mesh (``deploy/envoy/``). This gateway applies the same
annotations with the same semantics where no Envoy runs, in about a thousand
lines over aiohttp and protobuf's own JSON mapping, so both front ends come
from one source and cannot drift.
"""
