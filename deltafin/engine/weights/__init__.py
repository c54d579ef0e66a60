"""Finding and loading a model: paths (folders, GGUF files, packaged models), architectures the engine runs
(or refuses, in one line), GGUF reading and native blocks, the tokenizer alone for upstream engines."""
