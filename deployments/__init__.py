"""Ray Serve deployments: drafter pool, verifier pool, router with the OpenAI-compatible HTTP API."""
