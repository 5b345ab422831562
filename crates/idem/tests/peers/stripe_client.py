"""One Stripe API call through `idem serve --upstream` with the real `stripe` package
(crates/idem/tests/it/webhooks.rs): `stripe_client.py API_BASE IDEMPOTENCY_KEY` creates a customer with
`max_network_retries=2` and prints the outcome as JSON: {"outcome": "ok"} or {"outcome": "error", "status": N}.
"""
import json
import sys

import stripe

stripe.api_key = "sk_test_idem_proxy"
stripe.api_base = sys.argv[1]
stripe.max_network_retries = 2
try:
    stripe.Customer.create(email="customer@example.com", idempotency_key=sys.argv[2])
    print(json.dumps({"outcome": "ok"}))
except stripe.StripeError as e:
    print(json.dumps({"outcome": "error", "status": e.http_status}))
