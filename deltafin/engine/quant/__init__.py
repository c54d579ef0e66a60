"""Weight formats other than float: linear layers over int8 / int4 / GGUF blocks (`linear`) and the
quantizer that turns a float model's projections into them (`quantize`). Their C kernels: `deltafin.engine.kernels`."""
