"""Grammars that force a family's native tool-call syntax, one module per syntax (the family that owns the
syntax calls its builder from its grammar hook). Each builder takes the calls a request forces and the
reasoning mode, and returns an xgrammar structural tag as a JSON-able dict."""

from deltafin.grammar.tool_calls.glm import GLM45, GLM47, glm_structure
from deltafin.grammar.tool_calls.hermes import HERMES, hermes_structure
from deltafin.grammar.tool_calls.kimi_k2 import KIMI_K2, kimi_k2_structure
from deltafin.grammar.tool_calls.selection import ForcedCalls, ForcedFunction, forced_calls, named_choice
from deltafin.grammar.tool_calls.syntax import Syntax
from deltafin.grammar.tool_calls.xtml import XTML, xtml_structure

__all__ = [
    "ForcedCalls", "ForcedFunction", "Syntax", "forced_calls", "named_choice",
    "glm_structure", "hermes_structure", "kimi_k2_structure", "xtml_structure",
    "GLM45", "GLM47", "HERMES", "KIMI_K2", "XTML",
]
