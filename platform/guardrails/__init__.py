"""Tenant guardrails: input and output policies enforced on every inference route.

- `checks`: the deterministic checks (terms, regexes, PII) as spans of a text;
- `guard`: a guard adapter's safe/unsafe verdict, one greedy token through the engine's own
  `generate`, so it is batched with the traffic it guards;
- `gate`: one request's policies: the input verdict (block, redact, flag) and the output
  filter's evaluations;
- `stream`: the output filter on the engine's outputs (streamed or not), a sliding window;
- `audit`: the events each block, redaction, flag or fail-open leaves;
- `routes`: the admin API (policies, events, counts) and the tenant's read-only view.

See docs/guardrails.md.
"""
