"""The stable import path of the message model that the fork-history contract names (`parse_history`).

The model lives in `workers.history.messages`; nothing inside forkq imports this module.
"""

from workers.history.messages import Content, FunctionCall, FunctionResponse, Part, dump_contents, parse_history

__all__ = ["Content", "FunctionCall", "FunctionResponse", "Part", "dump_contents", "parse_history"]
