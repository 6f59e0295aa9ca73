"""Tests of workers/providers/: the model adapters, retries, output schemas and routing."""
