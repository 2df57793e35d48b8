"""GDN state slots: live slots of running requests and checkpoint slots, one id space.

Slot ids ``[0, num_live)`` are live slots (one per running request, so a full checkpoint
pool can never keep a request from running); ``[num_live, num_live + num_checkpoint)``
are checkpoint slots. A slot id addresses the same slot in every GDN layer's conv and
recurrent state tensors, so restore and capture are plain slot-to-slot copies.

Every checkpoint slot is in exactly one state (see ``SlotState``); the cache manager moves
slots between states and ``check_integrity`` proves the accounting.
"""

from __future__ import annotations

import enum
from collections import deque


class SlotState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"  # staged for a capture by the in-flight step
    ATTACHED = "attached"  # holds a published checkpoint of one tree node
    TRACKING = "tracking"  # a running request's decode-time output-checkpoint slot


class StatePool:
    def __init__(self, num_live: int, num_checkpoint: int) -> None:
        if num_live < 0 or num_checkpoint < 0:
            raise ValueError("slot counts must be non-negative")
        self.num_live = num_live
        self.num_checkpoint = num_checkpoint
        self._free_live: deque[int] = deque(range(num_live))
        self._live_used = [False] * num_live
        self._free_ckpt: deque[int] = deque(range(num_live, num_live + num_checkpoint))
        self.ckpt_state: dict[int, SlotState] = {
            s: SlotState.FREE for s in range(num_live, num_live + num_checkpoint)
        }

    @property
    def num_slots(self) -> int:
        return self.num_live + self.num_checkpoint

    # -- live slots ---------------------------------------------------------------
    @property
    def num_free_live(self) -> int:
        return len(self._free_live)

    def allocate_live(self) -> int:
        if not self._free_live:
            raise RuntimeError("live state slots exhausted")
        slot = self._free_live.popleft()
        self._live_used[slot] = True
        return slot

    def free_live(self, slot: int) -> None:
        if not self._live_used[slot]:
            raise RuntimeError(f"double free of live slot {slot}")
        self._live_used[slot] = False
        self._free_live.append(slot)

    def live_in_use(self) -> list[int]:
        return [s for s, used in enumerate(self._live_used) if used]

    # -- checkpoint slots -----------------------------------------------------------
    @property
    def num_free_checkpoint(self) -> int:
        return len(self._free_ckpt)

    def allocate_checkpoint(self, state: SlotState) -> int:
        if not self._free_ckpt:
            raise RuntimeError("checkpoint slots exhausted")
        slot = self._free_ckpt.popleft()
        self.ckpt_state[slot] = state
        return slot

    def set_state(self, slot: int, state: SlotState) -> None:
        if self.ckpt_state[slot] is SlotState.FREE:
            raise RuntimeError(f"checkpoint slot {slot} is free")
        self.ckpt_state[slot] = state

    def free_checkpoint(self, slot: int) -> None:
        if self.ckpt_state[slot] is SlotState.FREE:
            raise RuntimeError(f"double free of checkpoint slot {slot}")
        self.ckpt_state[slot] = SlotState.FREE
        self._free_ckpt.append(slot)

    # -- shared pages (cache/arena.py): a checkpoint slot comes and goes with its page ----
    def add_checkpoint_slot(self, slot: int) -> None:
        if slot in self.ckpt_state or slot < self.num_live:
            raise RuntimeError(f"checkpoint slot {slot} exists already (or is a live slot)")
        self.ckpt_state[slot] = SlotState.FREE
        self._free_ckpt.append(slot)
        self.num_checkpoint += 1

    def remove_free_checkpoint_slot(self, slot: int | None = None) -> int:
        """A free checkpoint slot (``slot``, or the most recently freed) leaves the pool (its
        page changes use); the slot id."""
        if slot is None:
            if not self._free_ckpt:
                raise RuntimeError("no free checkpoint slot to give up")
            slot = self._free_ckpt.pop()
        elif self.ckpt_state.get(slot) is not SlotState.FREE:
            raise RuntimeError(f"checkpoint slot {slot} is not free")
        else:
            self._free_ckpt.remove(slot)
        del self.ckpt_state[slot]
        self.num_checkpoint -= 1
        return slot

    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.ckpt_state.values() if s is state)
