"""Adapters from serving engines' live objects to mmreuse's inputs (duck-typed; no engine import)."""
