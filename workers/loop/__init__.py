"""The child agent loop: model call, tool calls, approvals, final answer; and its revival replay.

No Redis, no Celery: the loop writes through the journal sink it is given."""
