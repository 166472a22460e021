"""Tandem models package."""
