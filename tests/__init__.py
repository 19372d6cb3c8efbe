"""fp8kv's test suite; shared helpers in tests.helpers, cases in tests.cases."""
