"""The bridge through the service: a client process saves and restores a prefix with
``SyncKVCacheClient`` and compares suffix logits with those of the original cache.

``python tests/integrations/hf_client_task.py '<json args>'`` prints ``RESULT <json>`` and
leaves with ``os._exit`` (Pulsing 0.1.2 may crash at interpreter exit after a shutdown).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from persisting.config import PersistingSettings
from persisting.integrations.transformers import forward, load_prefix, save_prefix
from persisting.kv import TokenHasher
from persisting.service import SyncKVCacheClient
from tests.integrations.hf_helpers import CHUNK, KV_HEADS, MODEL, prompt, tiny_llama


def main(args: dict) -> dict:
    settings = PersistingSettings(models=[MODEL], service={"discovery_timeout_s": 20.0})
    client = SyncKVCacheClient.connect(seeds=args["seeds"], model=MODEL, settings=settings)
    try:
        hasher = TokenHasher(MODEL, chunk_size=CHUNK, dtype="float")
        model = tiny_llama()
        ids = prompt(300, seed=7)
        with torch.no_grad():
            _, original = forward(model, ids[:, :256])
            saved = save_prefix(client, ids[:, :256], original, hasher=hasher)
            expected, _ = forward(model, ids[:, 256:], original)
            n, restored = load_prefix(
                client, ids, num_kv_heads=KV_HEADS, dtype=torch.float32, hasher=hasher
            )
            got, _ = forward(model, ids[:, n:], restored)
        return {"saved": saved, "loaded": n, "exact": bool(torch.equal(got, expected))}
    finally:
        client.close()


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
