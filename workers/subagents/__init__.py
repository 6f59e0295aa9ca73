"""Subagent providers: definitions (`definitions`), a child's scope (`scope`), capabilities, and launch plans."""
