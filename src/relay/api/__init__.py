"""Relay's HTTP API, one module per API: `openai` (/v1/...), `sglang` (/generate,
/abort_request), `admin` (health, info, metrics); `fields` and `serving` are what they share,
`docs` their OpenAPI description."""
