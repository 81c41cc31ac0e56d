"""The adapter of transformers' internals: what hf_dsinfer reads or wraps inside transformers
beyond its public API (output capture, checkpoint key renaming, the continuous-batching
manager). The layers above (injection, parallel, offload) go through these modules, so a
transformers release that moves an internal breaks one file here.

`hf_dsinfer.integration` is the other end: it plugs hf_dsinfer into transformers' entry points
(`from_pretrained(dsinfer=...)`, the quantizer registry) and sits at the top of the layers."""
