"""Tests of workers/base/: the codec, the Redis key schema and the bounds every layer stands on."""
