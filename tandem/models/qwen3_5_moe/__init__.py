"""The Qwen3.5 mixture-of-experts text model (``Qwen3_5MoeForConditionalGeneration`` / ``Qwen3_5MoeForCausalLM``)."""
