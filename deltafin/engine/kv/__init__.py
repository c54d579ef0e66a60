"""The KV cache and what lives beside it: cache layers per layer kind (attention KV, linear-attention state),
the batch of rows' caches (`batch`), and the prefix cache that reuses a prompt's cached prefix in tiers
(`prefix_cache`: RAM under a byte budget; `disk_tier` and `block_file`: blocks on disk that outlive the process;
`checkpoints`: copies of a hybrid model's recurrent state during prefill; `tier_stats`: their counters).

The contract a model's cache keeps so that all of this works for it (transformers' models keep it; a model of
the engine's own, such as Kimi K3's, keeps it by using the same layer classes):
- the cache is a `DynamicCache` whose `layers` are the kinds `cache_layers.SUPPORTED` lists, one per decoder layer;
- an attention layer holds `keys` and `values` [B, H, S, D] for positions 0..S-1 (no sliding window), and a
  forward pass only ever appends positions (a new tensor, or writes past the end of the views it was handed as
  its own: `prefix_cache.SOLE_OWNER`), so a view of the first M positions is the cache of those M tokens;
- a state layer (`LinearAttentionCacheLayerMixin`) holds its whole state in `conv_states` / `recurrent_states`
  (indexed by state number, with their `is_*_initialized` flags, `conv_kernel_size` and `has_previous_state`):
  after a forward pass over a window the tables are the state after exactly the tokens fed so far, whatever the
  split into windows, so copying the tables (`cache_layers.capture_states`) at position M and putting them back
  (`restore_states`) resumes there;
- the prompt's prefill runs `model(input_ids=[1, C], cache=...)` windows (`PromptPrefill`), which stop at every
  checkpoint position the cache's `CheckpointBook` names.
"""
