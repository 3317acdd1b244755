"""A client of a model the server does not serve, in a process that exits normally (so
whatever it leaves pending is printed at exit, as a user would see it).

``python tests/service/wrong_model_client.py <addr>`` prints ``RESULT <json>``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from persisting.config import PersistingSettings
from persisting.service import KVCacheClient


async def main(addr: str) -> dict[str, Any]:
    settings = PersistingSettings(models=["other/model"])
    start = time.monotonic()
    try:
        client = await KVCacheClient.connect(seeds=[addr], model="other/model", settings=settings)
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    await client.close()
    return {"error": None}


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
