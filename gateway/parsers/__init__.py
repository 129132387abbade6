"""Streaming parsers of generated text into protocol-neutral events."""

from gateway.parsers.qwen import QwenParser, new_call_id

__all__ = ["QwenParser", "new_call_id"]
