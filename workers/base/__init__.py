"""The base every layer stands on: the msgpack codec, the Redis key schema, text and size limits, optional extras."""
