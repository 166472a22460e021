"""The Qwen3-Next text model (``Qwen3NextForCausalLM``): the Qwen3.5-MoE predecessor with fused GDN projections."""
