"""The ground floor: the vocabulary every other package shares.

KV events and engine statistics (`events`), token streams and vLLM's block-hash chain
(`tokens`), the GPU step-time profile (`profile`), the per-block loops of the simulated KV
cache and prefix index (`blockops`, compiled when built). It imports nothing else of wasma.
"""
