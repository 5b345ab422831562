#!/usr/bin/env bash
# Installs the third-party webhook implementations the route tests sign with (crates/idem/tests/it/webhooks.rs)
# into DIR: a Python virtualenv with the `standardwebhooks`, `stripe` and `slack_sdk` packages. The tests read the directory from
# IDEM_TEST_WEBHOOK_PEERS. Idempotent: an existing install of the pinned version is kept.
set -euo pipefail
dir="${1:?usage: scripts/webhook-peers.sh DIR}"
mkdir -p "$dir"
if ! "$dir/venv/bin/python" -c 'import standardwebhooks, stripe, slack_sdk' 2>/dev/null; then
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install --quiet standardwebhooks==1.1.0 stripe==16.1.0 slack_sdk==3.36.0
fi
"$dir/venv/bin/python" -c 'import standardwebhooks, stripe, slack_sdk; print("webhook peers: standardwebhooks, stripe", stripe.VERSION, "slack_sdk", slack_sdk.version.__version__, "(Python) in", "'"$dir"'")'
