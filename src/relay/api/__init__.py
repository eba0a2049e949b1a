"""Relay's HTTP API, one module per API: `openai` (/v1/...), `sglang` (/generate,
/abort_request), `admin` (health, info, metrics); what they share: `parsed_request` (the
ParsedRequest every parser produces), `errors`, `json_body`, `typed_fields`,
`sampling_fields` and `serving`; `docs` their OpenAPI description."""
