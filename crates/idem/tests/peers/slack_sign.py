"""Signs one Slack Events API request with `slack_sdk`'s SignatureVerifier (crates/idem/tests/it/webhooks.rs).

Reads {"secret", "timestamp", "body"} as JSON on stdin; prints the two X-Slack-* headers as JSON.
"""
import json
import sys

from slack_sdk.signature import SignatureVerifier

request = json.load(sys.stdin)
verifier = SignatureVerifier(request["secret"])
timestamp = str(request["timestamp"])
signature = verifier.generate_signature(timestamp=timestamp, body=request["body"])
headers = {"x-slack-request-timestamp": timestamp, "x-slack-signature": signature}
print(json.dumps(headers))
