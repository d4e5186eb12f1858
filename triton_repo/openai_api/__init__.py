"""An OpenAI-compatible HTTP frontend (FastAPI) in front of a kvq Triton deployment."""
