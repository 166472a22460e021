"""Tandem formats package."""
