"""The built-in torch engine: one owner thread that prefills and decodes every running row in each step.

`engine` (the `EngineClient`), `steps` (which decode step runs a model), `generator` (prefill and the
transformers forward), `sampler`, `row` (one request's state), `matcher` (what a grammar gives a row).
The caches it runs on are in `deltafin.engine.kv`, the weights it loads in `deltafin.engine.weights`."""
