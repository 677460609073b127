"""Consul provider for nadisc: blocking-query discovery, self-registration, catalog."""
