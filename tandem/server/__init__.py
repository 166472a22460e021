"""Tandem server package."""
