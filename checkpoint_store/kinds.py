"""What a record is to its sessions: the kind a put names (``CheckpointStore.put(..., kind)``).

The gateway knows each record's segment; the store needs only what that says about the next read:

- ``PREFIX``: a system prompt or tool list, shared by every request of a session and its subagents;
- ``TIP``: where a session resumes once its tool returns: the end of an answer that called one;
- ``IDLE``: where a session resumes once its user writes again, if ever: the end of an answer that
  called no tool, or of the next-turn history precomputed after it. A tip whose tool outlived its pin
  becomes one (``CheckpointStore.idle``);
- ``TURN``: a message inside a prompt. Every later request of the session reads its KV (on the way
  to the tip), but its state only a request that edits the history right there.

``UNKNOWN`` (""): a put that names none (a spilled live sequence, a test); the store then goes by the
record's place in the chains alone.

Eviction (``eviction``, ``hit_density``): an idle record is a class of its own, learned like the
others (before any reuse: below every other), and when an idle leaf's KV goes, its parent, left
without children, is idle too: a session waiting on a person gives up its chain from the tip back,
before sessions whose tools run. The other kinds travel with the record (the benchmark's access log
shows them) and leave the order to the record's place in its chains.
"""

from __future__ import annotations

PREFIX = "prefix"
TIP = "tip"
IDLE = "idle"
TURN = "turn"
UNKNOWN = ""
KINDS = (PREFIX, TIP, IDLE, TURN, UNKNOWN)

