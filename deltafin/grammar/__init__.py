"""Constrained decoding with xgrammar: response_format and enforced tool_choice.

- `constraints`: engine-neutral `Constraint` values and xgrammar's reading of them;
- `limits`: cheap structural limits checked before any compile;
- `service`: `Grammars`, constraint -> a grammar ready for the engine: outcomes cached, compiles in `lanes`
  (processes running `worker_process`, killed past a time budget), never on the event loop or the engine's thread;
- `compiled`: `ReadyGrammar` (what a job carries to the engine) and the tokenizer info xgrammar needs;
- `row`: one row's matcher and token bitmask (`RowMatcher`: fill_mask / accept / is_terminated);
- `gbnf`: structural tags as llama.cpp GBNF, for llama-server.
The structural tags forcing each family's tool-call markup are built by that markup (deltafin.markup).
"""
