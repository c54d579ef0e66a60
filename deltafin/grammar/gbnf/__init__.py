"""llama.cpp GBNF for the constraints Deltafin builds: structural tags (enforced tool calls, reasoning before
a constrained answer) for upstreams that read GBNF only, i.e. llama-server."""

from deltafin.grammar.gbnf.structural import structural_tag_to_gbnf

__all__ = ["structural_tag_to_gbnf"]
