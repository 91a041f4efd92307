"""What the gateway's route modules share: the app's `ServerArgs` key and JSON body reading."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from encoder_server.api import ApiError
from encoder_server.config import ServerArgs

ARGS = web.AppKey("args", ServerArgs)


async def json_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        raise ApiError(400, "empty request body; expected JSON")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
