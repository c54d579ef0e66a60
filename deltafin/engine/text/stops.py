"""Stop strings on streamed text: cut at the first match, hold back what may be the start of one."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now; after a match, `matched` is set and nothing more comes."""
        if not self._stops:
            return text
        buffer = self._held + text
        hits = [(buffer.find(stop), stop) for stop in self._stops]
        found = [(index, stop) for index, stop in hits if index >= 0]
        if found:
            index, self.matched = min(found)
            self._held = ""
            return buffer[:index]
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation the held text turned out not to be a stop string: release it."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if stop.startswith(buffer[-size:]):
                    best = size
                    break
        return best
