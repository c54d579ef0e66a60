"""One module per endpoint family; each turns a typed request into a response body or an SSE stream."""
