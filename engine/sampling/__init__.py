"""The sampler's stages, one module each; engine/sampler.py runs them in order."""
