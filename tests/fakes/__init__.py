"""Fake servers for tests (and benches): small, loopback-only, no dependency on the code under test."""
