"""Code the tests and tools/ share: references, tolerances, reference models and fixtures (docs/development.md)."""
