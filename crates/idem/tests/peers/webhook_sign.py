"""Signs one Standard Webhooks delivery with the `standardwebhooks` package (crates/idem/tests/it/webhooks.rs).

Reads {"secret", "id", "timestamp", "body"} as JSON on stdin; prints the three webhook-* headers as JSON.
"""
import json
import sys
from datetime import datetime, timezone

from standardwebhooks import Webhook

request = json.load(sys.stdin)
signature = Webhook(request["secret"]).sign(
    request["id"], datetime.fromtimestamp(request["timestamp"], tz=timezone.utc), request["body"]
)
print(json.dumps({
    "webhook-id": request["id"],
    "webhook-timestamp": str(request["timestamp"]),
    "webhook-signature": signature,
}))
