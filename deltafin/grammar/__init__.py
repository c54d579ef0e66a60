"""Constrained decoding with xgrammar: response_format and enforced tool_choice.

- `constraints`: engine-neutral `Constraint` values and the check that xgrammar can build them;
- `compiled`: the compile cache (constraint, tokenizer) and the local engine's `constraint_factory`;
- `row`: one row's matcher and token bitmask (`RowConstraint`: fill_mask / accept / is_terminated);
- `gbnf`: structural tags as llama.cpp GBNF, for llama-server.
The structural tags forcing each family's tool-call markup are built by that markup (deltafin.markup).
"""
