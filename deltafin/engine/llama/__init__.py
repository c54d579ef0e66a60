"""Decode steps written for the Llama architecture: fused projections in torch (`fused`), the same with
static shapes under torch.compile (`fused_static`), and the whole step in C over GGUF blocks (`native`).
`deltafin.engine.local.steps` chooses among them."""
