"""A fork's persistent formats: the bootstrap record, state and result, parked calls, the step journal, seed chunks.

Pure: these encode and decode bytes; the store writes them to Redis."""
