"""The HTTP/JSON gateway: dlsched's REST API, transcoded to the gRPC services.

Routes come from the ``google.api.http`` options in protos/dlsched/v1 (read
from the generated descriptors at start-up, ``rules.py``); requests and
responses use protobuf's JSON mapping (``transcode.py``); errors keep their
``google.rpc.Status`` with ErrorInfo reason and BadRequest fields
(``status.py``); ``openapi.py`` prints the same routes as OpenAPI 3;
``app.py`` is the aiohttp server. Run it with ``python -m gateway``.
"""
