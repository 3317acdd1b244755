"""A client of a model the server does not serve, in a process that exits normally (so
whatever it leaves pending is printed at exit, as a user would see it).

``python tests/service/wrong_model_client.py <addr>`` prints ``RESULT <json>``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from persisting.config import PersistingSettings
from persisting.service import KVCacheClient


async def main(addr: str) -> dict[str, Any]:
    # Discovery may wait an hour for servers: returning at all means the server refused.
    settings = PersistingSettings(models=["other/model"], service={"discovery_timeout_s": 3600})
    try:
        client = await KVCacheClient.connect(seeds=[addr], model="other/model", settings=settings)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    await client.close()
    return {"error": None}


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
