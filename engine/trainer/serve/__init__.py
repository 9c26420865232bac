"""A trained drafter put to use: acceptance length τ against the real target, and the export vLLM and SGLang load."""
