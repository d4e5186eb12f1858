"""Source converters: HF directory, GGUF, builtin SmolLM2, synthetic presets."""
