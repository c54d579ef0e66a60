"""Tokens to text, shared by every engine: the incremental detokenizer, the stop-string matcher, and the
per-choice decoder that turns a choice's token ids into text deltas and a finish reason."""
