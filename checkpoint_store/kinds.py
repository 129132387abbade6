"""What a record is to its sessions: the kind a put names (``CheckpointStore.put(..., kind)``).

The gateway knows each record's segment; the store needs only what that says about the next read:

- ``PREFIX``: a system prompt or tool list, shared by every request of a session and its subagents;
- ``TIP``: where a session resumes once its tool returns: the end of an answer that called one;
- ``IDLE``: where a session resumes once its user writes again, if ever: the end of an answer that
  called no tool, or of the next-turn history precomputed after it;
- ``TURN``: a message inside a prompt. Every later request of the session reads its KV (on the way
  to the tip), but its state only a request that edits the history right there.

``UNKNOWN`` (""): a put that names none (a spilled live sequence, a test).

The eviction order does not read them: on the CPU pressure benchmark, neither keeping a turn's state
out of RAM, nor a prefix as shared from its first put, nor an idle class (a tip whose tool outlived its
pin going first) came closer to the offline optimum at every budget (bench/RESULTS.md). The access
log carries them (``Access.segment``), so ``bench/pressure_replay.py`` shows each class's regrets.
"""

from __future__ import annotations

PREFIX = "prefix"
TIP = "tip"
IDLE = "idle"
TURN = "turn"
UNKNOWN = ""
KINDS = (PREFIX, TIP, IDLE, TURN, UNKNOWN)

