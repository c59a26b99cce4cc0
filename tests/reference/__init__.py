"""poise-trl against the POISE authors' reference implementation, on its outputs for fixed inputs
(tests/fixtures/reference)."""
