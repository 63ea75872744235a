"""xla-fp4: NVFP4 training for unmodified JAX programs."""
