"""What the tests share: adapters and pool jobs they import by module path (no test file imports another)."""
