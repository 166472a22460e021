"""Tandem models/qwen3_5 package."""
